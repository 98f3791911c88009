"""Coordination benchmarks: lease claim+result+release throughput, verification speed, idle-poll cost.

Prints, each against a baseline measured in the same run (the machine is shared and noisy):
1. 16 processes x 1,000 units on local disk: units/s and per-unit overhead (claim + result + release),
   median and p95; baseline: the same loop writing the result file only (no lease).
2. verify_snapshot fast and full on a ~1 GB snapshot (GB/s); baseline: a plain sequential read.
3. filesystem syscalls of an idle discovery poll over 1,000 snapshots (strace), vs the first poll.

Usage: python bench/bench_coord.py [--procs 16] [--units 1000] [--gb 1.0] [--dir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckpteval.coord.results.files import ResultIndex, ok_result, write_result  # noqa: E402
from ckpteval.coord.run.manifest import LeaseSettings  # noqa: E402
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery  # noqa: E402
from ckpteval.coord.snapshots.snapshot import publish_snapshot, verify_snapshot  # noqa: E402
from ckpteval.coord.work.claims import UnitClaimer, order_units  # noqa: E402
from ckpteval.coord.work.units import WorkUnit  # noqa: E402


def _worker(base: str, n_units: int, with_lease: bool, out: mp.Queue) -> None:
    leases, results = Path(base) / "leases", Path(base) / "results"
    claimer = UnitClaimer(leases, LeaseSettings(60.0, 20.0), results_dir=results)
    index = ResultIndex(results)
    lat: list[float] = []
    cpu: list[float] = []
    units = order_units([WorkUnit(i // 10, "ds", i % 10) for i in range(n_units)], spread=os.getpid())  # as workers do
    pending = units
    while pending:
        done = index.refresh()
        pending = [u for u in pending if u not in done]
        for unit in pending:
            t0 = time.perf_counter()
            c0 = time.process_time()
            if with_lease:
                claim = claimer.try_claim(unit)
                if claim is None:
                    continue
            write_result(results, ok_result(unit, [1.0], [str(unit.step)]))
            if with_lease:
                claim.release()
                claimer.forget(unit)
            lat.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    out.put((lat, cpu))


def bench_claims(procs: int, n_units: int, base: Path, with_lease: bool) -> tuple[float, list[float], int, dict]:
    """units/s, per-unit wall times, duplicates, and CPU: per-unit CPU times of the won units and all
    processes' CPU seconds (failed claims, listings and start-up included) per unit."""
    d = Path(tempfile.mkdtemp(dir=base))
    (d / "leases").mkdir()
    (d / "results").mkdir()
    ctx = mp.get_context("fork")
    q: mp.Queue = ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(str(d), n_units, with_lease, q)) for _ in range(procs)]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    for p in ps:
        p.start()
    got = [q.get() for _ in ps]
    lats = [x for lat, _ in got for x in lat]
    for p in ps:
        p.join()
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {"unit_cpu": [x for _, c in got for x in c],
           "total_cpu_per_unit": (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) / n_units}
    n_results = len(list((d / "results").glob("step-*/*.json")))  # per-step directories (protocol 2)
    dups = len(os.listdir(d / "results" / "duplicates")) if (d / "results" / "duplicates").exists() else 0
    shutil.rmtree(d)
    if n_results != n_units:
        raise RuntimeError(f"expected {n_units} results, got {n_results}")
    return n_units / wall, lats, dups, cpu


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def write_big_snapshot(root: Path, gb: float) -> Path:
    n_shards = 4
    numel = int(gb * 1e9 / 4 / n_shards)

    def write(d: Path) -> None:
        for i in range(n_shards):
            save_file({"w": torch.ones(numel)}, str(d / f"model-{i:05d}-of-{n_shards:05d}.safetensors"))

    return publish_snapshot(root, 1, write)


def read_all(path: Path) -> int:
    n = 0
    for f in sorted(path.iterdir()):
        with open(f, "rb") as fh:
            while chunk := fh.read(8 << 20):
                n += len(chunk)
    return n


def bench_verify(base: Path, gb: float) -> dict[str, float]:
    snap = write_big_snapshot(base / "verify", gb)
    total = sum(f.stat().st_size for f in snap.iterdir())
    out = {"bytes": total}
    read_all(snap)  # warm the page cache so all three read from memory alike
    for name, fn in (
        ("plain_read", lambda: read_all(snap)),
        ("fast", lambda: verify_snapshot(snap, "fast")),
        ("full", lambda: verify_snapshot(snap, "full")),
    ):
        t0 = time.perf_counter()
        fn()
        out[name] = time.perf_counter() - t0
    shutil.rmtree(base / "verify")
    return out


POLLER = """
import sys, os
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
d = SnapshotDiscovery(sys.argv[1])
n = len(d.poll())
os.write(1, b"IDLE-POLL-START\\n")
m = len(d.poll())
os.write(1, b"IDLE-POLL-END %d %d\\n" % (n, m))
"""

FS_CALLS = re.compile(r"^\d+\s+(\w+)\(")
FS_NAMES = {"openat", "open", "stat", "newfstatat", "statx", "lstat", "fstat", "getdents64", "access", "readlink",
            "close"}


def bench_idle_poll(base: Path, n: int) -> dict[str, int]:
    root = base / "poll"
    root.mkdir()
    for step in range(n):
        d = root / f"step-{step:010d}"
        d.mkdir()
        marker = {"step": step, "weight_version": str(step), "files": {}, "producer": {}, "mode": "staging",
                  "created": 0}
        (d / ".complete").write_text(json.dumps(marker))
    if shutil.which("strace") is None:
        raise RuntimeError("strace not found: apt-get install strace")
    trace = base / "trace.txt"
    subprocess.run(
        ["strace", "-f", "-o", str(trace), sys.executable, "-c", POLLER, str(root)],
        check=True, capture_output=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    counts = {"first": 0, "idle": 0}
    phase = "before"
    for line in trace.read_text().splitlines():
        if "IDLE-POLL-START" in line:
            phase = "idle"
            continue
        if "IDLE-POLL-END" in line:
            break
        m = FS_CALLS.match(line)
        if m and m.group(1) in FS_NAMES and phase == "idle":
            counts["idle"] += 1
    # the first poll, for comparison: count the same calls between import end and the marker
    first = SnapshotDiscovery(root)
    t0 = time.perf_counter()
    first.poll()
    counts["first_poll_ms"] = int((time.perf_counter() - t0) * 1000)
    t0 = time.perf_counter()
    first.poll()
    counts["idle_poll_us"] = int((time.perf_counter() - t0) * 1e6)
    shutil.rmtree(root)
    return counts


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=16)
    ap.add_argument("--units", type=int, default=1000)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--snapshots", type=int, default=1000)
    ap.add_argument("--dir", type=Path, default=None, help="where to run (default: a temp dir on local disk)")
    ap.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = ap.parse_args(argv)
    print("uptime:", os.popen("uptime").read().strip())
    base = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckpteval-bench-"))
    try:
        rate_plain, lat_plain, _, cpu_plain = bench_claims(args.procs, args.units, base, with_lease=False)
        rate, lat, dups, cpu = bench_claims(args.procs, args.units, base, with_lease=True)
        print(f"\n[claims] {args.procs} procs x {args.units} units, local disk")
        print(f"  lease+result+release: {rate:8.0f} units/s  per unit median {statistics.median(lat)*1e3:.2f} ms"
              f"  p95 {pct(lat, .95)*1e3:.2f} ms  duplicates {dups}")
        print(f"  result only (baseline): {rate_plain:6.0f} units/s  per unit median "
              f"{statistics.median(lat_plain)*1e3:.2f} ms  p95 {pct(lat_plain, .95)*1e3:.2f} ms")
        print(f"  ratio leased/baseline throughput: {rate / rate_plain:.2f}x")
        print(f"  CPU per won unit (process time, no queueing): median {statistics.median(cpu['unit_cpu'])*1e3:.2f} ms"
              f"  p95 {pct(cpu['unit_cpu'], .95)*1e3:.2f} ms; all processes' CPU / units "
              f"{cpu['total_cpu_per_unit']*1e3:.2f} ms (baseline {cpu_plain['total_cpu_per_unit']*1e3:.2f} ms)")
        rate1, lat1, _, cpu1 = bench_claims(1, args.units, base, with_lease=True)
        print(f"  1 process (no CPU queueing): {rate1:.0f} units/s  per unit median "
              f"{statistics.median(lat1)*1e3:.2f} ms  p95 {pct(lat1, .95)*1e3:.2f} ms "
              f"(with {args.procs} procs on {os.cpu_count()} cores, per-unit latency includes waiting for a CPU)")

        v = bench_verify(base, args.gb)
        gb = v["bytes"] / 1e9
        print(f"\n[verify] snapshot of {gb:.2f} GB (page cache warm)")
        print(f"  plain read (baseline): {gb / v['plain_read']:.2f} GB/s")
        print(f"  fast: {gb / v['fast']:.1f} GB/s-equivalent ({v['fast']*1e3:.2f} ms)  "
              f"full: {gb / v['full']:.2f} GB/s  ratio full/plain-read {v['plain_read'] / v['full']:.2f}x")

        p = bench_idle_poll(base, args.snapshots)
        print(f"\n[discovery] idle poll over {args.snapshots} snapshots: {p['idle']} filesystem syscalls "
              f"(strace; open/stat/getdents/close), {p['idle_poll_us']} us; first poll {p['first_poll_ms']} ms")
    finally:
        shutil.rmtree(base, ignore_errors=True)

    def lat_ms(xs: list[float], c: dict) -> dict[str, float]:
        return {"median_ms": statistics.median(xs) * 1e3, "p95_ms": pct(xs, .95) * 1e3,
                "cpu_median_ms": statistics.median(c["unit_cpu"]) * 1e3, "cpu_p95_ms": pct(c["unit_cpu"], .95) * 1e3,
                "total_cpu_per_unit_ms": c["total_cpu_per_unit"] * 1e3}

    out = {
        "procs": args.procs, "units": args.units, "cpus": os.cpu_count(), "dir": str(args.dir or tempfile.gettempdir()),
        "claims": {"units_per_s": rate, "duplicates": dups, **lat_ms(lat, cpu)},
        "result_only": {"units_per_s": rate_plain, **lat_ms(lat_plain, cpu_plain)},
        "claims_1proc": {"units_per_s": rate1, **lat_ms(lat1, cpu1)},
        "verify": {"gb": gb, "plain_read_gb_s": gb / v["plain_read"], "fast_ms": v["fast"] * 1e3,
                   "full_gb_s": gb / v["full"]},
        "idle_poll": {"snapshots": args.snapshots, "fs_syscalls": p["idle"], "idle_poll_us": p["idle_poll_us"],
                      "first_poll_ms": p["first_poll_ms"]},
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
