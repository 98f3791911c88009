"""SGLangEngine: the launch contract everywhere; a real sglang server where a GPU and sglang exist."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jobs.eval.engines.base import EngineError, SamplingParams
from jobs.eval.engines.sglang import SGLangEngine, device_flags, free_port, gpu_count, launch_command
from jobs.reference.model import (
    ModelConfig,
    build_model,
    generation_config,
    make_addition_examples,
    save_tokenizer,
)

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
needs_gpu_and_sglang = pytest.mark.skipif(
    not (HAVE_SGLANG and torch.cuda.is_available()), reason="needs a GPU and sglang"
)
# head_dim 64: a size every sglang attention backend supports.
SGLANG_CFG = ModelConfig(num_heads=2, num_kv_heads=2, initializer_range=0.2)
PROMPTS = [ex["prompt"] for ex in make_addition_examples(8, seed=3)]


def test_module_imports_without_sglang() -> None:
    code = "import sys; sys.modules['sglang'] = None; import jobs.eval.engines.sglang"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


def test_launch_command_uses_sglang_flag_names() -> None:
    cmd = launch_command("/snap", "127.0.0.1", 31000, 2, "40", ["--disable-cuda-graph"], python="py")
    assert cmd == [
        "py", "-m", "sglang.launch_server", "--model-path", "/snap", "--host", "127.0.0.1",
        "--port", "31000", "--tp-size", "2", "--weight-version", "40", "--disable-cuda-graph",
    ]  # fmt: skip
    assert "--weight-version" not in launch_command("/snap", "h", 1, 1, None)


def test_gpu_count_reads_cuda_visible_devices() -> None:
    assert gpu_count({"CUDA_VISIBLE_DEVICES": "0,3,5"}) == 3
    assert gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert gpu_count({"CUDA_VISIBLE_DEVICES": "-1"}) == 0


def test_device_flags() -> None:
    assert device_flags(None) == device_flags("cpu") == device_flags("cuda") == ([], None)
    assert device_flags("cuda:3") == (["--base-gpu-id", "3"], 1)
    with pytest.raises(ValueError):
        device_flags("tpu:0")


def test_attached_engine_cannot_restart() -> None:
    with pytest.raises(ValueError, match="not both"):
        SGLangEngine("/snap", url="http://127.0.0.1:1")
    engine = SGLangEngine(url=f"http://127.0.0.1:{free_port()}", timeout=2)
    assert engine.healthy() is False and engine.pid is None
    with pytest.raises(EngineError, match="did not launch"):
        engine.restart()
    engine.close()


def test_lazy_engine_launches_nothing_before_the_first_load() -> None:
    with pytest.raises(EngineError, match="at least one GPU"):
        SGLangEngine("/snap", env={"CUDA_VISIBLE_DEVICES": ""})
    engine = SGLangEngine(device="cpu", env={"CUDA_VISIBLE_DEVICES": "0"})
    assert engine.pid is None and engine.weight_version() is None and engine.healthy() is False
    engine.restart()  # nothing loaded yet: nothing to relaunch
    assert engine.pid is None
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        engine.load("/snap", "1")


def _snapshot(path: Path, seed: int) -> Path:
    build_model(SGLANG_CFG, "llama", seed=seed).save_pretrained(path, safe_serialization=True)
    generation_config().save_pretrained(path)
    save_tokenizer(path)
    return path


@pytest.mark.gpu
@needs_gpu_and_sglang
def test_real_sglang_server_pins_weight_versions(tmp_path: Path) -> None:
    first, second = _snapshot(tmp_path / "s1", 1), _snapshot(tmp_path / "s2", 2)
    engine = SGLangEngine(  # lazy, as the worker's factory builds it: the first load launches
        extra_args=["--disable-cuda-graph", "--mem-fraction-static", "0.2"],
        log_path=str(tmp_path / "sglang.log"),
        startup_timeout=600,
    )
    assert engine.weight_version() is None
    pid = last = None
    try:
        engine.load(str(first), "1")
        pid = engine.pid
        greedy = SamplingParams(max_new_tokens=4)
        assert engine.weight_version() == "1"
        assert {g.weight_version for g in engine.generate(PROMPTS, greedy)} == {"1"}
        engine.load(str(second), "2")
        assert engine.weight_version() == "2"
        gens = engine.generate(PROMPTS, greedy)
        assert {g.weight_version for g in gens} == {"2"} and all(g.n_tokens >= 1 for g in gens)
        engine.restart()  # relaunched with the last loaded snapshot and its version
        assert engine.pid != pid and engine.weight_version() == "2" and engine.healthy()
    finally:
        last = engine.pid
        engine.close()
    for group in {pid, last} - {None}:  # every launched process group is gone
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)
