"""LoRA adapters of a PEFT model, as what an adapter snapshot holds.

Owns the trainer side of LoRA runs (``run.json`` ``eval.base_model`` set): :func:`is_peft_model` tells an
adapter-bearing model from a plain one, :func:`adapter_state` extracts the trainable adapter's tensors
(PEFT's ``get_peft_model_state_dict`` key names, what ``PeftModel.from_pretrained`` and sglang load) and
its ``adapter_config.json`` contents. The files are written by
:func:`ckpteval.jobs.trainer.export.hf_files.write_adapter_files` (our safetensors writer, no pickles).

Limits: one adapter per model (the active one); LoRA only (``peft_type == "LORA"``); the base model's
weights are never exported — they must stay at the path ``run.json`` names, unchanged, for the run's
lifetime. peft is imported only when a model already is a PEFT model.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (without importing peft when nobody has)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def adapter_state(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The active adapter's tensors (live views, not copies) and its JSON-ready config."""
    from peft import get_peft_model_state_dict

    name = model.active_adapter
    config = model.peft_config[name]
    if getattr(config, "peft_type", None) is None or str(config.peft_type.value) != "LORA":
        raise ValueError(f"only LoRA adapters can be exported, got {config.peft_type}")
    state = get_peft_model_state_dict(model, adapter_name=name)
    return dict(state), config_json(config)


def config_json(config: Any) -> dict[str, Any]:
    """``adapter_config.json`` contents for a peft config, as ``PeftConfig.save_pretrained`` writes them
    (sets as sorted lists, ``inference_mode`` true)."""
    raw = config.to_dict()
    raw["inference_mode"] = True
    return json.loads(json.dumps(raw, default=_jsonable))


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    if hasattr(value, "value"):  # enums (PeftType, TaskType)
        return value.value
    raise TypeError(f"adapter config value {value!r} is not JSON-serialisable")
