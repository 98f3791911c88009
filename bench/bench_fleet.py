"""Benchmark: a fleet of hundreds of real worker processes on one run (issue 20, "Many workers").

A run of ``--points`` published snapshots × ``--datasets`` sets × ``--shards`` shards of one prompt (the
snapshots hold one small file: nothing loads them), evaluated by ``--workers`` real ``ckpteval
worker --once --engine fn:bench.bench_fleet:SleepBackend`` processes, whose backend sleeps ``--sleep``
seconds per unit and scores every sample 1 — so the CPU is not what limits them, the protocol is. Bounded:
workers still running after ``--bound`` seconds are sent SIGTERM (the run is then reported incomplete).
Baseline, in the same run: one worker on a fresh copy of the run, stopped after ``--baseline-units``
results (``--max-units``); its time per unit × units per point is its time per point.

Reported:

* **evaluated twice**: units with more than one evaluation — a second claim recorded in
  ``leases/<unit>.attempts`` that went on to evaluate (a result plus a ``results/duplicates/`` copy). Each is
  told apart: *lease expiry* when the second evaluation started at least a lease duration after the
  first one's last heartbeat could have been seen (start times from the results' ``written_at`` −
  ``timings.total_s``), else *not explained by expiry* (a protocol bug). Goal: 0 except by expiry.
* **claim contention**: every claim attempt (``UnitClaimer._attempt``) of every worker is counted (the worker is started
  through :func:`claim_counting_worker`, which wraps the real method and writes the counts when the
  worker exits): *lost* = the unit was open at the call but another worker held its lease or published
  its result first (each cost at least one metadata operation); per unit = lost / units. *skipped* = the
  claimer had seen the unit held within its ``recheck_s`` and refused it without a syscall; *listings* =
  walks that listed a step's lease (or result) directory after a lost attempt there, to pass over the
  units listed without trying each (``UnitClaimer.claim_next``).
* **given back**: units a worker claimed and released without a result, by the reason its unit line
  gives (``abandoned: stop signal`` — the bound's SIGTERM —, ``abandoned: lease lost``, ``released after
  attempt``), and the CPU time of all workers per unit written.
* **wall time per point**: the fleet's (last exit − launch) / points done, and its steady part (first result →
  last result) / points done, against the 1-worker baseline's time per point.
* **memory**: one worker's RSS after start-up, the fleet's summed RSS at its peak and the lowest
  ``MemAvailable`` while it ran. Before starting, the fleet is capped at what fits in ``--mem-fraction``
  of ``MemAvailable`` at one worker's RSS (the cap is printed: "256 requested, N fit").

Usage: ``.venv/bin/python bench/bench_fleet.py [--workers 256] [--points 50] [--datasets 2] [--shards 32]
[--sleep 2] [--bound 180] [--root /tmp] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckpteval.jobs.eval.engines.fn import CheckpointEvalFn  # noqa: E402

BACKEND = "fn:bench.bench_fleet:SleepBackend"
DROPPED = re.compile(r"\] (abandoned: [^,(]+|released after attempt \d+: \w+)")  # ckpteval.jobs.eval.worker.loop's unit lines


class SleepBackend(CheckpointEvalFn):
    """An fn backend that sleeps ``sleep_s`` (run.json ``eval.engine.fn``) per unit and scores every sample 1."""

    def __init__(self, sleep_s: float = 1.0) -> None:
        self.sleep_s = float(sleep_s)

    def evaluate_checkpoint(self, checkpoint_dir: str, input: dict[str, Any]) -> dict[str, Any]:
        time.sleep(self.sleep_s)
        n = len(input["rows"]) * int(input["dataset"]["n_samples"])
        return {"scores": [1.0] * n}

    def dispose(self) -> None:
        pass


def claim_counting_worker(counts_path: str, argv: list[str]) -> int:
    """``ckpteval worker ARGV`` with every ``try_claim`` counted (module docstring); the counts go to
    ``counts_path`` as JSON when the worker returns."""
    from ckpteval.coord.work.claims import UnitClaimer
    from ckpteval.jobs.cli import main

    counts: Counter[str] = Counter()
    real, real_listed = UnitClaimer._attempt, UnitClaimer._listed

    def counted(self: UnitClaimer, unit: Any, generation: int = 0) -> Any:
        if self._has_result(unit, generation):
            counts["done"] += 1  # finished before the call: not contention
            return "done"
        if self.seen_held_lately(unit):
            counts["skipped"] += 1  # seen held within recheck_s: refused without a syscall
            return "held"
        outcome = real(self, unit, generation)
        counts["lost" if isinstance(outcome, str) else "won"] += 1
        return outcome

    def listed(root: Path, step: int, suffix: str) -> Any:
        counts["listings"] += 1  # a walk listed a step's lease or result directory after a lost attempt
        return real_listed(root, step, suffix)

    UnitClaimer._attempt = counted  # type: ignore[method-assign]
    UnitClaimer._listed = staticmethod(listed)  # type: ignore[method-assign]
    try:
        return main(["worker", *argv])
    finally:
        Path(counts_path).write_text(json.dumps(counts))


# -- the run ------------------------------------------------------------------------------------------------
def make_run(path: Path, points: int, datasets: int, shards: int, sleep_s: float, lease_s: float) -> Any:
    from bench.bench_scale import write_weights
    from ckpteval.coord.entries.generate import GenerateEntry
    from ckpteval.coord.run.identity import run_key
    from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest
    from ckpteval.coord.run.rundir import RunDir
    from ckpteval.coord.snapshots.snapshot import publish_snapshot
    from ckpteval.jobs.eval.kinds.generate.evalsets import write_jsonl

    run = RunDir.create(path)
    specs = []
    for i in range(datasets):  # one prompt per shard (the backend never reads them)
        write_jsonl(run.data / f"set{i}.jsonl", [{"prompt": f"{j}+{i}=", "answer": str(i + j)} for j in range(shards)])
        specs.append(GenerateEntry(name=f"set{i}", path=f"data/set{i}.jsonl", n_prompts=shards, shard_size=1))
    manifest = RunManifest(run_id=f"fleet-{path.name}", eval=EvalSpec(entries=tuple(specs), engine={"fn": {"sleep_s": sleep_s}}),
                           snapshot_roots=(str(run.snapshots),), lease=LeaseSettings(lease_s, lease_s / 6))
    run = RunDir.create(path, manifest)
    for i in range(points):
        publish_snapshot(run.snapshots, (i + 1) * 100, write_weights, run=run_key(manifest))  # as the trainer stamps it
    return run


def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def mem_available_kb() -> int:
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    return int(line.split()[1])


def launch(run: Any, n: int, poll_s: float, counts_dir: Path, extra: list[str]) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = []
    for i in range(n):
        code = (f"import sys; from bench.bench_fleet import claim_counting_worker; "
                f"sys.exit(claim_counting_worker({str(counts_dir / f'w{i}.json')!r}, sys.argv[1:]))")
        argv = ["--run-dir", str(run.path), "--engine", BACKEND, "--once", "--poll-interval", str(poll_s),
                "--worker-id", f"w{i}", *extra]
        with open(counts_dir / f"w{i}.out", "wb") as out:  # the worker's unit lines (abandoned, released)
            procs.append(subprocess.Popen([sys.executable, "-c", code, *argv], env=env, cwd=ROOT, stdout=out,
                                          stderr=subprocess.PIPE))
    return procs


def supervise(procs: list[subprocess.Popen], bound_s: float, t0: float) -> dict[str, Any]:
    """Wait for the workers (SIGTERM after ``bound_s``), sampling their summed RSS and MemAvailable."""
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak_rss, peak_one, min_avail, killed = 0, 0, mem_available_kb(), False
    while any(p.poll() is None for p in procs):
        rss = [rss_kb(p.pid) for p in procs if p.poll() is None]
        peak_rss, peak_one = max(peak_rss, sum(rss)), max([peak_one, *rss])
        min_avail = min(min_avail, mem_available_kb())
        if not killed and time.time() - t0 > bound_s:
            killed = True
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        time.sleep(0.2)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    errors = [p.stderr.read().decode(errors="replace")[-500:] for p in procs if p.returncode not in (0,) and p.stderr]
    for p in procs:
        if p.stderr:
            p.stderr.close()
    return {"wall_s": time.time() - t0, "peak_rss_mb": peak_rss / 1024, "peak_worker_rss_mb": peak_one / 1024,
            "cpu_s": ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime,
            "min_mem_available_mb": min_avail / 1024, "bounded": killed, "exit_codes": dict(Counter(p.returncode for p in procs)), "errors": errors[:3]}


def twice(run: Any) -> dict[str, Any]:
    """Units evaluated more than once, by cause (module docstring)."""
    from ckpteval.coord.atomic import read_json_object
    from ckpteval.coord.results.files import ResultIndex, parse_result

    results = ResultIndex(run.results).refresh()
    dup_dir = run.results / "duplicates"
    dups = [parse_result(read_json_object(p), p) for p in sorted(dup_dir.glob("*.json"))] if dup_dir.is_dir() else []
    duration = run.manifest().lease.duration_s
    expiry, unexplained = [], []
    for dup in dups:
        first = results[dup.unit]
        a, b = sorted([first, dup], key=lambda r: r.written_at - r.timings.get("total_s", 0.0))
        gap = (b.written_at - b.timings.get("total_s", 0.0)) - (a.written_at - a.timings.get("total_s", 0.0))
        (expiry if gap >= duration - run.manifest().lease.heartbeat_s else unexplained).append(
            {"unit": dup.unit.id, "start_gap_s": round(gap, 2), "workers": [a.worker.get("worker_id"),
                                                                            b.worker.get("worker_id")]})
    attempts = Counter()
    for p in run.leases.rglob("*.attempts"):  # per-step dirs (protocol 2)
        attempts[p.read_bytes().count(b"\n")] += 1
    return {"results": len(results), "duplicates": len(dups), "by_lease_expiry": expiry,
            "not_explained_by_expiry": unexplained, "claims_per_unit": dict(sorted(attempts.items()))}


def fleet(run: Any, n: int, args: argparse.Namespace, tmp: Path, extra: list[str] | None = None) -> dict[str, Any]:
    from ckpteval.coord.results.files import ResultIndex

    counts_dir = tmp / f"counts-{n}-{len(extra or [])}"
    counts_dir.mkdir()
    t0 = time.time()
    procs = launch(run, n, args.poll, counts_dir, extra or [])
    ran = supervise(procs, args.bound, t0)
    results = list(ResultIndex(run.results).refresh().values())
    if not results:
        raise RuntimeError(f"{n} workers wrote no result: {ran['errors']}")
    counts: Counter[str] = Counter()
    for p in counts_dir.glob("*.json"):
        counts.update(json.loads(p.read_text()))
    dropped: Counter[str] = Counter()  # units a worker claimed and gave back without a result, by reason
    for p in counts_dir.glob("*.out"):
        for line in p.read_text(errors="replace").splitlines():
            if m := DROPPED.search(line):
                dropped[m.group(1).strip()] += 1
    starts = [r.written_at - r.timings.get("total_s", 0.0) for r in results]
    ends = [r.written_at for r in results]
    ok = sum(r.ok for r in results)
    return {**ran, "workers": n, "units_done": len(results), "units_ok": ok,
            "first_start_s": min(starts) - t0, "steady_s": max(ends) - min(starts),
            "claims": dict(counts), "counted_workers": len(list(counts_dir.glob("*.json"))),
            "dropped": dict(dropped), "cpu_s_per_unit": ran["cpu_s"] / len(results),
            "lost_claims_per_unit": counts["lost"] / len(results), **twice(run)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=256)
    ap.add_argument("--points", type=int, default=50)
    ap.add_argument("--datasets", type=int, default=2)
    ap.add_argument("--shards", type=int, default=32, help="shards per dataset (one prompt each)")
    ap.add_argument("--sleep", type=float, default=2.0, help="seconds the backend sleeps per unit")
    ap.add_argument("--poll", type=float, default=1.0, help="the workers' --poll-interval")
    ap.add_argument("--lease", type=float, default=60.0, help="lease duration (heartbeat: a sixth of it)")
    ap.add_argument("--bound", type=float, default=180.0, help="SIGTERM the fleet after this many seconds")
    ap.add_argument("--baseline-units", type=int, default=8, help="results the 1-worker baseline writes")
    ap.add_argument("--mem-fraction", type=float, default=0.6, help="of MemAvailable the fleet may take")
    ap.add_argument("--root", type=Path, default=None, help="where the run dirs go (default: the temp dir)")
    ap.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()
    print(f"uptime: {os.popen('uptime').read().strip()}; cpus={os.cpu_count()}", flush=True)
    units_per_point = args.datasets * args.shards
    with tempfile.TemporaryDirectory(dir=args.root, prefix="bench-fleet-") as name:
        tmp = Path(name)
        base_run = make_run(tmp / "baseline", 1, args.datasets, args.shards, args.sleep, args.lease)
        base = fleet(base_run, 1, args, tmp, ["--max-units", str(args.baseline_units)])
        base_unit_s = base["steady_s"] / base["units_done"]
        print(f"baseline 1 worker: {base['units_done']} units in {base['steady_s']:.1f} s steady -> "
              f"{base_unit_s * units_per_point:.1f} s per point of {units_per_point} units", flush=True)
        rss = base["peak_worker_rss_mb"]
        fits = int(mem_available_kb() / 1024 * args.mem_fraction / max(rss, 1.0))
        n = min(args.workers, fits)
        print(f"one worker: {rss:.0f} MB RSS (the baseline's peak); {args.workers} requested, {fits} fit in "
              f"{args.mem_fraction:.0%} of MemAvailable: running {n}", flush=True)
        run = make_run(tmp / "fleet", args.points, args.datasets, args.shards, args.sleep, args.lease)
        big = fleet(run, n, args, tmp)
        shutil.rmtree(tmp / "fleet", ignore_errors=True)
    units = args.points * units_per_point
    points_done = big["units_done"] / units_per_point  # fewer than --points when the bound stopped the fleet
    per_point = {"fleet_e2e_s": big["wall_s"] / points_done, "fleet_steady_s": big["steady_s"] / points_done,
                 "one_worker_s": base_unit_s * units_per_point, "ideal_s": args.sleep * units_per_point / n}
    print(f"\n{n} workers, {args.points} points x {units_per_point} units ({units} units), backend sleep "
          f"{args.sleep:g} s, poll {args.poll:g} s, lease {args.lease:g} s")
    print(f"  units done {big['units_done']}/{units} (ok {big['units_ok']}), exit codes {big['exit_codes']}"
          f"{', BOUNDED: SIGTERM at ' + format(args.bound, 'g') + ' s' if big['bounded'] else ''}")
    print(f"  evaluated twice: {big['duplicates']} (by lease expiry {len(big['by_lease_expiry'])}, not explained "
          f"by expiry {len(big['not_explained_by_expiry'])}); claims per unit {big['claims_per_unit']}")
    print(f"  claim attempts: {big['claims']} -> lost per unit {big['lost_claims_per_unit']:.2f} "
          f"({big['counted_workers']} workers counted)")
    print(f"  claimed and given back without a result: {big['dropped'] or 'none'}; CPU of all workers per unit "
          f"{big['cpu_s_per_unit'] * 1e3:.0f} ms (1 worker: {base['cpu_s_per_unit'] * 1e3:.0f} ms)")
    print(f"  wall per point: fleet {per_point['fleet_e2e_s']:.2f} s e2e, {per_point['fleet_steady_s']:.2f} s "
          f"steady; 1 worker {per_point['one_worker_s']:.1f} s; ratio (1 worker / fleet e2e) "
          f"{per_point['one_worker_s'] / per_point['fleet_e2e_s']:.1f}x (ideal {n}x: {per_point['ideal_s']:.2f} s)")
    print(f"  memory: {rss:.0f} MB per worker, fleet peak {big['peak_rss_mb']:.0f} MB RSS, lowest MemAvailable "
          f"{big['min_mem_available_mb']:.0f} MB; first result started {big['first_start_s']:.1f} s after launch")
    out = {"cpus": os.cpu_count(), "requested_workers": args.workers, "workers": n, "fit": fits,
           "worker_rss_mb": rss, "points": args.points, "units_per_point": units_per_point, "sleep_s": args.sleep,
           "poll_s": args.poll, "lease_s": args.lease, "bound_s": args.bound, "load_at_start": load0,
           "load_at_end": os.getloadavg(), "baseline": base, "fleet": big, "per_point": per_point}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
