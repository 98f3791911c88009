"""Entries of run.json's ``eval.datasets``: one module per kind, named as the kind's room in ``jobs/eval/kinds/``.

Each kind is a frozen dataclass (:class:`~.generate.GenerateEntry`, :class:`~.lm_eval.LmEvalEntry`,
:class:`~.env.EnvEntry`): its fields are its run.json settings, and it answers :class:`Entry` (a per-sample kind also
:class:`SamplesEntry`). :data:`KINDS` names each kind's two halves (``module:attr``, imported on first use; coord
never imports ``jobs``). Adding a kind: a module with its settings class and jobs-side ``evaluate(engine, cache,
spec, unit, snapshot, want)`` (optionally ``check(cache, spec)``), and one line in :data:`KINDS`
(``tests/support/echo_kind.py`` is one). Guarantee: an entry is validated when run.json is parsed; an unknown
kind is refused naming the closest. Limits: a kind's module is imported by every process parsing a run using it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeGuard

from ckpteval.coord.registry import Registry
from ckpteval.coord.run.fields import NAME_RE, FieldError
from ckpteval.coord.work.workunit import WorkUnit


class PointRule(enum.Enum):
    """How a kind's units make its point (:mod:`ckpteval.coord.results.points`)."""

    SAMPLES = "samples"  # pooled per-sample scores (a SamplesEntry)
    METRICS = "metrics"  # each unit's own metrics (an lm-eval task's)


class EngineNeed(enum.Enum):
    """Which backends can run a kind."""

    ANY = "any"  # an engine, or an fn: backend (which scores whole units)
    GENERATING = "generating"  # an engine (not an fn: backend)
    ONE = "one"  # exactly one engine, no pool (a library's own adapter)


class Entry(Protocol):
    """What every kind's settings dataclass answers (see the module docstring)."""

    KIND: ClassVar[str]
    POINT_RULE: ClassVar[PointRule]
    ENGINES: ClassVar[EngineNeed]
    CHECKED: ClassVar[tuple[tuple[str, str], ...]]  # (name field, options field) run through a registry check
    name: str
    kind: str
    every: int  # due at steps that are multiples of it

    @property
    def n_shards(self) -> int: ...

    @property
    def samples_randomly(self) -> bool: ...

    def due(self, step: int) -> bool: ...

    def units(self, step: int) -> list[WorkUnit]: ...

    def metric_roots(self) -> tuple[str, ...]: ...

    def user_code(self) -> set[str]: ...


class SamplesEntry(Entry, Protocol):
    """An entry of point rule ``samples``: what :func:`ckpteval.coord.results.points.dataset_score` reads."""

    n_prompts: int
    shard_size: int
    n_samples: int
    pass_k: tuple[int, ...]

    @property
    def sample_parts(self) -> int: ...

    @property
    def pass_threshold(self) -> float: ...


def check_kind_and_name(entry: Any, what: str) -> None:
    """An entry's ``kind`` is its class's ``KIND`` and its ``name`` fits file and metric names (``what``: how the
    refusal calls the entry, e.g. "an lm_eval entry")."""
    if entry.kind != entry.KIND:
        raise FieldError("kind", f"{entry.kind!r} is not the kind of {what}")
    if not NAME_RE.match(entry.name):
        raise FieldError("name", f"{entry.name!r} must match {NAME_RE.pattern} (it is used in file and metric names)")


def scored_per_sample(entry: Entry) -> TypeGuard[SamplesEntry]:
    """Whether ``entry``'s point pools per-sample scores (it is a :class:`SamplesEntry`)."""
    return entry.POINT_RULE is PointRule.SAMPLES


@dataclass(frozen=True)
class Kind:
    """One registry line: where a kind's halves live (``module:attr``, imported on first use)."""

    settings: str
    """The settings dataclass (an :class:`Entry`)."""
    evaluate: str
    """``evaluate(engine, cache, spec, unit, snapshot, want) -> Evaluation`` on an engine pinned to ``want``."""
    check: str = ""
    """``check(cache, spec)`` at worker start (rows, scorer, library present); "": none."""


KINDS: Registry[Kind] = Registry(
    "a kind",
    ("generate", Kind("ckpteval.coord.entries.generate:GenerateEntry",
                      "ckpteval.jobs.eval.kinds.generate.scoring:evaluate_generate",
                      "ckpteval.jobs.eval.kinds.generate.scoring:check_generate")),
    ("lm_eval", Kind("ckpteval.coord.entries.lm_eval:LmEvalEntry", "ckpteval.jobs.eval.kinds.lm_eval:evaluate_harness",
                     "ckpteval.jobs.eval.kinds.lm_eval:check_harness_entry")),
    ("env", Kind("ckpteval.coord.entries.env:EnvEntry", "ckpteval.jobs.eval.kinds.env.runner:evaluate_env",
                 "ckpteval.jobs.eval.kinds.env.runner:check_env_entry")),
    ("catalog", Kind("ckpteval.coord.entries.catalog:CatalogEntry",
                     "ckpteval.jobs.eval.kinds.generate.scoring:evaluate_generate",
                     "ckpteval.jobs.eval.catalog.expand:check_catalog_entry")),
    unknown="{name!r} must be one of {known} ({hint}default generate)", key="kind",
)


def entry_class(kind: str) -> type:
    """The settings dataclass of ``kind`` (a FieldError of ``kind`` when it is not registered)."""
    return KINDS.load(kind, KINDS.entry(kind).settings)  # type: ignore[no-any-return]

__all__ = ["KINDS", "Kind", "Entry", "SamplesEntry", "PointRule", "EngineNeed", "scored_per_sample", "entry_class"]
