"""The reference trainer's training checkpoints: ``RUN/train_ckpt/step-<N>/``, resumable, no pickles.

Each holds ``model.safetensors`` (``safetensors.torch.save_model``, tied weights stored once),
``optimizer.safetensors`` (every optimizer state tensor plus the torch RNG state) and ``state.json``
(step, param groups). Each is published by an atomic directory rename (temp name, fsync, rename,
fsync the root); the newest :data:`KEEP_TRAIN_CKPTS` are kept. :func:`latest_train_checkpoint` finds
the newest one with its ``state.json`` (what ``--resume`` restores).

Limits: one trainer per run dir; the optimizer must keep its state as tensors or numbers.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from ckpteval.coord.atomic import fsync_dir, read_json_object, tmp_name, write_json_atomic
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.snapshot import SNAPSHOT_PREFIX, snapshot_dirname

KEEP_TRAIN_CKPTS = 2


def train_ckpt_root(run: RunDir) -> Path:
    return run.train_ckpt


def save_train_checkpoint(run: RunDir, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Path:
    """Publish ``train_ckpt/step-<N>/`` atomically; keep the newest :data:`KEEP_TRAIN_CKPTS`."""
    root = train_ckpt_root(run)
    root.mkdir(exist_ok=True)
    final = root / snapshot_dirname(step)
    if final.exists():
        return final
    tmp = tmp_name(final)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))
    state = opt.state_dict()
    tensors = {"rng.torch": torch.get_rng_state()}
    for index, slots in state["state"].items():
        for key, value in slots.items():
            tensors[f"state.{index}.{key}"] = (
                value if isinstance(value, torch.Tensor) else torch.tensor(value)
            )
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "optimizer.safetensors"))
    write_json_atomic(tmp / "state.json", {"step": step, "param_groups": state["param_groups"]})
    for name in ("model.safetensors", "optimizer.safetensors"):
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(root)
    for old in sorted(p for p in root.glob(f"{SNAPSHOT_PREFIX}*") if p.is_dir())[:-KEEP_TRAIN_CKPTS]:
        shutil.rmtree(old)
    return final


def latest_train_checkpoint(run: RunDir) -> Path | None:
    done = sorted(p for p in train_ckpt_root(run).glob(f"{SNAPSHOT_PREFIX}*") if (p / "state.json").is_file())
    return done[-1] if done else None


def load_train_checkpoint(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Restore model, optimizer and RNG from ``path``; returns its step."""
    missing, unexpected = load_model(model, str(path / "model.safetensors"))
    if missing or unexpected:
        raise ValueError(f"{path}: model keys differ (missing {missing}, unexpected {unexpected})")
    meta = read_json_object(path / "state.json")
    tensors = load_file(str(path / "optimizer.safetensors"))
    torch.set_rng_state(tensors.pop("rng.torch"))
    slots: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        slots.setdefault(int(index), {})[key] = value
    opt.load_state_dict({"state": slots, "param_groups": meta["param_groups"]})
    return int(meta["step"])
