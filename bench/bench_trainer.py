"""Reference-trainer throughput with evaluation off vs on (an eval fleet consuming), in one run.

Phase A runs ``ckpteval train --no-eval``; phase B runs the same training with the dispatcher on
(staging mode) while ``--workers`` eval worker processes (``ckpteval worker``, fleet mode) consume
the snapshots. Both phases use the same seed, steps, batch and trainer thread count; the trainer's
own summary line (steps/s over the training loop, excluding start-up and the final drain) is
compared. Also printed: export blocked/total time per point, points landed, mean lag.

On a small machine the workers compete with the trainer for cores; give the trainer and each
worker one thread (the defaults) and no more processes than cores to measure the protocol's cost
rather than CPU sharing.

Usage: ``python bench/bench_trainer.py [--steps 300] [--eval-interval 50] [--workers 1]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def trainer_cmd(run_dir: Path, args: argparse.Namespace, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ckpteval.jobs.cli", "train", "--run-dir", str(run_dir), "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--threads", str(args.trainer_threads), "--no-progress",
            "--log-interval", "50", "--ckpt-interval", str(args.steps), *extra]


def summary(stdout: str) -> dict[str, Any]:
    return json.loads(stdout.strip().splitlines()[-1])


def env(threads: int) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}


def run_without_eval(base: Path, args: argparse.Namespace) -> dict[str, Any]:
    done = subprocess.run(trainer_cmd(base / "no-eval", args, "--no-eval"), cwd=ROOT, env=env(args.trainer_threads),
                          capture_output=True, text=True, check=True)
    return summary(done.stdout)


def run_with_fleet(base: Path, args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    run_dir = base / "eval"
    trainer = subprocess.Popen(
        trainer_cmd(run_dir, args, "--eval-interval", str(args.eval_interval), "--eval-poll-interval",
                    "0.1" if args.smoke else "1",
                    "--eval-n-prompts", str(args.n_prompts), "--eval-shard-size", str(args.shard_size)),
        cwd=ROOT, env=env(args.trainer_threads), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    while not (run_dir / "run.json").exists():  # workers read the eval config from run.json
        if trainer.poll() is not None:
            raise RuntimeError(f"trainer exited early: {trainer.stderr.read() if trainer.stderr else ''}")
        time.sleep(0.05)
    workers = [
        subprocess.Popen([sys.executable, "-m", "ckpteval.jobs.cli", "worker", "--run-dir", str(run_dir), "--poll-interval",
                          "0.1" if args.smoke else "0.5"], cwd=ROOT, env=env(1), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(args.workers)
    ]
    out, err = trainer.communicate()
    if trainer.returncode:
        raise RuntimeError(f"trainer failed ({trainer.returncode}): {err[-2000:]}")
    for w in workers:
        try:
            w.wait(timeout=120)
        except subprocess.TimeoutExpired:
            w.terminate()
            w.wait()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return summary(out), [m for m in metrics if "eval/step" in m]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--n-prompts", type=int, default=128)
    p.add_argument("--shard-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--trainer-threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="trainer and workers poll every 0.1 s (tests/test_bench_smoke.py)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        base = Path(tmp)
        plain = run_without_eval(base, args)
        evald, points = run_with_fleet(base, args)
    landed = [pt for pt in points if "eval/skipped_drain_timeout" not in pt]
    blocked = [pt["eval/export_blocked_seconds"] for pt in points if "eval/export_blocked_seconds" in pt]
    total = [pt["eval/export_time_seconds"] for pt in points if "eval/export_time_seconds" in pt]
    lags = [pt["eval/lag_steps"] for pt in landed]
    ratio = evald["steps_per_second"] / plain["steps_per_second"]
    print(f"steps={args.steps} batch={args.batch_size} eval_interval={args.eval_interval} workers={args.workers} "
          f"trainer_threads={args.trainer_threads} cpus={os.cpu_count()}")
    print(f"no eval:        {plain['steps_per_second']:.2f} steps/s")
    print(f"eval + fleet:   {evald['steps_per_second']:.2f} steps/s  ({len(landed)}/{len(points)} points landed, "
          f"mean lag {statistics.fmean(lags) if lags else float('nan'):.1f} steps)")
    if blocked:
        print(f"export per point: blocked {1e3 * statistics.fmean(blocked):.2f} ms, "
              f"total {1e3 * statistics.fmean(total):.1f} ms (mean of {len(blocked)})")
    print(f"ratio (eval on / off): {ratio:.3f}")
    best = max((pt for pt in landed if "eval/addition" in pt), key=lambda pt: pt["eval/step"], default=None)
    if best is not None:
        print(f"last point: step {best['eval/step']} exact match {best['eval/addition']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
