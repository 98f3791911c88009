"""Metadata operations and CPU per work unit (issue 20: the Lustre MDS budget).

On Lustre every path operation (open, stat, mkdir, link, unlink, rename, readlink, a directory read) is a
round trip to the metadata server, shared by every user of the filesystem. This benchmark counts them.

1. **backfill**: a real ``ckpteval backfill --engine fn:bench.bench_metadata:NullBackend`` (a backend that
   touches no file, so every count is the protocol's: discovery, claim, verification, result, release)
   under ``strace -f -y``, on two fresh runs of ``--steps`` snapshots whose dataset has a small and a large
   number of shards; the difference divided by the extra units is the *marginal* cost of one unit (start-up
   cancels out). Reported per unit by syscall — the metadata operations on the shared filesystem (the run
   dir, the snapshot root and the directories above them, which on Lustre are the mount's; ``/proc`` and
   the venv are not) by kind and by area
   (``results/``, ``leases/``, snapshots, the rest of the run dir), plus every syscall (``getpid``, thread
   starts, ...) and the process's CPU ms per unit (measured again without strace).
2. **protocol**: claim + result + release alone (:class:`ckpteval.coord.work.claims.UnitClaimer`, :func:`ckpteval.coord.results.files.
   write_result`, per-step directories as in a new run), one process, under strace; baseline: publishing the
   result alone (temp + fsync + link + dir fsync, the irreducible torn-write-safe, first-writer-wins
   publication), measured in the same run.

The worker polls (lists ``results/``, discovers snapshots) once per ``--poll-interval`` (default 2 s), not
once per unit, so listings are a cost per second of the fleet, not per unit; the backfills here use the default.

Usage: python bench/bench_metadata.py [--steps 4] [--small 16] [--large 112] [--units 300] [--no-cpu] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckpteval.jobs.eval.engines.fn import CheckpointEvalFn  # noqa: E402


class NullBackend(CheckpointEvalFn):
    """Scores every sample 0 without reading anything: the unit's file operations are the protocol's."""

    def evaluate_checkpoint(self, checkpoint_dir: str, input: dict[str, Any]) -> dict[str, Any]:  # noqa: A002
        return {"scores": [0.0] * len(input["rows"]) * input["dataset"]["n_samples"]}


# Syscalls that name a path or read a directory: on Lustre each is a metadata-server round trip.
META = {"open", "openat", "openat2", "creat", "stat", "lstat", "newfstatat", "statx", "access", "faccessat",
        "faccessat2", "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "link", "linkat", "rename", "renameat",
        "renameat2", "readlink", "readlinkat", "symlink", "symlinkat", "chmod", "fchmodat", "utimensat",
        "truncate", "getdents64", "fsync", "fdatasync"}
LINE = re.compile(r"^(\d+)\s+(?:<\.\.\. )?(\w+)(\(| resumed>)")
PATHS = re.compile(r'"([^"]*)"|<(/[^>]*)>')
FD_STAT = re.compile(r"newfstatat\(\d+<[^>]*>, \"\"")  # fstat by descriptor: the open file's cached attributes
AREAS = ("results", "leases", "snapshots")


def count_trace(trace: Path, shared: Path, run: Path) -> dict[str, Any]:
    """Per-syscall counts of an ``strace -f -y`` log: every call, and the metadata calls on ``shared`` by kind
    and by area of the run dir. A call split by another thread (``<unfinished ...>``) counts once."""
    every: collections.Counter[str] = collections.Counter()
    meta: collections.Counter[str] = collections.Counter()
    areas: collections.Counter[str] = collections.Counter()
    shared_s, run_s = str(shared), str(run)
    for line in trace.read_text(errors="replace").splitlines():
        m = LINE.match(line)
        if m is None or m.group(3) != "(":
            continue
        name = m.group(2)
        every[name] += 1
        if name not in META or FD_STAT.search(line):
            continue
        paths = [a or b for a, b in PATHS.findall(line.split(" = ", 1)[0])]
        path = next((p for p in paths if p.startswith(shared_s) or (p != "/" and shared_s.startswith(p + "/"))), None)
        if path is None:
            continue
        meta[name] += 1
        if not path.startswith(shared_s):  # a directory above the run: on Lustre, the mount's path to it
            areas["above the run"] += 1
            continue
        in_run = path == run_s or path.startswith(run_s + "/")
        rel = path[len(run_s) + 1:].split("/", 1)[0] if in_run else "snapshots"
        areas[rel if rel in AREAS else "run dir"] += 1
    return {"all": dict(every), "meta": dict(meta), "areas": dict(areas)}


def make_run(base: Path, steps: int, shards: int) -> Path:
    """A run of one addition set with ``shards`` one-prompt units per step, and ``steps`` tiny snapshots."""
    import numpy as np
    from safetensors.numpy import save_file

    from ckpteval.coord.run.identity import run_key
    from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest
    from ckpteval.coord.run.rundir import RunDir
    from ckpteval.coord.snapshots.snapshot import publish_snapshot
    from ckpteval.jobs.eval.kinds.generate.evalsets import write_addition_dataset

    run = RunDir.create(base / "run")
    spec = write_addition_dataset(run, n=shards, shard_size=1)
    manifest = RunManifest(run_id="bench-metadata", eval=EvalSpec(entries=(spec,)),
                           snapshot_roots=(str(base / "snapshots"),), lease=LeaseSettings(60.0, 20.0))
    RunDir.create(run.path, manifest)

    def write(d: Path) -> None:
        save_file({"w": np.ones(16, dtype=np.float32)}, str(d / "model.safetensors"))
        (d / "config.json").write_text("{}")

    for step in range(1, steps + 1):
        publish_snapshot(base / "snapshots", step * 10, write, run=run_key(manifest))  # as the trainer stamps it
    return run.path


def backfill(base: Path, steps: int, shards: int, traced: bool) -> dict[str, Any]:
    """One ``ckpteval backfill`` of a fresh run; its strace counts (``traced``) or its CPU seconds."""
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    run = make_run(base, steps, shards)
    cmd = [sys.executable, "-m", "ckpteval.jobs.cli", "backfill", "--run-dir", str(run),
           "--engine", "fn:bench.bench_metadata:NullBackend"]
    trace = base.parent / f"trace-{shards}.txt"
    if traced:
        cmd = ["strace", "-f", "-y", "-qq", "-o", str(trace), *cmd]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"backfill exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    n_results = sum(1 for p in (run / "results").rglob("*.json") if "duplicates" not in p.parts)
    if n_results != steps * shards:
        raise RuntimeError(f"backfill wrote {n_results} results, expected {steps * shards}")
    out: dict[str, Any] = {"units": steps * shards,
                           "cpu_s": ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime}
    if traced:
        out.update(count_trace(trace, base, run))
        trace.unlink()
    return out


def marginal(small: dict[str, Any], large: dict[str, Any], key: str) -> dict[str, float]:
    extra = large["units"] - small["units"]
    names = set(small.get(key, {})) | set(large.get(key, {}))
    per = {n: (large.get(key, {}).get(n, 0) - small.get(key, {}).get(n, 0)) / extra for n in names}
    return dict(sorted(((n, v) for n, v in per.items() if abs(v) >= 0.005), key=lambda kv: -kv[1]))


PROTOCOL = """
import os, sys, time
from pathlib import Path
from ckpteval.coord.run.manifest import LeaseSettings
from ckpteval.coord.results.files import ok_result, write_result
from ckpteval.coord.work.claims import UnitClaimer
from ckpteval.coord.work.units import WorkUnit
base, n, leased = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
(base / "leases").mkdir(parents=True)
(base / "results").mkdir()
claimer = UnitClaimer(base / "leases", LeaseSettings(60.0, 20.0), results_dir=base / "results")
def one(unit):
    claim = claimer.try_claim(unit) if leased else None
    write_result(base / "results", ok_result(unit, [1.0], [str(unit.step)]), 0 if claim is None else claim.generation)
    if claim is not None:
        claim.release()
        claimer.forget(unit)
one(WorkUnit(10**9, "warm", 0))  # imports, first-use caches
os.write(1, b"PROTOCOL-START\\n")
c0 = time.process_time()
for i in range(n):
    one(WorkUnit(i // 32, "ds", i % 32))
cpu = time.process_time() - c0
os.write(1, b"PROTOCOL-END %f\\n" % cpu)
"""


def protocol(base: Path, n: int, leased: bool) -> dict[str, Any]:
    """claim + result + release (``leased``) or the result alone, ``n`` units in one process: per unit
    metadata calls (strace, between the markers) and CPU ms (a second, untraced run)."""
    out: dict[str, Any] = {}
    for traced in (True, False):
        d = base / f"protocol-{int(leased)}-{int(traced)}"
        trace = base / "protocol-trace.txt"
        cmd = [sys.executable, "-c", PROTOCOL, str(d), str(n), "1" if leased else "0"]
        if traced:
            cmd = ["strace", "-f", "-y", "-qq", "-o", str(trace), *cmd]
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                              text=True, timeout=600, check=True)
        if traced:
            lines = trace.read_text(errors="replace").split("PROTOCOL-START", 1)[1].split("PROTOCOL-END", 1)[0]
            trace.write_text(lines.split("\n", 1)[1] if "\n" in lines else "")
            counts = count_trace(trace, d, d)
            out["meta"] = {k: v / n for k, v in sorted(counts["meta"].items(), key=lambda kv: -kv[1])}
            out["areas"] = {k: v / n for k, v in counts["areas"].items()}
            out["all"] = {k: v / n for k, v in sorted(counts["all"].items(), key=lambda kv: -kv[1])}
            trace.unlink()
        else:
            out["cpu_ms"] = float(proc.stdout.split("PROTOCOL-END", 1)[1].split()[0]) / n * 1e3
        shutil.rmtree(d, ignore_errors=True)
    out["meta_total"] = sum(out["meta"].values())
    return out


def fmt(counts: dict[str, float], limit: int = 14) -> str:
    return ", ".join(f"{k} {v:.1f}" for k, v in list(counts.items())[:limit]) or "none"


THREADS = ("clone", "clone3")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="snapshots per run")
    ap.add_argument("--small", type=int, default=16, help="units per step of the small run")
    ap.add_argument("--large", type=int, default=112, help="units per step of the large run")
    ap.add_argument("--units", type=int, default=300, help="units of the protocol-only loop")
    ap.add_argument("--no-cpu", action="store_true", help="skip the untraced backfills that measure CPU (smoke)")
    ap.add_argument("--dir", type=Path, default=None, help="where to run (default: a temp dir on local disk)")
    ap.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = ap.parse_args(argv)
    if args.large <= args.small:
        ap.error("--large must be above --small")
    if shutil.which("strace") is None:
        raise SystemExit("bench_metadata.py: strace not found (make bench installs it: apt-get install strace)")
    print("uptime:", os.popen("uptime").read().strip())
    base = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckpteval-bench-meta-"))
    t0 = time.perf_counter()
    try:
        runs = {size: backfill(base / f"b{size}", args.steps, size, traced=True) for size in (args.small, args.large)}
        cpu = {} if args.no_cpu else {size: backfill(base / f"c{size}", args.steps, size, traced=False)
                                      for size in (args.small, args.large)}
        small, large = runs[args.small], runs[args.large]
        per = {"meta": marginal(small, large, "meta"), "areas": marginal(small, large, "areas"),
               "all": marginal(small, large, "all")}
        cpu_ms = None if not cpu else (
            (cpu[args.large]["cpu_s"] - cpu[args.small]["cpu_s"]) / (large["units"] - small["units"]) * 1e3)
        leased, plain = protocol(base, args.units, True), protocol(base, args.units, False)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    meta_total = sum(per["meta"].values())
    threads = sum(per["all"].get(n, 0.0) for n in THREADS)
    print(f"\n[backfill] ckpteval backfill --engine fn (NullBackend), {args.steps} steps, {small['units']} vs "
          f"{large['units']} units: marginal cost of one unit ({large['units'] - small['units']} extra units)")
    print(f"  metadata ops on the shared filesystem per unit: {meta_total:.1f}  ({fmt(per['meta'])})")
    print(f"  by area: {fmt(per['areas'])}")
    print(f"  all syscalls per unit: {sum(per['all'].values()):.0f}  ({fmt(per['all'], 18)})")
    print(f"  thread starts per unit: {threads:.2f}; getpid per unit: {per['all'].get('getpid', 0.0):.1f}")
    print(f"  CPU per unit (no strace): {'not measured' if cpu_ms is None else f'{cpu_ms:.2f} ms'}")
    print(f"\n[protocol] claim + result + release, 1 process, {args.units} units (strace)")
    print(f"  metadata ops per unit: {leased['meta_total']:.1f}  ({fmt(leased['meta'])})")
    print(f"  baseline, result only: {plain['meta_total']:.1f}  ({fmt(plain['meta'])})")
    print(f"  ratio leased/result-only metadata ops: {leased['meta_total'] / plain['meta_total']:.2f}x")
    print(f"  CPU per unit: {leased['cpu_ms']:.2f} ms (result only {plain['cpu_ms']:.2f} ms, ratio "
          f"{leased['cpu_ms'] / plain['cpu_ms']:.2f}x); goal <= 10 metadata ops and <= 1 ms CPU")
    print(f"  ({time.perf_counter() - t0:.0f} s)")
    out = {"steps": args.steps, "units_small": small["units"], "units_large": large["units"],
           "backfill": {"meta_per_unit": meta_total, "meta": per["meta"], "areas": per["areas"], "all": per["all"],
                        "threads_per_unit": threads, "cpu_ms_per_unit": cpu_ms},
           "protocol": {"units": args.units, "leased": leased, "result_only": plain}}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
