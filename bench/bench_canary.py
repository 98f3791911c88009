"""The canary's bounds and cost (#19 §2): max |Δ log-prob| of an engine vs the trainer, and its seconds.

For ``--seeds`` snapshots of the reference model (the trainer's fp32 weights; ``--train-steps`` of the
reference trainer's addition task first, so the probe's distributions are peaked as in a real run), the
canary is stored at export (:func:`ckpteval.jobs.eval.proof.canary.canary_bytes`, probe: the built-in addition eval
set) and recomputed by an :class:`HFEngine` in float32 (the trainer's dtype) and in bfloat16. Printed:
the largest max |Δ log-prob| and the smallest argmax agreement of each, over every seed, which is what
``--canary-max-diff``'s default is chosen from, and the canary's seconds against an in-place reload.

    .venv/bin/python bench/bench_canary.py [--seeds 5] [--train-steps 200] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.snapshot import publish_snapshot, read_marker
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.kinds.generate.evalsets import load_dataset, write_addition_dataset
from ckpteval.jobs.eval.proof.canary import canary_bytes, probe_rows
from ckpteval.jobs.eval.proof.canary_check import check_canary
from ckpteval.jobs.reference.model import (
    build_model,
    build_tokenizer,
    make_addition_examples,
    save_base_model_dir,
)
from ckpteval.jobs.trainer.export.hf_files import write_hf_files


def trained(seed: int, steps: int) -> torch.nn.Module:
    """The reference model after ``steps`` AdamW steps on the addition task (teacher-forced loss)."""
    model = build_model(seed=seed).train()
    tokenizer = build_tokenizer()
    examples = make_addition_examples(256, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for i in range(steps):
        batch = [examples[(i * 16 + j) % len(examples)] for j in range(16)]
        enc = tokenizer([e["prompt"] + e["answer"] for e in batch], return_tensors="pt", padding=True)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        loss = model(**enc, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--train-steps", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="one seed, 5 training steps")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.smoke:
        args.seeds, args.train_steps = 1, 5
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}  cpus: {os.cpu_count()}")
    worst: dict[str, dict[str, float]] = {}
    seconds: dict[str, float] = {"canary": 0.0, "reload": 0.0}
    with tempfile.TemporaryDirectory(prefix="ckpteval-canary-") as tmp:
        run = RunDir.create(Path(tmp) / "run")
        pairs = probe_rows(load_dataset(run, write_addition_dataset(run, n=16, shard_size=16)))
        base = save_base_model_dir(Path(tmp) / "base")
        for seed in range(args.seeds):
            model = trained(seed, args.train_steps)
            canary = canary_bytes(model, build_tokenizer(), pairs)
            path = publish_snapshot(run.snapshots, seed, lambda d, m=model, c=canary: {
                **write_hf_files(d, m.state_dict(), base), **_write(d / "canary.json", c)})
            marker = read_marker(path)
            for dtype in ("float32", "bfloat16"):
                engine = HFEngine(dtype=dtype)
                engine.load(str(path), "a")
                t0 = time.perf_counter()
                engine.load(str(path), "b")
                seconds["reload"] += time.perf_counter() - t0
                fidelity = check_canary(engine, path, marker, 0.0)
                seconds["canary"] += fidelity.seconds
                engine.close()
                w = worst.setdefault(dtype, {"max_abs_logprob_diff": 0.0, "argmax_agreement": 1.0})
                w["max_abs_logprob_diff"] = max(w["max_abs_logprob_diff"], fidelity.max_abs_logprob_diff)
                w["argmax_agreement"] = min(w["argmax_agreement"], fidelity.argmax_agreement)
    print(f"{args.seeds} snapshots of the reference model trained {args.train_steps} steps, probe {len(pairs)} rows")
    for dtype, w in worst.items():
        print(f"engine {dtype:<9} vs fp32 trainer: max |Δ log-prob| {w['max_abs_logprob_diff']:.3g}, "
              f"min argmax agreement {w['argmax_agreement']:.3f}")
    print(f"canary {seconds['canary'] * 1e3:.1f} ms vs in-place reload {seconds['reload'] * 1e3:.1f} ms (summed): "
          f"ratio {seconds['canary'] / seconds['reload']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"worst": worst, "seconds": seconds, "args": vars(args)}, default=str))
    return 0


def _write(path: Path, data: bytes) -> dict[str, dict[str, int]]:
    path.write_bytes(data)
    return {}


if __name__ == "__main__":
    raise SystemExit(main())
