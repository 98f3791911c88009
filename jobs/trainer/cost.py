"""What training cost, in GPU-seconds, next to what evaluating it cost: ``eval/cost/fraction_of_training``.

Definition (docs/USER_GUIDE.md glossary): at the point of step ``N``, the eval GPU-seconds of every point
ingested so far at a step ``<= N`` (each unit's ``cost.gpu_s``: (generation + load + attestation seconds)
x the engine's GPUs, :func:`ckpteval.jobs.eval.worker.evaluators.unit_cost`) divided by the trainer's GPU-seconds
up to its dispatch of step ``N``. The trainer's GPU-seconds are its wall time outside the dispatcher
(time spent exporting, waiting under backpressure or evaluating in the shared posture is not training)
times its GPUs (:func:`trainer_gpus`), summed over its incarnations: each ``dispatched`` ledger record
carries the running total (``train_gpu_s``), so a requeued trainer continues it. Each ``ingested``
record carries its point's eval GPU-seconds (``eval_gpu_s``).

Guarantee: never NaN: no fraction is logged while the trainer's GPU-seconds are 0 (a CPU trainer, or no
dispatch yet). Limits: the work a trainer lost between its last dispatch and a crash is not counted;
the service posture has no trainer ledger, so no fraction; GPUs are detected, not measured (a trainer
that uses fewer than it holds is charged for all it holds, as its allocation is).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping

from ckpteval.coord.run.ledger import LedgerState


def trainer_gpus(env: Mapping[str, str] | None = None) -> int:
    """The GPUs this trainer holds: ``WORLD_SIZE`` ranks (torchrun, one GPU each) when CUDA is available,
    else the devices torch sees; 0 on a CPU-only trainer."""
    import torch

    if not torch.cuda.is_available():
        return 0
    env = os.environ if env is None else env
    world = env.get("WORLD_SIZE", "")
    return int(world) if world.isdigit() and int(world) > 0 else torch.cuda.device_count()


class TrainingClock:
    """The trainer's running GPU-seconds: charged from construction (or the last :meth:`resume`) to each
    :meth:`charge`, continuing the total a previous incarnation recorded in the ledger."""

    def __init__(self, gpus: int, state: LedgerState, clock: Callable[[], float]) -> None:
        self.gpus, self.clock = gpus, clock
        recorded = [float(r["train_gpu_s"]) for r in state.dispatched.values()
                    if isinstance(r.get("train_gpu_s"), int | float) and math.isfinite(r["train_gpu_s"])]
        self.total = max(recorded, default=0.0)
        self._since = clock()

    def charge(self) -> float:
        """Add the training time since the last charge or resume; the new total."""
        now = self.clock()
        self.total += max(0.0, now - self._since) * self.gpus
        self._since = now
        return self.total

    def resume(self) -> None:
        """Training resumes now (the time since the last charge was the dispatcher's, not training's)."""
        self._since = self.clock()
