"""Answers/s of the ``math`` scorer (math-verify): the deadline-enforcing process pool vs inline grading.

Both are measured in the same run on the same answers: a GSM8K/MATH-like mix of boxed integers,
``#### n`` endings (some wrong), LaTeX fractions and decimals. *Inline* grades in the calling thread
with math-verify's timeouts off (no deadline at all: the fastest possible, and what a hung answer
would hang); *pooled* is :class:`ckpteval.jobs.eval.scorers.grader.GraderPool` (spawned processes, a per-answer
deadline), started before timing — its start-up is reported separately. The load average is printed
first: on a shared machine, numbers mean little when it is high.

    .venv/bin/python bench/bench_grader.py [--answers 400] [--processes 2] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from ckpteval.jobs.eval.scorers.grader import GraderPool, grade_inline


def answers(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        a = rng.randint(1, 500)
        kind = i % 4
        if kind == 0:
            pairs.append((f"Let's compute step by step. {a - 3} + 3 = {a}. The answer is \\boxed{{{a}}}.", str(a)))
        elif kind == 1:
            pairs.append((f"She has {a // 2} and {a - a // 2} so {a}.\n#### {a if i % 8 != 1 else a + 1}", str(a)))
        elif kind == 2:
            pairs.append((f"Therefore the final answer is $\\frac{{{2 * a}}}{{2}}$", str(a)))
        else:
            pairs.append((f"The answer is {a}.0", f"\\frac{{{2 * a}}}{{2}}"))
    return pairs


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", type=int, default=400)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="best of N for each mode")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)

    print(f"load average {os.getloadavg()}, {os.cpu_count()} cpus")
    pairs = answers(args.answers)
    grade_inline(pairs[:8])  # warm-up: imports, sympy caches
    pool = GraderPool(processes=args.processes, timeout_s=30.0)
    t0 = time.perf_counter()
    pool.grade(pairs[:8])
    startup_s = time.perf_counter() - t0
    best: dict[str, float] = {}
    correct: dict[str, int] = {}
    try:
        for name, grade in (("inline", grade_inline), ("pooled", pool.grade)):
            for _ in range(args.repeats):
                start = time.perf_counter()
                graded = grade(pairs)
                seconds = time.perf_counter() - start
                best[name] = min(best.get(name, float("inf")), seconds)
                correct[name] = sum(g.score == 1.0 for g in graded)
    finally:
        pool.close()
    if correct["inline"] != correct["pooled"]:
        raise RuntimeError(f"pooled and inline grading disagree: {correct}")
    rates = {name: args.answers / s for name, s in best.items()}
    for name in ("inline", "pooled"):
        print(f"{name:>7}: {args.answers} answers in {best[name]:.2f}s = {rates[name]:,.0f} answers/s "
              f"(best of {args.repeats}, {correct[name]} correct)")
    print(f"  ratio: pooled / inline = {rates['pooled'] / rates['inline']:.2f}x ({args.processes} processes); "
          f"pool start {startup_s:.2f}s")
    out = {"answers": args.answers, "processes": args.processes, "repeats": args.repeats, "cpus": os.cpu_count(),
           "inline_per_s": rates["inline"], "pooled_per_s": rates["pooled"],
           "ratio": rates["pooled"] / rates["inline"], "pool_start_s": startup_s, "correct": correct["inline"]}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
