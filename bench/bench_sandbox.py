"""Programs/s of the code sandbox (bwrap + rlimits, :mod:`ckpteval.jobs.eval.sandbox.core`) vs the same programs as
plain subprocesses, in the same run.

The programs are the example code set's reference solutions with their tests
(``examples/evalsets/code.jsonl``: assert-style rows run solution + asserts, stdin/stdout rows run the
solution once per case with that case's input), all passing. *Plain* runs each as ``python -I -S -c
PROGRAM`` with the same stdin, no isolation, no limits; *sandboxed* runs it through
:class:`ckpteval.jobs.eval.sandbox.core.Sandbox` (each program forked by its thread's warm runner into namespaces,
a /proc and a capped /tmp of its own, the rlimits launcher, the memory cgroup, the outside deadline). Rounds alternate plain / sandboxed; the ratio of the best rounds and of the
median rounds are printed. Both use a thread pool of the same size (``--concurrency``). The load average is printed
first: on a shared machine, numbers mean little when it is high.

    .venv/bin/python bench/bench_sandbox.py [--repeats 3] [--concurrency 2] [--json OUT] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckpteval.jobs.eval.sandbox.core import INTERPRETER_FLAGS, Limits, Sandbox, interpreter, probe_bwrap

CODE_SET = Path(__file__).resolve().parents[1] / "examples" / "evalsets" / "code.jsonl"


def programs() -> list[tuple[str, bytes]]:
    """(source, stdin) of every test program of the example code set's reference solutions."""
    jobs = []
    for line in CODE_SET.read_text().splitlines():
        row = json.loads(line)
        if "tests" in row:
            tests = row["tests"] if isinstance(row["tests"], list) else [row["tests"], f"check({row['entry_point']})"]
            jobs.append((row["solution"] + "\n" + "\n".join(tests) + "\n", b""))
        else:
            jobs.extend((row["solution"], i.encode()) for i in row["inputs"])
    return jobs


def plain(job: tuple[str, bytes]) -> int:
    return subprocess.run([interpreter()[0], *INTERPRETER_FLAGS, "-c", job[0]], input=job[1], capture_output=True,
                          timeout=60, check=False).returncode


def per_program(overhead_ms: float) -> str:
    """``"<n> ms more per program"`` (or less: the sandbox can beat a plain interpreter's start-up)."""
    return f"{abs(overhead_ms):.1f} ms {'more' if overhead_ms >= 0 else 'less'} per program"


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the programs for each mode (best kept)")
    parser.add_argument("--concurrency", type=int, default=2, help="programs at once, both modes")
    parser.add_argument("--smoke", action="store_true", help="one round over a third of the programs (seconds)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)

    print(f"load average {os.getloadavg()}, {os.cpu_count()} cpus")
    why = probe_bwrap()
    if why is not None:
        raise SystemExit(f"bench_sandbox: {why}")
    jobs = programs()
    if args.smoke:
        jobs, args.repeats = jobs[::3], 1
    box = Sandbox(Limits(wall_s=30.0, cpu_s=30), concurrency=args.concurrency)
    pool = ThreadPoolExecutor(args.concurrency)
    times: dict[str, list[float]] = {"plain": [], "sandboxed": []}
    try:
        for _ in range(args.repeats):
            for name in ("plain", "sandboxed"):
                start = time.perf_counter()
                if name == "plain":
                    codes = list(pool.map(plain, jobs))
                    ok = sum(c == 0 for c in codes)
                else:
                    ok = sum(o.status == "passed" for o in box.run_many(jobs))
                seconds = time.perf_counter() - start
                if ok != len(jobs):
                    raise RuntimeError(f"{name}: {len(jobs) - ok} of {len(jobs)} reference programs did not pass")
                times[name].append(seconds)
    finally:
        box.close()
        pool.shutdown()
    best = {name: min(t) for name, t in times.items()}
    rates = {name: len(jobs) / s for name, s in best.items()}
    for name in ("plain", "sandboxed"):
        print(f"{name:>9}: {len(jobs)} programs in {best[name]:.2f}s = {rates[name]:.1f} programs/s "
              f"(best of {args.repeats}, concurrency {args.concurrency})")
    ratio = rates["sandboxed"] / rates["plain"]
    overhead_ms = (best["sandboxed"] - best["plain"]) / len(jobs) * args.concurrency * 1000
    median_ratio = statistics.median(times["plain"]) / statistics.median(times["sandboxed"])
    print(f"  ratio: sandboxed / plain = {ratio:.2f}x (medians: {median_ratio:.2f}x); {per_program(overhead_ms)}")
    out = {"programs": len(jobs), "repeats": args.repeats, "concurrency": args.concurrency, "cpus": os.cpu_count(),
           "plain_per_s": rates["plain"], "sandboxed_per_s": rates["sandboxed"], "ratio": ratio, "median_ratio": median_ratio,
           "overhead_ms_per_program": overhead_ms, "load_at_start": os.getloadavg()}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
