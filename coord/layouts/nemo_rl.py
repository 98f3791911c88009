"""NeMo-RL (NVIDIA-NeMo/RL): GRPO/DPO/SFT with the DTensor (automodel) or Megatron policy.

Checked at NVIDIA-NeMo/RL commit 7ea279abfbeb698b092856d0dab61e7cf39bc909 (2026-08-22).

Read in ``nemo_rl/utils/checkpoint.py`` (``CheckpointManager``): each save is written into
``checkpoint_dir/tmp_step_<N>/`` (``training_info.json`` and ``config.yaml`` first, then the policy's
``policy/weights/``, ``policy/optimizer/``, ``policy/tokenizer/``) and renamed to ``step_<N>/`` only when
every writer has finished (``_rename_checkpoint``, after ``wait_fn`` for async saves);
``remove_old_checkpoints`` keeps ``keep_top_k`` / ``ft_keep_latest_k``. In
``nemo_rl/utils/automodel_checkpoint.py`` the DTensor policy saves through nemo-automodel: DCP shards by
default, HF safetensors with ``model_save_format: safetensors``, and a consolidated HF export
(``policy/weights/model/consolidated/``) with ``save_consolidated: true`` (both under
``policy.dtensor_cfg``).

Completion signal: the rename — a ``step_<N>/`` dir (with its ``training_info.json``) is finished.
Weights: the first of ``policy/weights/model/consolidated``, ``policy/weights/consolidated``,
``policy/weights/model``, ``policy/weights`` that exists.

Training data: the run's config (each save holds it: ``step_<N>/config.yaml``) names ``data.train``, one
dataset or a list, each a local ``data_path`` or a ``dataset_name`` (read in ``examples/configs/grpo_math_1B.yaml``
at commit b26cfeb3a263941c4363ead019f3f837c07bdef9; a hub name is not read: nothing is downloaded).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckpteval.coord.layouts.base import Layout, Located, as_list, config_at

STEP = re.compile(r"step_(\d+)")
INFO = "training_info.json"
WEIGHT_DIRS = ("policy/weights/model/consolidated", "policy/weights/consolidated", "policy/weights/model",
               "policy/weights")


class NemoRLLayout(Layout):
    name = "nemo-rl"
    signal = "the rename of tmp_step_N/ to step_N/ (done after every writer finished)"
    no_weights_hint = ("the policy saved torch DCP shards: set policy.dtensor_cfg.save_consolidated=true "
                       "(and model_save_format=safetensors), or convert with "
                       "examples/converters/convert_dcp_to_hf.py (Megatron: convert_megatron_to_hf.py)")

    step_pattern = STEP
    train_data_keys = "data.train's data_path or dataset_name (step_N/config.yaml)"
    config_names = ("config.yaml",)

    def train_data(self, config: Mapping[str, Any]) -> list[str]:
        sets = [d for d in as_list(config_at(config, "data.train")) if isinstance(d, Mapping)]
        return [str(d.get("data_path") or d.get("dataset_name")) for d in sets if d.get("data_path") or d.get("dataset_name")]

    def locate(self, entry: Path) -> Located | None:
        step = self.step_of(entry)
        if step is None:
            return None
        weights = next((entry / d for d in WEIGHT_DIRS if (entry / d).is_dir()), entry / WEIGHT_DIRS[-1])
        return Located(step, weights, self.signature(entry))

    def signature(self, entry: Path) -> bool:
        return (entry / INFO).is_file()
