"""prime-rl (PrimeIntellect-ai/prime-rl): the async RL trainer and its weight checkpoints.

Read in ``src/prime_rl/trainer/ckpt.py``: ``WeightCheckpointManager.save`` writes an HF-compatible weight
checkpoint (safetensors, config, generation config, tokenizer) to ``<output_dir>/weights/step_<N>/`` and
then touches ``STABLE`` in it "to indicate checkpoint is complete (for eval to safely read)"; old steps
are deleted by ``maybe_clean`` (``keep_last`` / ``keep_interval``). The resumable trainer state
(``<output_dir>/checkpoints/step_<N>/trainer/``, torch DCP, also marked ``STABLE``) is not HF weights.

Completion signal: ``STABLE``. ``--watch`` may name ``<output_dir>`` or ``<output_dir>/weights``.
"""

from __future__ import annotations

import re
from pathlib import Path

from ckpteval.coord.layouts.base import Layout, Located

STEP = re.compile(r"step_(\d+)")
STABLE = "STABLE"


class PrimeRLLayout(Layout):
    name = "prime-rl"
    signal = "STABLE in weights/step_N/ (touched after the weights are written)"
    no_weights_hint = ("checkpoints/step_N/trainer/ is torch DCP state, not HF weights: enable the weight "
                       "checkpoint ([ckpt.weights]) or convert with torch.distributed.checkpoint.format_utils."
                       "dcp_to_torch_save")

    def containers(self, root: Path) -> list[Path]:
        weights = root / "weights"
        return [weights] if weights.is_dir() else [root]

    step_pattern = STEP

    def locate(self, entry: Path) -> Located | None:
        step = self.step_of(entry)
        return None if step is None else Located(step, entry, self.signature(entry))

    def signature(self, entry: Path) -> bool:
        return (entry / STABLE).is_file()
