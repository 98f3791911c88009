"""The engine-identity check of ``compare`` and ``best``: points measured by engines of different
identities (:mod:`ckpteval.coord.results.engine_identity`: engine, version, dtype, parallel layout, deterministic
mode, concurrency) are not compared unless the caller says so (``--allow-engine-mismatch``).

Why: the same weights move by points between engines and engine settings (a greedy sglang run without
its deterministic mode changes about half its generations between two runs at 64-way concurrency), so a
difference between two such points is partly the engine's; the paired interval does not know that.

Guarantee: :func:`check_engines` refuses (ValueError naming the points and the fields that differ, and
the flag) whenever two of the given points' identities differ by :func:`~ckpteval.coord.results.engine_identity.differing_fields`;
a point that recorded no identity (results from before it) differs from one that did, two that did not
are not told apart. Allowed, it returns the same differences as notes for the output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from ckpteval.coord.results.engine_identity import EngineIdentity, differing_fields, explain, parse_identity
from ckpteval.jobs.decide.data import RunValues

ALLOW_FLAG = "--allow-engine-mismatch"
T = TypeVar("T")


def point_engine(side: RunValues, step: int, dataset: str) -> EngineIdentity | None:
    """The engine identity of ``dataset``'s point at ``step`` (one: a point pools only units of one
    identity, :func:`ckpteval.coord.results.points.derive_point`); None when its units recorded none."""
    spec = side.manifest.entry(dataset)
    for unit in spec.units(step):
        result = side.results.get(unit)
        if result is not None and (identity := parse_identity(result.engine)) is not None:
            return identity
    return None


def mismatch_notes(points: Sequence[tuple[str, T]], differs: Callable[[T, T], str | None]) -> list[str]:
    """``"<first> and <label> <how they differ>"`` for every point (``(label, identity)`` pairs) whose identity
    ``differs`` from the first's (``differs`` returns None for the same identity)."""
    if not points:
        return []
    first_label, first = points[0]
    return [f"{first_label} and {label} {how}" for label, identity in points[1:]
            if (how := differs(first, identity)) is not None]


def engine_difference(a: EngineIdentity | None, b: EngineIdentity | None) -> str | None:
    fields = differing_fields(a, b)
    return f"ran on different engines ({', '.join(fields)}: {explain(fields, a, b)})" if fields else None


def refuse_mismatches(points: Sequence[tuple[str, T]], differs: Callable[[T, T], str | None], remedy: str,
                      allow: bool) -> list[str]:
    """Every point against the first: ValueError (the first difference, then ``remedy``) unless ``allow``;
    the differences as notes (empty when there are none)."""
    notes = mismatch_notes(points, differs)
    if notes and not allow:
        raise ValueError(f"{notes[0]}; {remedy}")
    return notes


def check_engines(points: Sequence[tuple[str, EngineIdentity | None]], allow: bool) -> list[str]:
    """Every point against the first (``(label, identity)`` pairs): ValueError on a difference unless
    ``allow``; the differences as notes (empty when there are none)."""
    return refuse_mismatches(points, engine_difference, "their difference is partly the engine's — rerun one side "
                             f"on the other's engine, or pass {ALLOW_FLAG} to compare anyway", allow)
