"""Shared helpers for the coord tests: a small real run dir and a fake-free snapshot writer."""

from __future__ import annotations

import os
from pathlib import Path

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest
from ckpteval.coord.run.rundir import RunDir


def make_run(tmp: Path, n_prompts: int = 10, shard_size: int = 5, lease: LeaseSettings | None = None,
             datasets: tuple[str, ...] = ("add",)) -> RunDir:
    specs = tuple(GenerateEntry(name=n, path=f"data/{n}.jsonl", n_prompts=n_prompts, shard_size=shard_size)
                  for n in datasets)
    manifest = RunManifest(
        run_id="test-run",
        eval=EvalSpec(entries=specs),
        snapshot_roots=(str(tmp / "run" / "snapshots"),),
        lease=lease or LeaseSettings(30.0, 5.0),
    )
    return RunDir.create(tmp / "run", manifest)


def write_tiny_shards(out: Path, n_shards: int = 2, numel: int = 1024, seed: int = 0) -> None:
    """Real safetensors shards (no model needed for protocol tests)."""
    import torch  # here, not at module level: fn-backend worker processes import this module (via workers.py)
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    for i in range(n_shards):
        save_file({f"w{i}": torch.randn(numel, generator=g)}, str(out / f"model-{i:05d}.safetensors"))
    (out / "config.json").write_text('{"model_type": "llama"}')


def flip_byte(path: Path, offset_from_end: int = 10) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - offset_from_end)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
