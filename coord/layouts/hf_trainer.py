"""Hugging Face ``transformers.Trainer`` and every trainer built on it (TRL's SFT/DPO/GRPO/PPO trainers).

Checked against transformers 5.24.0 (the pinned version; the suite runs a real ``Trainer``) and trl 1.16.0
(``GRPOTrainer`` in ``trl/trainer/grpo_trainer.py`` subclasses ``Trainer``; its ``_save_checkpoint`` calls the
Trainer's, then with ``use_adaptive_entropy`` writes ``entropy_ctrl_state.json`` — after ``trainer_state.json``,
but no file eval loads; ``examples/trl/grpo.py`` runs it).

Read in huggingface/transformers ``src/transformers/trainer.py`` (``Trainer._save_checkpoint``) and
``trainer_utils.py`` (``PREFIX_CHECKPOINT_DIR = "checkpoint"``): a save is ``OUTPUT_DIR/checkpoint-<global_step>/``;
``_save_checkpoint`` writes the model (``save_model``: config, weights, tokenizer), then — unless
``save_only_model`` — optimizer, scheduler, scaler and RNG state (with DeepSpeed its ``global_step<N>/``
ZeRO shards), and only then ``trainer_state.json``; after that ``_rotate_checkpoints`` deletes the
oldest saves beyond ``save_total_limit``. Some versions stage the save in ``tmp-checkpoint-<N>/`` and
rename it (never looked at here).

Completion signal: ``trainer_state.json`` present, readable, and its ``global_step`` equal to the dir's
step — written last, so the save is admissible at once, with no quiescence wait.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckpteval.coord.layouts.base import Layout, Located, as_list, json_int

CHECKPOINT = re.compile(r"checkpoint-(\d+)")
STATE = "trainer_state.json"


class HFTrainerLayout(Layout):
    name = "hf-trainer"
    signal = "trainer_state.json (written last by Trainer._save_checkpoint) with the dir's global_step"
    no_weights_hint = ("a DeepSpeed ZeRO-3 or FSDP SHARDED_STATE_DICT save without a gathered model: set "
                       "stage3_gather_16bit_weights_on_model_save=true / fsdp_state_dict_type=FULL_STATE_DICT, "
                       "or convert with zero_to_fp32.py (DeepSpeed) or accelerate merge-weights (FSDP)")

    step_pattern = CHECKPOINT
    train_data_keys = "dataset_name, or datasets[].path / data_files (TRL's --config YAML)"

    def train_data(self, config: Mapping[str, Any]) -> list[str]:
        found = [str(config["dataset_name"])] if config.get("dataset_name") else []
        for mix in as_list(config.get("datasets")):
            if not isinstance(mix, Mapping) or not mix.get("path"):
                continue
            files = mix.get("data_files")
            files = [f for v in files.values() for f in as_list(v)] if isinstance(files, Mapping) else as_list(files)
            found += [str(Path(str(mix["path"])) / str(f)) for f in files] if files else [str(mix["path"])]
        return found

    def locate(self, entry: Path) -> Located | None:
        step = self.step_of(entry)
        return None if step is None else Located(step, entry, json_int(entry / STATE, "global_step") == step)

    def signature(self, entry: Path) -> bool:
        return (entry / STATE).is_file()
