"""Replays: the same snapshot evaluated again under the run's real settings, to measure the engine's noise.

``eval.replay`` in run.json (:class:`ReplaySettings`) says which steps are replayed and how often. A
replayed step's units gain ``copies`` replays each (:meth:`ckpteval.coord.work.workunit.WorkUnit.as_replay`, id
``<unit>.r<k>``): the same prompts, samples, per-sample seeds and engine settings, claimed through the same
leases and published as the same kind of result file — so a replay is exactly-once like any unit, and it
runs on whatever worker, engine and concurrency the fleet has at the time (the run's real conditions).

Guarantee: which replays a step has is a pure function of run.json and the step (:func:`replay_units`), so
every worker, the trainer, status and backfill agree on them. A replay is part of its step's *work* (the
point is complete, and its snapshot retired, only once its replays have a result) but **never part of its
score**: points pool only :meth:`~ckpteval.coord.entries.Entry.units` (:mod:`ckpteval.coord.results.points`); a
replay's result is read only by the noise estimates (:mod:`ckpteval.jobs.decide.noise`) and its cost is
reported apart (``eval/cost/replay_*``). Only entries scored per sample (point rule ``samples``) are
replayed: an lm-eval task has no per-prompt scores to compare.

Default: off (``every`` 0, no ``steps``). Why not a cheap default: a replay costs a whole evaluation of
its step (a 64-sample AIME point is GPU-hours); on an engine run deterministically (greedy on a
batch-invariant engine, or ``ckpteval serve``/HF on CPU) it measures zero by construction; and a replay
of step 0 alone — the one step a cheap default could pick — measures nothing where an untrained model
scores 0 on every prompt (no prompt is near the edge where the engine's noise flips it). Turn it on for
runs whose decisions matter: ``{"every": 10 * eval_interval}`` replays one point in ten (≈ +10 % eval
compute, reported as ``eval/cost/replay_share``).
Limits: a replay measures the engine noise of *its* steps; steps with scores near 0 or 1 show little.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpteval.coord.run.fields import FieldError


@dataclass(frozen=True)
class ReplaySettings:
    """``eval.replay`` in run.json: which steps are evaluated again, and how many times."""

    every: int = 0
    """Replay the steps that are multiples of it (step 0 included; a multiple of the eval interval: ``10 x``
    the interval replays one point in ten). 0: none by this rule."""
    steps: tuple[int, ...] = ()
    """Replay these steps too (e.g. ``[0]``, or a step you mean to ship)."""
    copies: int = 1
    """Replays per replayed step (>= 1): each unit of the step is evaluated ``1 + copies`` times."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))
        if self.every < 0:
            raise FieldError("every", f"must be >= 0 (0: no step by this rule), got {self.every}")
        if any(not isinstance(s, int) or s < 0 for s in self.steps):
            raise FieldError("steps", f"must be a list of steps >= 0, got {list(self.steps)}")
        if self.copies < 1:
            raise FieldError("copies", f"must be >= 1, got {self.copies}")

    @property
    def enabled(self) -> bool:
        return bool(self.every or self.steps)

    def due(self, step: int) -> bool:
        """Whether ``step`` is replayed."""
        return step in self.steps or (self.every > 0 and step % self.every == 0)
