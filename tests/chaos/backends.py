"""Real ``CheckpointEvalFn`` backends for the chaos suite, loaded by workers with ``--engine fn:...``.

They extend :class:`tests.support.workers.SumBackend` (scores every row from the snapshot's real
safetensors), so no torch import is paid per worker process.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tests.support.workers import SumBackend, row_score, safetensors_sum


class ReadLateBackend(SumBackend):
    """Waits ``CHAOS_READ_DELAY_S`` *before* reading the snapshot (the window in which the chaos suite
    deletes or corrupts it: a load that starts after the worker's verification), then scores."""

    def evaluate_checkpoint(self, checkpoint_dir: str, input: dict[str, Any]) -> dict[str, Any]:  # noqa: A002
        end = time.monotonic() + float(os.environ.get("CHAOS_READ_DELAY_S", "0"))
        while time.monotonic() < end:
            time.sleep(0.02)
        if not any(Path(checkpoint_dir).glob("*.safetensors")):
            # what a real loader says when the weights are gone (from_pretrained: OSError)
            raise OSError(f"{checkpoint_dir}: no safetensors weights found")
        weight_sum = safetensors_sum(checkpoint_dir)
        n = input["dataset"]["n_samples"]
        scores = [row_score(weight_sum, r["prompt"]) for r in input["rows"] for _ in range(n)]
        return {"scores": scores, "weight_versions": [input["weight_version"]] * len(scores)}


class WrongVersionBackend(SumBackend):
    """An engine that reports the wrong weight version (off by one) on every sample."""

    def __init__(self, delay_s: float = 0.0, version_offset: int = 1) -> None:
        super().__init__(delay_s=delay_s, version_offset=version_offset)
