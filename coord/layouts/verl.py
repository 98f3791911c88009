"""verl (volcengine/verl): FSDP and Megatron PPO/GRPO trainers.

Checked at volcengine/verl commit b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29).

Read in ``verl/trainer/ppo/ray_trainer.py`` (``_save_checkpoint``) and
``verl/utils/checkpoint/fsdp_checkpoint_manager.py`` (``FSDPCheckpointManager.save_checkpoint``): a save is
``trainer.default_local_dir/global_step_<N>/`` with ``actor/`` (and ``critic/``) inside; the actor's
per-rank sharded ``model_world_size_<W>_rank_<r>.pt`` files are not HF weights. ``actor/huggingface/``
always gets config and tokenizer; it gets the full HF model only when
``actor_rollout_ref.actor.checkpoint.save_contents`` includes ``hf_model``. After every part of the save the
trainer writes ``latest_checkpointed_iteration.txt`` (the step) into ``default_local_dir``; old saves
beyond ``trainer.max_actor_ckpt_to_keep`` are deleted when the next save starts.

Completion signal: the tracker file holds a step >= N. Weights: ``global_step_<N>/actor/huggingface/``.
Training data: ``data.train_files`` of its hydra config (a parquet path or a list of them; hydra keeps the
run's resolved config in ``outputs/<date>/<time>/.hydra/config.yaml``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckpteval.coord.layouts.base import Layout, Located, as_list, config_at, text_int

GLOBAL_STEP = re.compile(r"global_step_(\d+)")
TRACKER = "latest_checkpointed_iteration.txt"


class VerlLayout(Layout):
    name = "verl"
    signal = f"{TRACKER} in the save root holds a step >= N (written after the whole save)"
    no_weights_hint = ("verl saved only sharded FSDP/Megatron state: add hf_model to "
                       "actor_rollout_ref.actor.checkpoint.save_contents, or convert with "
                       "python -m verl.model_merger merge --backend fsdp --local_dir global_step_N/actor "
                       "--target_dir global_step_N/actor/huggingface")

    step_pattern = GLOBAL_STEP
    train_data_keys = "data.train_files (.hydra/config.yaml)"

    def train_data(self, config: Mapping[str, Any]) -> list[str]:
        return [str(p) for p in as_list(config_at(config, "data.train_files"))]

    def locate(self, entry: Path) -> Located | None:
        step = self.step_of(entry)
        if step is None:
            return None
        tracked = text_int(entry.parent / TRACKER)
        return Located(step, entry / "actor" / "huggingface", tracked is not None and tracked >= step)

    def signature(self, entry: Path) -> bool:
        return (entry / "actor").is_dir()
