"""The ratio ``eval/cost/fraction_of_training``, read from the ledger: pure arithmetic over what the
trainer's dispatcher recorded (``dispatched`` records carry the trainer's running ``train_gpu_s``,
``ingested`` ones their point's ``eval_gpu_s``; :mod:`ckpteval.jobs.trainer.cost` measures and records them).

Guarantee: never NaN or infinite: None whenever the trainer's GPU-seconds are unknown or 0. Limits: as
exact as the recorded totals (the definition and what it leaves out: :mod:`ckpteval.jobs.trainer.cost`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ckpteval.coord.run.ledger import LedgerState


def fraction_of_training(state: LedgerState, step: int, point_gpu_s: float) -> float | None:
    """The fraction at ``step``'s point (module doc): ``point_gpu_s`` plus the recorded ``eval_gpu_s`` of
    points ingested at steps below it, over ``train_gpu_s`` of its dispatch; None when that is unknown or 0."""
    train = state.dispatched.get(step, {}).get("train_gpu_s")
    if not isinstance(train, int | float) or not train > 0:
        return None
    before = math.fsum(g for s, g in state.ingested_gpu_s.items() if s < step)
    return (before + point_gpu_s) / train


def run_fraction(state: LedgerState | None, point_gpu_s: Mapping[int, float]) -> float | None:
    """The run's fraction so far (``status``): the eval GPU-seconds of the points (``point_gpu_s``, step ->
    its point's, from the results) at steps up to the newest dispatch that recorded ``train_gpu_s``, over
    that total; None without one (no trainer ledger, a CPU trainer)."""
    if state is None:
        return None
    charged = {s: r["train_gpu_s"] for s, r in state.dispatched.items()
               if isinstance(r.get("train_gpu_s"), int | float) and r["train_gpu_s"] > 0}
    if not charged:
        return None
    newest = max(charged)
    return math.fsum(g for s, g in point_gpu_s.items() if s <= newest) / charged[newest]
