"""Dataset kinds' jobs side, and the one path that evaluates a unit on an engine already pinned to its step.

An entry's ``kind`` names, in :data:`ckpteval.coord.entries.KINDS`, its settings class and the jobs-side functions
this module calls (coord knows no engine). :func:`evaluate_pinned` is the only place a unit is evaluated (the fleet's
:class:`~ckpteval.jobs.eval.worker.evaluators.EngineEvaluator` and the shared posture's
:func:`~ckpteval.jobs.trainer.gate.shared_eval`, after pinning); every kind checks the pin itself and raises
:class:`~ckpteval.jobs.eval.proof.pinning.PinViolation` when it does not hold. User code a kind runs goes inside
:func:`user_code` (its failure is the unit's ``crashed`` skip, never the engine's). Adding a kind: see
:mod:`ckpteval.coord.entries`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ckpteval.coord.entries import KINDS
from ckpteval.coord.results.files import Result, harness_result, ok_result
from ckpteval.coord.run.manifest import install_checks as install_parser_checks
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.engines.base import EngineError
from ckpteval.jobs.eval.scorers import check_scorer, last_line
from ckpteval.jobs.eval.skips import WorkerSkip


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
    attest: dict[str, Any] = field(default_factory=dict)  # ckpteval.jobs.eval.proof.attest.Attestation.to_json()
    cost: dict[str, float] = field(default_factory=dict)  # tokens, busy seconds: what the unit cost
    fidelity: dict[str, float] = field(default_factory=dict)  # ckpteval.jobs.eval.proof.canary.Fidelity.to_json(); {}: no canary
    kept: Any = None  # the completions to keep beside the result (ckpteval.coord.results.completions.Completions)
    engine: dict[str, Any] = field(default_factory=dict)  # ckpteval.coord.results.engine_identity.EngineIdentity.to_json()


class UserCodeFailed(WorkerSkip):
    """Code the unit ran on the user's behalf (a scorer, a library task) raised: the unit's ``crashed``
    skip, written at once with :attr:`blame` (another worker would fail the same way)."""

    reason = "crashed"
    blame = "user_code"


def evaluate_pinned(engine: Any, cache: Any, unit: WorkUnit, snapshot: str, want: str) -> Evaluation:
    """Evaluate ``unit`` on ``engine`` (pinned to version ``want``) by its entry's kind (``KINDS[kind].evaluate``)."""
    spec = cache.manifest.entry(unit.dataset)
    return KINDS.load(spec.kind, KINDS[spec.kind].evaluate)(engine, cache, spec, unit, snapshot, want)  # type: ignore[no-any-return]


def check_entries(cache: Any) -> None:
    """At worker (or shared-posture) start: every entry's kind check (rows, scorer, library), if it has one."""
    for spec in cache.manifest.eval.entries:
        if KINDS[spec.kind].check:
            KINDS.load(spec.kind, KINDS[spec.kind].check)(cache, spec)


def install_checks() -> None:
    """Install the scorer and environment registries' checks into the run.json parser
    (:func:`ckpteval.coord.run.manifest.install_checks`). Every ckpteval program calls it at start (the ``ckpteval``
    command, the trainer library's :func:`~ckpteval.jobs.trainer.session.prepare_eval_run` and ``open_dispatcher``)."""
    from ckpteval.jobs.eval.kinds.env import check_env

    install_parser_checks({"scorer": check_scorer, "env": check_env})


def unit_result(unit: WorkUnit, ev: Evaluation, **kw: Any) -> Result:
    """The ok result of an evaluation (``kw``: timings, worker, snapshot, ...)."""
    kw = {"attest": ev.attest, "cost": ev.cost, "fidelity": ev.fidelity, "engine": ev.engine, **kw}
    if ev.metrics is not None:
        return harness_result(unit, ev.metrics, ev.weight_versions, message=ev.message, **kw, **ev.scored)
    return ok_result(unit, ev.scores, ev.weight_versions, ev.answers, message=ev.message, kept=ev.kept, **kw,
                     **ev.scored)


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
