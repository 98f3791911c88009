"""prime-rl (PrimeIntellect-ai/prime-rl): the async RL / SFT trainer — its weight broadcasts, and the weight
checkpoints of older versions. The layout is chosen by what is on disk.

**Current prime-rl** (read at commit 559b44772e471d1538537b8805cc77f3824a5e64, 2026-08-21, which includes
PR #3316 "remove weight checkpointing", 2026-08-20): the trainer saves only torch DCP state
(``checkpoints/step_N/``, not HF). HF weights exist only as *broadcasts*:
``src/prime_rl/transports/weights/filesystem.py`` ``FileSystemWeightBroadcast.broadcast_weights`` writes
``<output_dir>/broadcasts/step_<N>/`` (``utils/pathing.py``: ``get_broadcast_dir``, ``get_step_path``) with
``utils/weights.py`` ``save_state_dict_parallel`` — shards under ``tmp-rank*`` names, renamed into place,
``model.safetensors.index.json`` written last — then the master touches ``STABLE``. A LoRA run broadcasts
the adapter only (``adapter_model.safetensors`` + ``adapter_config.json``, ``save_lora_config``): a run
with ``eval.base_model`` evaluates it through the adapter path. A broadcast holds **no** ``config.json``
and no tokenizer. Cleanup: ``trainer/utils.py`` ``maybe_clean`` deletes ``step_{N-2}`` right after
broadcasting N (RL; kept on ``ckpt.interval`` steps), SFT's ``clean_older`` keeps the newest only. The
trainer's own evals process (``evals/evals.py``) polls ``STABLE`` and loads the live dir.

Here a broadcast is ``ephemeral``: discovery *captures* it before use (hardlinks into ``RUN/captured/``,
a copy across filesystems), then re-checks that ``STABLE`` and every captured file are still the same
(inode, size, mtime): a capture that raced the cleanup is discarded and counted lost to rotation, never
scored. Capturing reads names and links files — it never writes into, locks or slows the trainer's dir.
``config.json`` and the tokenizer come from ``RUN/base/`` (``start_eval``'s ``base_model_dir``; for a
``--watch`` run put the model's files there); without a ``config.json`` the save is reported, not admitted.

**Older prime-rl** (before #3316, e.g. commit f274fa312 of 2026-02-11): ``trainer/ckpt.py``
``WeightCheckpointManager.save`` wrote an HF checkpoint (safetensors, config, tokenizer) to
``<output_dir>/weights/step_<N>/`` and then touched ``STABLE``; old steps deleted by ``keep_last`` /
``keep_interval``. Used when ``weights/`` exists and ``broadcasts/`` does not.

Not read: the four-stage broadcast handshake (``.sender_ready`` -> ``.receiver_ready`` -> ``.started`` ->
``.finished``, PR #3357) is newer than the commit available here; a broadcast without ``STABLE`` waits
(shown by ``ckpteval status``), it is never guessed complete.

Limits: a capture holds full weights once the trainer deletes its source (hardlinks cost nothing until
then); ``RUN/captured/`` is not garbage-collected yet — evaluate every k-th broadcast (a dataset's ``every``:
only steps with units are captured) and clear old captures by hand. A capture on another filesystem is a
copy (the trainer's cleanup two steps later may then beat it: recorded as lost).

Completion signal: ``STABLE``. ``--watch`` may name ``<output_dir>``, its ``broadcasts/`` or its ``weights/``.
"""

from __future__ import annotations

import re
from pathlib import Path

from ckpteval.coord.layouts.base import Layout, Located

STEP = re.compile(r"step_(\d+)")
STABLE = "STABLE"
BROADCASTS = "broadcasts"
WEIGHTS = "weights"


class PrimeRLLayout(Layout):
    name = "prime-rl"
    signal = "STABLE in broadcasts/step_N/ (current) or weights/step_N/ (before #3316), touched after the weights"
    no_weights_hint = ("checkpoints/step_N/ is torch DCP state, not HF weights: use the filesystem weight broadcast "
                       "(weight_broadcast.type='filesystem') or convert with scripts/dcp_to_hf.py")

    def containers(self, root: Path) -> list[Path]:
        for name in (BROADCASTS, WEIGHTS):
            if (root / name).is_dir():
                return [root / name]
        return [root]

    step_pattern = STEP

    def locate(self, entry: Path) -> Located | None:
        step = self.step_of(entry)
        if step is None:
            return None
        return Located(step, entry, self.signature(entry), ephemeral=is_broadcast(entry))

    def signature(self, entry: Path) -> bool:
        return (entry / STABLE).is_file()


def is_broadcast(entry: Path) -> bool:
    """A broadcast (deleted by the trainer within steps): under ``broadcasts/``, or a watched broadcasts dir
    itself (no ``config.json``: a weight checkpoint of older versions always has one)."""
    return entry.parent.name == BROADCASTS or not (entry / "config.json").is_file()
