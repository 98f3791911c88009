"""The scorer-identity check of ``compare`` and ``best``: points scored by scorers of different identities (the
``scorer`` a unit's result records: the scorer and its settings, a judge's model, the code sandbox's bounds,
the chat template's arguments, the reasoning setting, an lm-eval task's settings) are not compared unless
the caller says so (``--allow-scorer-mismatch``).

Why: a point pools only units of one scorer identity (:func:`ckpteval.coord.results.points.derive_point`), but two
points of one run (a judge model that changed between steps, ``enable_thinking`` switched on) or of two runs
can each be whole and still not measure the same thing; their difference is then partly the scorer's.

Guarantee: :func:`check_scorers` refuses (ValueError naming the points, the fields that differ and the
flag) whenever two of the given points' identities differ in any field; a point whose results recorded no
identity (results from before it, or a kind that records none) differs from one that did, two that did not
are not told apart. Allowed, it returns the differences as notes for the output. Limits: the identity is
what the worker recorded; a scorer that changes without changing its identity (a hosted judge behind a
moving alias that reports one model name) is not seen.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ckpteval.jobs.decide.data import RunValues
from ckpteval.jobs.decide.engines import refuse_mismatches

ALLOW_SCORER_FLAG = "--allow-scorer-mismatch"


def point_scorer(side: RunValues, step: int, dataset: str) -> dict[str, Any] | None:
    """The scorer identity of ``dataset``'s point at ``step`` (one: a point pools only units of one identity);
    None when its units recorded none."""
    for unit in side.manifest.entry(dataset).units(step):
        result = side.results.get(unit)
        if result is not None and result.scorer:
            return dict(result.scorer)
    return None


def _shown(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if value is not None else "none"
    return text if len(text) <= 40 else text[:37] + "..."


def scorer_difference(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str | None:
    if a == b:
        return None
    if a is None or b is None:
        return "were scored by different scorers (one recorded no scorer identity)"
    fields = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    shown = ", ".join(f"{k} {_shown(a.get(k))} vs {_shown(b.get(k))}" for k in fields)
    return f"were scored by different scorers ({', '.join(fields)}: {shown})"


def check_scorers(points: Sequence[tuple[str, dict[str, Any] | None]], allow: bool) -> list[str]:
    """Every point against the first (``(label, identity)`` pairs): ValueError on a difference unless
    ``allow``; the differences as notes (empty when there are none)."""
    return refuse_mismatches(points, scorer_difference, "their difference is partly the scorer's — rescore one "
                             f"side with the other's scorer (ckpteval rescore), or pass {ALLOW_SCORER_FLAG} to "
                             "compare anyway", allow)
