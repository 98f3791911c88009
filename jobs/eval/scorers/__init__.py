"""The scorer registry (:data:`SCORERS`: name -> lazily imported class) and the interface every scorer speaks.

A dataset's ``scorer`` is a name of :data:`SCORERS` or a ``module:function`` (:class:`~ckpteval.jobs.eval.scorers.basic.FunctionScorer`);
its ``scorer_options`` are validated by the class's ``parse_options`` wherever run.json is parsed (:func:`check_scorer`,
installed by :func:`ckpteval.jobs.eval.kinds.evaluate.install_checks`). Adding a scorer (a class and one line in
:data:`SCORERS`), failures, counters and extras: docs/USER_GUIDE.md "Adding a scorer".

Limits: a scorer runs in the worker's process with its privileges (``module:function`` code is imported
only under the trust rule, :mod:`ckpteval.jobs.eval.proof.trust`); scoring is synchronous per unit.
"""

from __future__ import annotations

import dataclasses
import math
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.registry import Registry
from ckpteval.coord.results.files import SCORE_BOUND
from ckpteval.coord.run.manifest import FieldError, Fields
from ckpteval.jobs.eval.skips import WorkerSkip

SCORERS: Registry[str] = Registry(
    "a scorer",
    ("exact", "ckpteval.jobs.eval.scorers.basic:ExactScorer"),
    ("math", "ckpteval.jobs.eval.scorers.basic:MathScorer"),
    ("code", "ckpteval.jobs.eval.scorers.code.scorer:CodeScorer"),
    ("choice", "ckpteval.jobs.eval.scorers.choice:ChoiceScorer"),
    ("judge", "ckpteval.jobs.eval.scorers.judge.scorer:JudgeScorer"),
    ("reward_model", "ckpteval.jobs.eval.scorers.judge.scorer:RewardModelScorer"),
    unknown="{name!r} is not a scorer ({hint}known: {known}, or module:function)", key="scorer",
)
FUNCTION_SCORER = "ckpteval.jobs.eval.scorers.basic:FunctionScorer"  # every "module:function" name


@dataclass(frozen=True)
class Sample:
    """One completion to score: the completion, the dataset row (with all its fields, e.g. ``tests``,
    ``entry_point``, ``inputs``/``outputs``, ``question``; ``answer`` as a string when the row has one)
    and the prompt text the engine was sent."""

    completion: str
    row: dict[str, Any]
    prompt: str

    @property
    def answer(self) -> str | None:
        answer = self.row.get("answer")
        return None if answer is None else str(answer)


@dataclass(frozen=True)
class Scored:
    """One sample's score and what the scorer extracted (None: nothing; majority voting keys on it).

    ``timed_out``: the ``math`` grader gave up (counted as ``grader_timeouts``). ``counters``: per-sample
    counts summed per unit and point (``eval/<ds>/<counter>``, e.g. ``code_timeouts``). ``extras``:
    per-sample numbers averaged per point (``eval/<ds>/<name>``, e.g. ``tests_passed_fraction``). ``note``:
    why the sample scored as it did, in words, when the scorer knows (a code program's error), kept in the
    result's ``notes`` (at most :data:`NOTE_CHARS` characters).
    """

    score: float
    answer: str | None
    timed_out: bool = False
    counters: dict[str, int] = field(default_factory=dict)
    extras: dict[str, float] = field(default_factory=dict)
    note: str | None = None


NOTE_CHARS = 300  # a per-sample note's length in a result (a program's stderr can be any length)


@dataclass(frozen=True)
class ScorerContext:
    """What a scorer may know of where it runs: the run dir (for caches, e.g. ``RUN/judge_cache/``) and
    the process's scorer-related options (the worker's ``--...`` flags of the "scoring" group in
    :class:`ckpteval.jobs.eval.worker.options.WorkerOptions`, by field name; their defaults in the shared posture)."""

    run_dir: Path
    options: Mapping[str, Any] = field(default_factory=dict)

    def option(self, name: str, default: Any = None) -> Any:
        return self.options.get(name, default)


class ScorerInfraError(WorkerSkip):
    """Something a scorer depends on failed (a judge server, a sandbox): the unit is skipped with
    ``reason`` and ``message``; never a score of 0, never counted against the engine."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ScorerCrashed(WorkerSkip):
    """The scorer itself raised: the unit's ``crashed`` skip, written at once (the engine is not to
    blame, another worker would crash the same way)."""

    reason = "crashed"
    blame = "scorer"


class Scorer(Protocol):
    required_row_fields: ClassVar[tuple[str, ...]]
    needs_answer: ClassVar[bool]

    @classmethod
    def parse_options(cls, f: Fields) -> Any: ...

    def score(self, samples: list[Sample]) -> list[Scored]: ...

    def identity(self) -> dict[str, Any]: ...


class BaseScorer:
    """Defaults for a scorer: no options (an empty ``scorer_options`` only), rows need an ``answer``,
    identity ``{"name": <scorer>}``."""

    required_row_fields: ClassVar[tuple[str, ...]] = ()
    needs_answer: ClassVar[bool] = True

    def __init__(self, spec: GenerateEntry, ctx: ScorerContext) -> None:
        self.spec, self.ctx = spec, ctx
        self.options = type(self).parse_options(options_fields(spec))

    @classmethod
    def parse_options(cls, f: Fields) -> Any:
        f.reject_unknown((), "this scorer (it takes no scorer_options)")
        return None

    def score(self, samples: list[Sample]) -> list[Scored]:
        raise NotImplementedError

    def identity(self) -> dict[str, Any]:
        return {"name": self.spec.scorer}

    def no_answer(self, sample: Sample, scored: Scored) -> bool:
        """Whether nothing could be extracted from ``sample`` (``eval/<ds>/no_answer``): by default an answer
        empty after stripping whitespace; a scorer that extracts (math, code) says so itself."""
        return not sample.completion.strip()


def options_fields(spec: GenerateEntry) -> Fields:
    """A dataset's ``scorer_options`` for its scorer's ``parse_options``, errors naming run.json."""
    return Fields(Path("run.json"), dict(spec.scorer_options), f"dataset {spec.name!r}: scorer_options")


def scorer_class(name: str) -> type:
    """The class of scorer ``name`` (a ``module:function`` name: the function wrapper; the function
    itself is not imported here). :class:`FieldError` (key ``scorer``) for an unknown name."""
    module_name, _, func_name = name.partition(":")
    if name not in SCORERS and module_name and func_name:
        return SCORERS.load(name, FUNCTION_SCORER)  # type: ignore[no-any-return]
    return SCORERS.load(name)  # type: ignore[no-any-return]


def check_scorer(name: str, options: Fields) -> None:
    """The run.json parser's check (:func:`ckpteval.coord.run.manifest.install_checks`): a known name, valid options."""
    scorer_class(name).parse_options(options)


def make_scorer(spec: GenerateEntry, ctx: ScorerContext) -> Scorer:
    """The scorer of ``spec`` (its ``module:function`` imported now: call after the trust check)."""
    try:
        cls = scorer_class(spec.scorer)
    except FieldError as e:
        raise ValueError(f"dataset {spec.name!r}: {e}") from None
    return cls(spec, ctx)  # type: ignore[no-any-return]


def check_row(scorer: type, row: dict[str, Any], where: str) -> None:
    """A row has what its scorer needs (``answer`` unless ``needs_answer`` is false, ``required_row_fields``,
    and whatever the scorer's optional classmethod ``check_row(row, where)`` checks: ValueError naming ``where``)."""
    missing = [k for k in (("answer",) if scorer.needs_answer else ()) + tuple(scorer.required_row_fields)
               if row.get(k) is None]
    if missing:
        raise ValueError(f"{where}: the row has no {', '.join(repr(k) for k in missing)} (needed by its scorer)")
    if (own_check := getattr(scorer, "check_row", None)) is not None:
        own_check(row, where)


def last_line(error: BaseException) -> str:
    """``Type: message`` of an exception, one line (what a ``crashed`` skip says)."""
    text = "".join(traceback.format_exception_only(type(error), error)).strip().splitlines()
    return text[-1] if text else type(error).__name__


def score_samples(scorer: Scorer, samples: list[Sample]) -> list[Scored]:
    """``scorer.score(samples)``, checked; the scorer's own exception becomes :class:`ScorerCrashed`."""
    try:
        scored = scorer.score(samples)
    except WorkerSkip:  # ScorerInfraError and friends: the scorer's verdict on the unit
        raise
    except Exception as e:  # noqa: BLE001  # user code: the scorer's failure is the unit's crashed skip
        name = getattr(getattr(scorer, "spec", None), "scorer", type(scorer).__name__)
        raise ScorerCrashed(f"scorer {name!r} raised: {last_line(e)}") from e
    if not isinstance(scored, list) or len(scored) != len(samples) or not all(isinstance(s, Scored) for s in scored):
        raise ScorerCrashed(f"scorer returned {type(scored).__name__} of {len(scored) if isinstance(scored, list) else '?'} "
                            f"items for {len(samples)} samples; expected one Scored per sample")
    check_scored(scored, getattr(getattr(scorer, "spec", None), "scorer", type(scorer).__name__))
    return scored


def check_scored(scored: list[Scored], name: str) -> None:
    """:class:`ScorerCrashed` (the unit's ``crashed`` skip, naming scorer ``name`` and the sample) unless every
    score and extra is a finite number within ±:data:`SCORE_BOUND` and every counter an integer."""
    for i, s in enumerate(scored):
        values = {"score": s.score, **{f"extra {k!r}": v for k, v in s.extras.items()}}
        for what, v in values.items():
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and abs(v) <= SCORE_BOUND):
                raise ScorerCrashed(f"scorer {name!r} returned {what} {v!r} for sample {i}; expected a finite number "
                                    f"within ±{SCORE_BOUND:g}")
        bad = [k for k, n in s.counters.items() if isinstance(n, bool) or not isinstance(n, int)]
        if bad:
            raise ScorerCrashed(f"scorer {name!r} returned counter {bad[0]!r} = {s.counters[bad[0]]!r} for sample {i}; "
                                "expected an integer")


@dataclass
class UnitTally:
    """A unit's sums over its samples' :class:`Scored`: grader timeouts, counters, and extras (sum, n)."""

    grader_timeouts: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    extras: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> {"sum": s, "n": k}
    notes: tuple[str | None, ...] = ()  # per sample, when any sample has one (Scored.note)
    truncated: tuple[float | None, ...] = ()  # per sample, its extra "truncated" when any sample has one

    @classmethod
    def of(cls, scored: list[Scored]) -> UnitTally:
        notes = tuple(None if s.note is None else s.note[:NOTE_CHARS] for s in scored)
        cut = tuple(s.extras.get("truncated") for s in scored)
        tally = cls(grader_timeouts=sum(s.timed_out for s in scored),
                    notes=notes if any(n is not None for n in notes) else (),
                    truncated=cut if any(c is not None for c in cut) else ())
        for s in scored:
            for name, n in s.counters.items():
                tally.counters[name] = tally.counters.get(name, 0) + int(n)
            for name, value in s.extras.items():
                acc = tally.extras.setdefault(name, {"sum": 0.0, "n": 0})
                acc["sum"] += float(value)
                acc["n"] += 1
        return tally

    def as_result_fields(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

__all__ = ["SCORERS", "Sample", "Scored", "ScorerContext", "Scorer", "BaseScorer", "ScorerInfraError", "ScorerCrashed", "UnitTally", "make_scorer", "scorer_class", "check_scorer", "check_row", "score_samples", "check_scored", "last_line"]
