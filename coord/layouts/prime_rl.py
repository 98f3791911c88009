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

**The four-stage handshake** (PR #3357 "uniform four-stage handshake for weight broadcasts", merged
2026-08-23; read from its description, the newest source stored here predates it): every broadcast of
every transport goes ``.sender_ready`` (the trainer resets ``step_N/`` and offers it) -> ``.receiver_ready``
(its consumer acknowledges; the trainer blocks until then) -> ``.started`` -> ``.finished`` (filesystem:
the weights are wholly on disk), then old dirs are cleaned. ckpteval is a *watcher*, never that consumer:
it never writes ``.receiver_ready`` or any other file into the trainer's dir (an acknowledgement from us
would stand in for the orchestrator's or evals process's, and "every offered version must be received"),
so it can neither block nor pace the trainer. A broadcast is admitted on ``.finished``; a dir reset for a
new offer (a resume re-broadcasting its step) changes the marker's identity, so a capture that overlaps
it is discarded as lost, never scored.

Limits: a capture holds full weights once the trainer deletes its source (hardlinks cost nothing until
then), until the workers collect it once its point is final (:class:`ckpteval.coord.snapshots.gc.CaptureGC`); a step
with an infrastructure skip keeps its capture (a retry may need it) — evaluate every k-th broadcast (a dataset's
``every``: only steps with units are captured) to bound what is held. A capture on another filesystem is a
copy (the trainer's cleanup two steps later may then beat it: recorded as lost).

Completion signal: ``.finished`` (since #3357), else ``STABLE`` (before). ``--watch`` may name ``<output_dir>``, its ``broadcasts/`` or its ``weights/``.
"""

from __future__ import annotations

import re
from pathlib import Path

from ckpteval.coord.layouts.base import Layout, Located

STEP = re.compile(r"step_(\d+)")
STABLE = "STABLE"
FINISHED = ".finished"  # the handshake's last stage (#3357)
MARKERS = (FINISHED, STABLE)  # newest protocol first
BROADCASTS = "broadcasts"
WEIGHTS = "weights"


class PrimeRLLayout(Layout):
    name = "prime-rl"
    signal = (".finished in broadcasts/step_N/ (the handshake of #3357), STABLE there (#3316) or in weights/step_N/ "
              "(before #3316), written after the weights")
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
        return self.completion_marker(entry) is not None

    def completion_marker(self, entry: Path) -> Path | None:
        for name in MARKERS:
            if (entry / name).is_file():
                return entry / name
        return None


def is_broadcast(entry: Path) -> bool:
    """A broadcast (deleted by the trainer within steps): under ``broadcasts/``, or a watched broadcasts dir
    itself (no ``config.json``: a weight checkpoint of older versions always has one)."""
    return entry.parent.name == BROADCASTS or not (entry / "config.json").is_file()
