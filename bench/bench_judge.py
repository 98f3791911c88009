"""Judge throughput with the verdict cache cold vs warm.

Starts the judge stand-in (``ckpteval serve --judge MODE``, a real HTTP server process; ``--judge-delay``
stands in for an LLM's latency with mode ``slow``), then scores the same N distinct (question, response)
samples through :class:`ckpteval.jobs.eval.scorers.judge.scorer.JudgeScorer` twice in one run dir:

- cold: an empty ``RUN/judge_cache/`` — every sample is a judge request (plus a cache write);
- warm: the same samples again — every sample is a cache read, the judge is not called.

Prints samples/s of each and the ratio warm/cold (the baseline, cold, is measured in the same run), and
how many requests the judge answered (from its ``/judge_stats``). The machine is shared and noisy: the
load average at start is printed.

With ``--trainer-steps N``: the reference trainer's steps/s (``bench_stall.py``'s measurement, fleet reuse,
one ``hf`` worker) with a judged eval set (the built-in addition prompts, ``scorer: judge``, judged by the
same stand-in) vs its no-eval baseline (``--save-hf`` at the same interval), in the same run.

Usage: python bench/bench_judge.py [--samples 512] [--concurrency 8] [--delay-ms 20] [--smoke]
[--trainer-steps 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckpteval.coord.entries.generate import GenerateEntry  # noqa: E402
from ckpteval.coord.run.rundir import RunDir  # noqa: E402
from ckpteval.jobs.eval.scorers import Sample, ScorerContext  # noqa: E402
from ckpteval.jobs.eval.scorers.judge.scorer import JudgeScorer  # noqa: E402


def start_judge(delay_s: float) -> tuple[str, subprocess.Popen[str]]:
    mode = "slow" if delay_s > 0 else "exact"
    cmd = [sys.executable, "-m", "ckpteval.jobs.cli", "serve", "--judge", mode, "--judge-delay", str(delay_s), "--port", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready and (line := proc.stdout.readline()).startswith("serving on "):  # type: ignore[union-attr]
            return line.split()[-1] + "/v1", proc
    proc.kill()
    raise RuntimeError("the judge stand-in did not start")


def judged(url: str) -> int:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/judge_stats", timeout=10) as r:
        return int(json.loads(r.read())["chat_completions"])


def timed(scorer: JudgeScorer, samples: list[Sample]) -> tuple[float, list[float], int]:
    t0 = time.perf_counter()
    scored = scorer.score(samples)
    elapsed = time.perf_counter() - t0
    return elapsed, [s.score for s in scored], sum(s.counters["judge_cache_hits"] for s in scored)


def trainer_stall(url: str, steps: int, tmp: Path) -> dict[str, Any]:
    """Trainer steps/s with a judged set (fleet reuse, one worker) vs no-eval + save-hf (bench_stall's runs)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_stall import Config, run_one

    from ckpteval.jobs.eval.kinds.generate.evalsets import write_jsonl
    from ckpteval.jobs.reference.model import make_addition_examples

    write_jsonl(tmp / "qa.jsonl", make_addition_examples(32, 1234))
    (tmp / "judged.json").write_text(json.dumps({"eval": {"datasets": [
        {"name": "qa", "path": "qa.jsonl", "n_prompts": 32, "shard_size": 16, "max_new_tokens": 5,
         "scorer": "judge", "scorer_options": {"url": url, "retries": 1}}]}}))
    args = argparse.Namespace(steps=steps, batch_size=32, eval_interval=max(1, steps // 4), poll=0.5, timeout=600.0,
                              keep=False, eval_config=tmp / "judged.json", worker_args=())
    runs = {}
    for i, cfg in enumerate([Config("no-eval+save-hf", "none", save_hf=True),
                             Config("fleet-reuse judged", "reuse", save_hf=True, workers=1)]):
        runs[cfg.name] = run_one(cfg, tmp, tmp, args, i)
    base, judged = runs["no-eval+save-hf"], runs["fleet-reuse judged"]
    return {"steps": steps, "eval_interval": args.eval_interval, "no_eval_steps_per_s": base["steps_per_second"],
            "judged_steps_per_s": judged["steps_per_second"],
            "ratio": judged["steps_per_second"] / base["steps_per_second"],
            "points": judged["points"], "skipped_points": judged["skipped_points"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--delay-ms", type=float, default=20.0, help="judge latency per request (stand-in; 0: none)")
    p.add_argument("--smoke", action="store_true", help="32 samples, 5 ms: a quick check that it runs")
    p.add_argument("--trainer-steps", type=int, default=0,
                   help="also time the reference trainer with a judged set vs no-eval (0: skip)")
    p.add_argument("--json", type=Path, help="write the numbers here")
    args = p.parse_args(argv)
    if args.smoke:
        args.samples, args.delay_ms = 32, 5.0
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    url, proc = start_judge(args.delay_ms / 1000)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-judge-") as tmp:
            run = RunDir.create(Path(tmp) / "run")
            spec = GenerateEntry(name="qa", path="data/qa.jsonl", n_prompts=args.samples, scorer="judge",
                               scorer_options={"url": url, "concurrency": args.concurrency, "retries": 0})
            scorer = JudgeScorer(spec, ScorerContext(run_dir=run.path))
            samples = [Sample(completion=str(i % 7), row={"prompt": f"q{i}", "answer": str(i % 5)}, prompt=f"q{i}")
                       for i in range(args.samples)]
            cold_s, cold, cold_hits = timed(scorer, samples)
            paid = judged(url)
            warm_s, warm, warm_hits = timed(JudgeScorer(spec, ScorerContext(run_dir=run.path)), samples)
            paid_warm = judged(url) - paid
            stall = trainer_stall(url, args.trainer_steps, Path(tmp)) if args.trainer_steps else None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    if cold != warm or cold_hits != 0 or warm_hits != args.samples or paid != args.samples or paid_warm != 0:
        print(f"MISMATCH: cold hits {cold_hits}, warm hits {warm_hits}, judge paid {paid} then {paid_warm}")
        return 1
    n = args.samples
    out = {"samples": n, "concurrency": args.concurrency, "delay_ms": args.delay_ms,
           "cold_per_s": n / cold_s, "warm_per_s": n / warm_s, "ratio": cold_s / warm_s,
           "judge_requests": {"cold": paid, "warm": paid_warm}}
    print(f"{n} samples, concurrency {args.concurrency}, judge latency {args.delay_ms:g} ms (stand-in)")
    print(f"cold cache: {out['cold_per_s']:.1f} samples/s ({paid} judge requests)")
    print(f"warm cache: {out['warm_per_s']:.1f} samples/s ({paid_warm} judge requests)")
    print(f"ratio warm/cold: {out['ratio']:.1f}x")
    if stall is not None:
        out["trainer"] = stall
        print(f"trainer, {stall['steps']} steps, a judged point every {stall['eval_interval']}: "
              f"{stall['judged_steps_per_s']:.1f} steps/s vs no-eval {stall['no_eval_steps_per_s']:.1f} "
              f"(ratio {stall['ratio']:.2f}; {stall['points']} points, skipped {stall['skipped_points'] or 'none'})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
