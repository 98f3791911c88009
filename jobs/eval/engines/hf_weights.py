"""Reading a snapshot's weights for :class:`jobs.eval.engines.hf.HFEngine`: config, shards, checks.

What it owns: which files are a snapshot's weights (:func:`weight_files`: the safetensors index or
``model.safetensors``; pickled ``*.bin`` weights are refused), reading them onto a device
(:func:`read_state_dict`), whether a new snapshot can be copied into the loaded model in place
(:func:`arch_signature`: ``config.json`` minus bookkeeping keys), tied parameters the file left out
(:func:`complete_tied`), and the key/shape check done before any weight is touched
(:func:`check_state_dict`). Every failure is an :class:`~jobs.eval.engines.base.EngineError` naming the file.

Limits: only safetensors are ever read; the whole state dict is held in memory at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from jobs.eval.engines.base import EngineError

# config.json keys that say nothing about the weights' layout: a change here still reloads in place.
_BOOKKEEPING_KEYS = frozenset({"transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache"})


def read_config(snapshot: Path) -> dict[str, Any]:
    """The snapshot's ``config.json`` as a dict; :class:`EngineError` if missing or not JSON."""
    path = snapshot / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EngineError(f"cannot read {path}: {e}") from e


def arch_signature(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a config.json that decides whether weights can be copied in place."""
    return {k: v for k, v in config.items() if k not in _BOOKKEEPING_KEYS}


def weight_files(snapshot: Path) -> list[Path]:
    """The snapshot's safetensors shards (from the index when sharded); refuses pickled weights."""
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise EngineError(f"unreadable safetensors index {index}: {e}") from e
    elif (snapshot / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        raise EngineError(f"no safetensors weights in {snapshot} (pickled *.bin checkpoints are refused)")
    files = [snapshot / name for name in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise EngineError(f"shards named by the index are missing: {missing}")
    return files


def read_state_dict(snapshot: Path, device: str) -> dict[str, torch.Tensor]:
    """Every tensor of every shard, loaded straight onto ``device``."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(snapshot):
        try:
            state.update(load_file(path, device=device))
        except (OSError, SafetensorError) as e:
            raise EngineError(f"cannot read {path}: {e}") from e
    return state


def complete_tied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` plus entries for tied parameters the file left out (e.g. ``lm_head.weight``)."""
    names_by_param: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names_by_param.setdefault(id(tensor), []).append(name)
    completed = dict(state)
    for names in names_by_param.values():
        present = [n for n in names if n in state]
        for name in names:
            if name not in completed and present:
                completed[name] = state[present[0]]
    return completed


def check_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Raise :class:`EngineError` unless ``state`` has exactly the model's keys and shapes."""
    expected = model.state_dict(keep_vars=True)
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    wrong_shape = [
        f"{k}: {tuple(state[k].shape)} != {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or wrong_shape:
        raise EngineError(
            f"snapshot weights do not fit the loaded model: missing={missing[:5]} "
            f"unexpected={unexpected[:5]} wrong_shape={wrong_shape[:5]}"
        )
