"""Shared fixtures: tiny real models saved as HF snapshots (no downloads, built from configs)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ckpteval.jobs.eval.kinds.evaluate import install_checks
from ckpteval.jobs.reference.model import ModelConfig, build_model, generation_config, save_tokenizer

install_checks()  # as every ckpteval program does at start: the run.json parser asks the scorer and env registries

# Larger init than training uses: peaked logits keep greedy decoding of an untrained model stable.
TINY_CFG = ModelConfig(initializer_range=0.2)

SnapshotFactory = Callable[..., Path]


def save_snapshot(path: Path, seed: int, arch: str = "llama", max_shard_size: str | None = None) -> Path:
    """What a trainer publishes: ``save_pretrained`` safetensors + config + tokenizer files."""
    model = build_model(TINY_CFG, arch, seed=seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    generation_config().save_pretrained(path)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def snapshot_factory(tmp_path_factory: pytest.TempPathFactory) -> SnapshotFactory:
    """``make(seed=0, arch="llama", max_shard_size=None) -> Path``, cached per arguments."""
    cache: dict[tuple[int, str, str | None], Path] = {}

    def make(seed: int = 0, arch: str = "llama", max_shard_size: str | None = None) -> Path:
        key = (seed, arch, max_shard_size)
        if key not in cache:
            cache[key] = save_snapshot(
                tmp_path_factory.mktemp(f"snap-{arch}-{seed}"), seed, arch, max_shard_size
            )
        return cache[key]

    return make


@pytest.fixture
def tiny_snapshot(snapshot_factory: SnapshotFactory) -> Path:
    """A tiny Llama snapshot (seed 0)."""
    return snapshot_factory(seed=0)

