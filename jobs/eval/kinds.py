"""Dataset kinds, and the one path that evaluates a unit on an engine already pinned to its step.

An entry of run.json's ``eval.datasets`` has a ``kind`` (:data:`ckpteval.coord.manifest.DATASET_KINDS` holds its
settings dataclass; coord knows no engine): ``generate`` (the default; ``jsonl`` is its old name) —
prompts from a JSONL file, sampled on the engine and scored by the dataset's scorer
(:func:`ckpteval.jobs.eval.scoring.evaluate_generate`); ``lm_eval`` — one EleutherAI lm-evaluation-harness task per
unit (:func:`ckpteval.jobs.eval.harness.evaluate_harness`); ``env`` — multi-turn episodes of a Python environment
(:func:`ckpteval.jobs.eval.envs.runner.evaluate_env`).

:func:`evaluate_pinned` is the only place a unit is evaluated: the fleet's
:class:`ckpteval.jobs.eval.evaluators.EngineEvaluator` and the shared posture's :func:`ckpteval.jobs.trainer.gate.shared_eval`
both call it after pinning, and turn what it returns into a result with :func:`unit_result`. Every kind
checks the pin itself (each sample's version, or the version read back around a library task) and
raises :class:`~ckpteval.jobs.eval.pinning.PinViolation` when it does not hold.

Adding a kind: a settings dataclass in :mod:`ckpteval.coord.manifest` (one line in ``DATASET_KINDS``), a function
``evaluate_<kind>(engine, cache, spec, unit, snapshot, want) -> Evaluation`` (and optionally
``check_<kind>(cache, spec)`` run at worker start), one line in :data:`UNIT_KINDS`. User code a kind runs
(a library's task, a scorer) raises anything: wrap it with :func:`user_code` so its failure is the unit's
``crashed`` skip at once, never the engine's.

Limits: the points of a new kind need a rule in :mod:`ckpteval.coord.results` unless it reports per-sample
scores (``generate``'s rules) or per-unit metrics (``lm_eval``'s).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ckpteval.coord.results import Result, harness_result, ok_result
from ckpteval.coord.units import WorkUnit
from ckpteval.jobs.eval.engines.base import EngineError
from ckpteval.jobs.eval.pinning import WorkerSkip
from ckpteval.jobs.eval.scorers import last_line

# kind -> "module:function" evaluating one unit of it on a pinned engine (imported when first used)
UNIT_KINDS: dict[str, str] = {
    "generate": "ckpteval.jobs.eval.scoring:evaluate_generate",
    "lm_eval": "ckpteval.jobs.eval.harness:evaluate_harness",
    "env": "ckpteval.jobs.eval.envs.runner:evaluate_env",
}
# kind -> "module:function" checking an entry at worker start (rows, scorer, library present)
KIND_CHECKS: dict[str, str] = {
    "generate": "ckpteval.jobs.eval.scoring:check_generate",
    "lm_eval": "ckpteval.jobs.eval.harness:check_harness_entry",
    "env": "ckpteval.jobs.eval.envs.runner:check_env_entry",
}


@dataclass
class Evaluation:
    """What one unit produced: per-sample scores with their versions, or a task's metrics."""

    scores: list[float]
    weight_versions: list[str | None]
    message: str = ""
    answers: list[str | None] | None = None  # the scorer's extracted answers (None: not reported)
    scored: dict[str, Any] = field(default_factory=dict)  # UnitScores.result_fields(): counters, scorer, ...
    metrics: dict[str, float] | None = None  # a library task's metrics (weight_versions: the read-backs)
    generate_s: float = 0.0
    attest: dict[str, Any] = field(default_factory=dict)  # ckpteval.jobs.eval.attest.Attestation.to_json()
    cost: dict[str, float] = field(default_factory=dict)  # tokens, busy seconds: what the unit cost
    fidelity: dict[str, float] = field(default_factory=dict)  # ckpteval.jobs.eval.canary.Fidelity.to_json(); {}: no canary


class UserCodeFailed(WorkerSkip):
    """Code the unit ran on the user's behalf (a scorer, a library task) raised: the unit's ``crashed``
    skip, written at once with :attr:`blame` (another worker would fail the same way)."""

    reason = "crashed"
    blame = "user_code"


def _load(registry: dict[str, str], kind: str) -> Callable[..., Any]:
    target = registry.get(kind)
    if target is None:
        raise ValueError(f"dataset kind {kind!r} has no evaluator (known: {', '.join(UNIT_KINDS)})")
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def evaluate_pinned(engine: Any, cache: Any, unit: WorkUnit, snapshot: str, want: str) -> Evaluation:
    """Evaluate ``unit`` on ``engine`` (pinned to version ``want``) by its dataset's kind."""
    spec = cache.manifest.entry(unit.dataset)
    return _load(UNIT_KINDS, spec.kind)(engine, cache, spec, unit, snapshot, want)  # type: ignore[no-any-return]


def check_entries(cache: Any) -> None:
    """At worker (or shared-posture) start: every entry's kind check (rows, scorer, library)."""
    for spec in cache.manifest.entries():
        if spec.kind in KIND_CHECKS:
            _load(KIND_CHECKS, spec.kind)(cache, spec)


def unit_result(unit: WorkUnit, ev: Evaluation, **kw: Any) -> Result:
    """The ok result of an evaluation (``kw``: timings, worker, snapshot, ...)."""
    kw = {"attest": ev.attest, "cost": ev.cost, "fidelity": ev.fidelity, **kw}
    if ev.metrics is not None:
        return harness_result(unit, ev.metrics, ev.weight_versions, message=ev.message, **kw)
    return ok_result(unit, ev.scores, ev.weight_versions, ev.answers, message=ev.message, **kw, **ev.scored)


@contextmanager
def user_code(what: str, blame: str) -> Iterator[None]:
    """Around code run on the user's behalf: an exception other than a skip or an engine error becomes
    :class:`UserCodeFailed` naming ``what`` and the exception's last line."""
    try:
        yield
    except (WorkerSkip, EngineError):
        raise
    except Exception as e:  # noqa: BLE001  # user code: its failure is the unit's crashed skip
        failure = UserCodeFailed(f"{what} failed: {last_line(e)}")
        failure.blame = blame
        raise failure from e
