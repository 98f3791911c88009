"""HFEngine's GPU defaults on CPU: ``dtype="auto"`` keeps the snapshot's dtype (bf16 stays bf16), the CPU
fallback to float32, and the in-place reload that reads tensors straight into the resident parameters
(into a bf16 model, across a dtype difference, and a file truncated after verification)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ckpteval.jobs.eval.engines.base import EngineError, SamplingParams
from ckpteval.jobs.eval.engines.hf import engine as hf
from ckpteval.jobs.eval.engines.hf import weights as hf_weights
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.engines.hf.weights import cpu_supports, snapshot_dtype
from ckpteval.jobs.reference.model import build_model, save_base_model_dir
from tests.conftest import TINY_CFG

PROBE = torch.tensor([[1, 4, 5, 14, 6, 15]])


def _snapshot(path: Path, seed: int, dtype: torch.dtype) -> Path:
    return save_base_model_dir(path, TINY_CFG, model=build_model(TINY_CFG, seed=seed).to(dtype))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(PROBE).logits.float()


def _reference(snapshot: Path, dtype: torch.dtype) -> torch.Tensor:
    return _logits(AutoModelForCausalLM.from_pretrained(snapshot, dtype=dtype, local_files_only=True))


def test_auto_dtype_serves_a_bf16_snapshot_in_bf16_on_this_cpu(tmp_path: Path) -> None:
    """torch's CPU build here runs bf16 matmuls, so ``auto`` keeps bf16 (no upcast) and generates."""
    snap = _snapshot(tmp_path / "bf16", 0, torch.bfloat16)
    assert snapshot_dtype(snap, json.loads((snap / "config.json").read_text())) == torch.bfloat16
    assert cpu_supports(torch.bfloat16)
    engine = HFEngine()
    engine.load(str(snap), "1")
    assert engine.model.dtype == torch.bfloat16
    gens = engine.generate(["07+35=", "1"], SamplingParams(max_new_tokens=3))
    assert [g.weight_version for g in gens] == ["1", "1"] and all(g.n_tokens >= 1 for g in gens)
    assert torch.equal(_logits(engine.model), _reference(snap, torch.bfloat16))
    forced = HFEngine(dtype="float32")
    forced.load(str(snap), "1")
    assert forced.model.dtype == torch.float32


def test_auto_dtype_falls_back_to_float32_where_cpu_kernels_are_missing(tmp_path: Path) -> None:
    """This CPU has bf16 kernels, so the missing-kernel case is simulated by the probe's cached answer
    (the only fake here); the rest is the real load path."""
    snap = _snapshot(tmp_path / "bf16", 0, torch.bfloat16)
    saved = dict(hf_weights._CPU_DTYPE_OK)
    hf_weights._CPU_DTYPE_OK[torch.bfloat16] = False
    try:
        engine = HFEngine()
        engine.load(str(snap), "1")
        assert engine.model.dtype == torch.float32
    finally:
        hf_weights._CPU_DTYPE_OK.clear()
        hf_weights._CPU_DTYPE_OK.update(saved)


def test_dtype_from_the_safetensors_header_when_config_has_none(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path / "f16", 0, torch.float16)
    config = json.loads((snap / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    assert snapshot_dtype(snap, config) == torch.float16


def test_reload_straight_into_resident_bf16_parameters(tmp_path: Path) -> None:
    first, second = _snapshot(tmp_path / "a", 0, torch.bfloat16), _snapshot(tmp_path / "b", 1, torch.bfloat16)
    engine = HFEngine()
    engine.load(str(first), "1")
    model = engine.model
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    engine.load(str(second), "2")
    assert engine.model is model and engine.weight_version() == "2"
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == pointers  # same memory, new values
    assert torch.equal(_logits(model), _reference(second, torch.bfloat16))


def test_reload_converts_when_the_file_dtype_differs_from_the_resident_one(tmp_path: Path) -> None:
    base, update = _snapshot(tmp_path / "a", 0, torch.float32), _snapshot(tmp_path / "b", 1, torch.bfloat16)
    engine = HFEngine(dtype="float32")
    engine.load(str(base), "1")
    engine.load(str(update), "2")  # same architecture (dtype is bookkeeping): in place, bf16 -> float32
    assert engine.model.dtype == torch.float32
    assert torch.allclose(_logits(engine.model), _reference(update, torch.float32))


def test_a_file_truncated_after_the_header_check_leaves_the_version_undefined(tmp_path: Path) -> None:
    first = _snapshot(tmp_path / "a", 0, torch.float32)
    bad = shutil.copytree(_snapshot(tmp_path / "b", 1, torch.float32), tmp_path / "bad")
    engine = HFEngine()
    engine.load(str(first), "1")
    weights = bad / "model.safetensors"
    size = weights.stat().st_size
    with pytest.raises(EngineError, match="do not hold shape|bytes"):  # header promises more than the file has
        os.truncate(weights, size - 64)
        engine.load(str(bad), "2")
    assert engine.weight_version() == "1"  # refused from the header: nothing touched
    # a file that shrinks between the header check and the read: weights undefined, version None
    real_index = hf.index_tensors

    def index_then_truncate(files):  # noqa: ANN001, ANN202 — the real index, then the file loses its tail
        index = real_index(files)
        os.truncate(weights, size // 2)
        return index

    os.truncate(weights, size)  # pad back to full size (zeros): the header check passes again
    hf.index_tensors = index_then_truncate
    try:
        with pytest.raises(EngineError, match="failed midway"):
            engine.load(str(bad), "3")
    finally:
        hf.index_tensors = real_index
    assert engine.weight_version() is None
