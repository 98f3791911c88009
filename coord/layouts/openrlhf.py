"""OpenRLHF (OpenRLHF/OpenRLHF): PPO/GRPO (Ray), SFT, DPO, RM trainers with ``--save_hf_ckpt``.

Checked at OpenRLHF/OpenRLHF commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7 (2026-08-13): the flags are
now ``--ckpt.save_hf`` and ``--ckpt.path`` (``openrlhf/trainer/ray/ppo_actor.py``: ``f"{tag}_hf"``).

Read in ``openrlhf/trainer/ppo_trainer.py`` (``_save_checkpoint``) and ``openrlhf/trainer/sft_trainer.py``:
every ``--save_steps`` the tag is ``global_step<N>``; DeepSpeed's resumable state goes to
``--ckpt_path/_actor/<tag>/`` (ZeRO partitions, not HF weights; rotated by ``--max_ckpt_num`` /
``--max_ckpt_mem``; off with ``--disable_ds_ckpt``), and with ``--save_hf_ckpt`` the HF model is written by
``strategy.save_model`` to ``--ckpt_path/<tag>_hf/`` (config, tokenizer, safetensors).

Completion signal: none — quiescence and every indexed shard present. Point ``--watch`` at ``--ckpt_path``.
"""

from __future__ import annotations

import re
from pathlib import Path

from ckpteval.coord.layouts.base import Layout, Located

HF_TAG = re.compile(r"global_step(\d+)_hf")


class OpenRLHFLayout(Layout):
    name = "openrlhf"
    signal = "none: quiescence and every indexed shard present"
    no_weights_hint = ("run with --save_hf_ckpt; DeepSpeed _actor/global_stepN/ partitions convert with "
                       "zero_to_fp32.py")

    step_pattern = HF_TAG

    def locate(self, entry: Path) -> Located | None:
        step = self.step_of(entry)
        return None if step is None else Located(step, entry, None)

    def signature(self, entry: Path) -> bool:
        return True  # the name alone (``global_step<N>_hf``) is OpenRLHF's
