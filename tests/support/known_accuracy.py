"""A scripted engine of known accuracy (#41's reference check): an fn backend whose sample scores 1 when
``blake2b(f"{dataset}:{seed}")`` falls below the dataset's accuracy (per-sample seeds at temperature > 0; the
row's prompt and sample index when greedy), after reading the snapshot's weights."""

from __future__ import annotations

import hashlib
from typing import Any

from ckpteval.jobs.eval.engines.fn import CheckpointEvalFn
from tests.support.workers import safetensors_sum


def uniform(key: str) -> float:
    """A number in [0, 1) that is a function of ``key`` alone."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64


class KnownAccuracyBackend(CheckpointEvalFn):
    """Each dataset answers right with its probability in ``accuracy`` (``{name: p}``)."""

    def __init__(self, accuracy: dict[str, float]) -> None:
        self.accuracy = accuracy

    def evaluate_checkpoint(self, checkpoint_dir: str, input: dict[str, Any]) -> dict[str, Any]:  # noqa: A002
        safetensors_sum(checkpoint_dir)
        name = input["dataset"]["name"]
        start, stop = input["samples"]
        keys = ([str(s) for s in input["seeds"]] if input["seeds"] is not None
                else [f"{r['prompt']}:{j}" for r in input["rows"] for j in range(start, stop)])
        scores = [float(uniform(f"{name}:{k}") < self.accuracy[name]) for k in keys]
        return {"scores": scores, "weight_versions": [str(input["step"])] * len(scores)}
