"""vLLM (the ``vllm`` engine, a real server on CPU) against the in-process engine on the same prompts.

Prints tokens/s of each and their ratio, and seconds per snapshot reload of each (one run; 2 shared cores
here: a ratio, not a throughput claim). Needs ``make vllm-setup``; run by hand (a server per snapshot on
CPU: minutes), not in the smoke run. Usage: ``python bench/vllm_speed.py [N] [untied]``: ``untied``, the reference
model with an untied lm_head, which a CPU server reloads in place instead of relaunching.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from ckpteval.jobs.eval.engines.base import SamplingParams
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.engines.vllm.engine import VLLMEngine
from ckpteval.jobs.reference.model import ModelConfig, build_model, make_addition_examples, save_hf_checkpoint

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


def timed_generate(engine: object, prompts: list[str], params: SamplingParams) -> float:
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)  # type: ignore[attr-defined]
    return sum(g.n_tokens for g in out) / (time.perf_counter() - t0)


def timed_reloads(engine: object, snapshots: list[str]) -> float:
    t0 = time.perf_counter()
    for i, s in enumerate(snapshots):
        engine.load(s, f"v{i}")  # type: ignore[attr-defined]
    return (time.perf_counter() - t0) / len(snapshots)


def main(n: int = 64, untied: bool = False) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    cfg = ModelConfig(tie_word_embeddings=not untied)
    snaps = [str(save_hf_checkpoint(root / str(s), s, build_model(cfg, "llama", seed=s))) for s in range(4)]
    prompts = [r["prompt"] for r in make_addition_examples(n, seed=5)]
    params = SamplingParams(max_new_tokens=16)
    vllm = VLLMEngine(python=str(VLLM_PYTHON), dtype="float32", max_model_len=64, enforce_eager=True,
                      env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    hf = HFEngine(dtype="float32")
    try:
        t0 = time.perf_counter()
        vllm.load(snaps[0], "v0")
        launch = time.perf_counter() - t0
        hf.load(snaps[0], "v0")
        timed_generate(vllm, prompts[:4], params), timed_generate(hf, prompts[:4], params)  # warm-up
        v_tps, h_tps = timed_generate(vllm, prompts, params), timed_generate(hf, prompts, params)
        v_reload, h_reload = timed_reloads(vllm, snaps[1:]), timed_reloads(hf, snaps[1:])
    finally:
        vllm.close()
    print(f"model: reference, {'untied' if untied else 'tied'} lm_head")
    print(f"vllm launch to ready: {launch:.0f} s")
    print(f"tokens/s on {n} prompts x 16 new tokens, greedy: vllm {v_tps:.0f}, in-process {h_tps:.0f}, "
          f"ratio vllm/in-process {v_tps / h_tps:.2f}")
    print(f"reload s per snapshot: vllm {v_reload:.3f}, in-process {h_reload:.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 64, "untied" in sys.argv[2:])
