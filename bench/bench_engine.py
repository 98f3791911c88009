"""Tokens/s of ``HFEngine``: one batched call over N prompts vs the same prompts one at a time; and
the cost of per-sample seeds: a sampled batch with one seed per prompt vs the same batch with one
seed for the call (today's batched sampling).

All are measured in the same run, on the reference model (``ckpteval.jobs.reference.model`` defaults: 2-layer Llama,
hidden 128) saved as a snapshot; batching with greedy decoding (so both modes generate the same
tokens), seeds at temperature 1 on the untrained model (which rarely emits eos, so both modes run
about the same number of decoding steps; tokens/s is what is compared).
The load average is printed first: on a shared machine, numbers mean little when it is high.

    .venv/bin/python bench/bench_engine.py [--prompts 64] [--max-new-tokens 16] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ckpteval.jobs.eval.engines.base import SamplingParams
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.reference.model import (
    ModelConfig,
    build_model,
    make_addition_examples,
    save_base_model_dir,
)


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    """Seconds taken by ``fn()`` and the tokens it generated."""
    start = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - start, tokens


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="best of N for each mode")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)

    print(f"load average {os.getloadavg()}, {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}")
    prompts = [ex["prompt"] for ex in make_addition_examples(args.prompts, seed=0)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        save_base_model_dir(tmp, ModelConfig(), "llama", model=build_model(seed=0))
        engine = HFEngine(device=args.device)
        engine.load(tmp, "0")
        engine.generate(prompts[:4], params)  # warm-up

        def batched() -> int:
            return sum(g.n_tokens for g in engine.generate(prompts, params))

        def one_at_a_time() -> int:
            return sum(engine.generate([p], params)[0].n_tokens for p in prompts)

        sampled = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
        seeds = list(range(len(prompts)))

        def one_seed() -> int:
            return sum(g.n_tokens for g in engine.generate(prompts, sampled))

        def per_sample_seeds() -> int:
            return sum(g.n_tokens for g in engine.generate(prompts, sampled, seeds=seeds))

        runs = {
            name: [timed(fn) for _ in range(args.repeats)]
            for name, fn in [("batched", batched), ("single", one_at_a_time)]
        }
        runs.update({
            name: [timed(fn) for _ in range(args.repeats)]
            for name, fn in [("sampled", one_seed), ("seeded", per_sample_seeds)]
        })
        engine.close()

    rates = {}
    for name, results in runs.items():
        seconds, tokens = min(results)
        rates[name] = tokens / seconds
        print(
            f"{name:>8}: {tokens} tokens in {seconds:.3f}s = {rates[name]:,.0f} tokens/s (best of {args.repeats})"
        )
    print(
        f"   ratio: batched / one-at-a-time = {rates['batched'] / rates['single']:.1f}x ({args.prompts} prompts)"
    )
    print(f"   ratio: per-sample seeds / one seed per call = {rates['seeded'] / rates['sampled']:.2f}x (sampled)")
    out = {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
           "torch_threads": torch.get_num_threads(),
           "batched_tokens_per_s": rates["batched"], "single_tokens_per_s": rates["single"],
           "ratio": rates["batched"] / rates["single"],
           "sampled_tokens_per_s": rates["sampled"], "seeded_tokens_per_s": rates["seeded"],
           "seeded_ratio": rates["seeded"] / rates["sampled"]}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
