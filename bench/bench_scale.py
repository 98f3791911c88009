"""Benchmark: the readers of a production-sized run dir (issue 20) — ingestion, status, plot, idle polls.

Builds a synthetic run of ``--points`` points (steps 100, 200, ...: a 100k-step run evaluated every 100 steps
at the default 1,000) × ``--datasets`` eval sets × ``--shards`` shards, no model: every unit's result is
written by the project's own writer (:func:`ckpteval.coord.results.files.write_result`, in ``--procs`` processes), and every
point but the last ``--pending`` is dispatched and ingested through the trainer's own path (ledger
``dispatched``, :func:`ckpteval.jobs.ingest.ingest_point` → ``metrics.jsonl`` + ledger ``ingested``, ``retired``). The
last ``--pending`` points are dispatched (snapshot published) and complete but not yet ingested: what a
restarted trainer finds. Then, on it and on a baseline run of ``--baseline-points`` points of the same shape
built the same way, in the same run:

1. the trainer's ingestion poll (:meth:`ckpteval.jobs.trainer.dispatcher.EvalDispatcher.poll`): *resume* (a fresh
   dispatcher: ledger replay, first read of every result, the pending points ingested); *steady* (one more
   point's results landed since the previous poll; it is ingested); *idle* (nothing pending); *waiting*
   (one point pending, its results not there yet);
2. a worker's idle poll (:meth:`ckpteval.jobs.eval.worker.loop.Worker.poll`: discovery + results, every unit done);
3. ``ckpteval status RUN`` (tables, to a file) and ``ckpteval plot RUN -o curve.png`` as a user runs them
   (fresh processes, interpreter start-up included) — goal < 2 s each, as for the steady ingestion poll —
   reading the step summaries ingestion wrote (:mod:`ckpteval.coord.results.summary`); then again with every summary
   hidden (``status_full_s``, ``plot_full_s``: every result file read, the path before summaries), and the
   printouts and PNGs of the two must be the same (the benchmark fails otherwise);
4. the syscalls of one idle poll — trainer idle (nothing pending), trainer waiting (one point pending, no
   results yet), worker idle — each in a probe process that polls once to warm up, once timed, then once
   under ``strace -c -f`` attached to it: O(1) means the same count at both sizes.

Building the run reads every result once (ingestion reads each step's results, as the trainer does), and
``status_full_s``/``plot_full_s`` read them all again: at 1,000 points those dominate this benchmark's run time
(``make bench`` runs it at full size).

Usage: ``.venv/bin/python bench/bench_scale.py [--points 1000] [--datasets 20] [--shards 32]
[--baseline-points 10] [--pending 2] [--procs 2] [--root /dev/shm] [--json OUT]`` (``--root``: where the run
dirs go; tmpfs by default — on ext4 each of the 640k results pays an fsync, see ``--help``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckpteval.coord.entries.generate import GenerateEntry  # noqa: E402
from ckpteval.coord.results.files import Result, ResultIndex, ok_result, write_result  # noqa: E402
from ckpteval.coord.run.identity import run_key  # noqa: E402
from ckpteval.coord.run.ledger import Ledger  # noqa: E402
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest  # noqa: E402
from ckpteval.coord.run.rundir import STEP_SUMMARY, RunDir  # noqa: E402
from ckpteval.coord.snapshots.snapshot import publish_snapshot  # noqa: E402
from ckpteval.coord.work.units import units_for_step  # noqa: E402
from ckpteval.jobs.ingest import ingest_point  # noqa: E402
from ckpteval.jobs.metrics import MetricsSink  # noqa: E402

INTERVAL = 100  # steps between points
SHARD_SIZE = 4  # prompts per unit (one sample each): results stay small, like a short eval set's
GOAL_S = 2.0
# what is timed (seconds), in the order printed; GOALS: the ones with the < GOAL_S goal
OPERATIONS = ("resume_s", "steady_s", "waiting_s", "idle_s", "worker_idle_probe_s", "trainer_waiting_probe_s",
              "status_s", "plot_s", "status_full_s", "plot_full_s")
GOALS = ("steady_s", "status_s", "plot_s")


# -- the synthetic run ------------------------------------------------------------------------------------
def make_manifest(path: Path, datasets: int, shards: int) -> RunDir:
    specs = tuple(GenerateEntry(name=f"set{i:02d}", path=f"data/set{i:02d}.jsonl", n_prompts=shards * SHARD_SIZE,
                              shard_size=SHARD_SIZE) for i in range(datasets))
    run = RunDir.create(path)
    manifest = RunManifest(run_id=f"scale-{path.name}", eval=EvalSpec(entries=specs),
                           snapshot_roots=(str(run.snapshots),), lease=LeaseSettings(60.0, 10.0),
                           trainer={"eval_interval": INTERVAL})
    return RunDir.create(path, manifest)


def point_results(manifest: RunManifest, step: int) -> dict[Any, Result]:
    """Every unit's result of ``step``: deterministic scores (so a re-creation equals what was written)."""
    out = {}
    for unit in units_for_step(manifest, step):
        rng = random.Random(f"{step}:{unit.id}")
        scores = [float(rng.random() < 0.5 + step / (4 * INTERVAL * 1000)) for _ in range(SHARD_SIZE)]
        out[unit] = ok_result(unit, scores, [str(step)] * SHARD_SIZE, [str(int(s)) for s in scores],
                              timings={"total_s": 1.0}, worker={"host": "bench", "pid": 1, "worker_id": "w0"},
                              written_at=1.0e9 + step)
    return out


def write_point(run: RunDir, manifest: RunManifest, step: int) -> None:
    """Publish every result of ``step`` with the project's writer (``results/step-<N>/``)."""
    for result in point_results(manifest, step).values():
        write_result(run.results, result)


def _write_steps(run_path: str, steps: list[int]) -> None:
    run = RunDir.open(Path(run_path))
    manifest = run.manifest()
    for step in steps:
        write_point(run, manifest, step)


def write_results(run: RunDir, steps: list[int], procs: int) -> float:
    """Write every result of ``steps`` (``procs`` processes, steps dealt round-robin); returns seconds."""
    t0 = time.perf_counter()
    if procs <= 1:
        _write_steps(str(run.path), steps)
    else:
        ctx = mp.get_context("fork")
        ps = [ctx.Process(target=_write_steps, args=(str(run.path), steps[i::procs])) for i in range(procs)]
        for p in ps:
            p.start()
        for p in ps:
            p.join()
        if any(p.exitcode for p in ps):
            raise RuntimeError(f"result writers exited with {[p.exitcode for p in ps]}")
    return time.perf_counter() - t0


def write_weights(directory: Path) -> None:
    """A snapshot's one file (nothing loads it: only its marker and size are checked)."""
    (directory / "weights.bin").write_bytes(b"\0" * 64)


def publish(run: RunDir, step: int) -> None:
    publish_snapshot(run.snapshots, step, write_weights, run=run_key(run.manifest()))  # as the trainer stamps it


def build_run(path: Path, points: int, datasets: int, shards: int, pending: int, procs: int) -> dict[str, Any]:
    """The synthetic run (module docstring); returns what building it took."""
    run = make_manifest(path, datasets, shards)
    manifest = run.manifest()
    steps = [INTERVAL * (i + 1) for i in range(points)]
    write_s = write_results(run, steps, procs)
    ledger, sink = Ledger(run.ledger_path), MetricsSink(run.metrics_path)
    t0 = time.perf_counter()
    for step in steps:
        ledger.append("dispatched", step, mode="staging")
    index = ResultIndex(run.results)  # the trainer's reads: ingestion writes each step's summary from them
    for step in steps[:-pending] if pending else steps:
        index.refresh(only_steps={step})
        ingest_point(manifest, step, index.for_step(step), sink=sink, ledger=ledger, lag_steps=INTERVAL, index=index)
        ledger.append("retired", step)
    for step in steps[-pending:] if pending else []:
        publish(run, step)
    files = points * datasets * shards
    return {"points": points, "units": files, "write_s": write_s, "files_per_s": files / write_s,
            "ingest_build_s": time.perf_counter() - t0, "last_step": steps[-1]}


# -- the measured operations ------------------------------------------------------------------------------
def dispatcher(run: RunDir) -> Any:
    from ckpteval.jobs.trainer.config import DispatchConfig
    from ckpteval.jobs.trainer.dispatcher import EvalDispatcher

    config = DispatchConfig(eval_interval=INTERVAL, staging_dir=run.snapshots, max_in_flight=1_000_000,
                            keep_snapshots=1_000_000)
    return EvalDispatcher.open(config.with_waits(poll_interval_s=0.0), run, MetricsSink(run.metrics_path), None)


def worker(run: RunDir) -> Any:
    from ckpteval.jobs.eval.worker.loop import Worker
    from ckpteval.jobs.eval.worker.options import WorkerOptions

    return Worker(run, WorkerOptions(run_dir=run.path), evaluator=None)  # type: ignore[arg-type]  # poll only


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def trainer_polls(run: RunDir, last_step: int) -> dict[str, float]:
    """Seconds of the trainer's polls (module docstring, 1.)."""
    manifest = run.manifest()
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    d = dispatcher(run)
    d.step = last_step
    d.poll(force=True)
    out["resume_s"] = time.perf_counter() - t0
    if d.pending:
        raise RuntimeError(f"points still pending after the resume poll: {d.pending}")
    out["idle_s"] = timed(lambda: d.poll(force=True))
    step = last_step + INTERVAL  # one more point: dispatched (its snapshot published), results not there yet
    d.ledger.append("dispatched", step, mode="staging")
    publish(run, step)
    d.step = step
    out["waiting_s"] = timed(lambda: d.poll(force=True))
    write_point(run, manifest, step)
    out["steady_s"] = timed(lambda: d.poll(force=True))
    if d.pending:
        raise RuntimeError(f"point {step} not ingested by the steady poll")
    return out


def cli_seconds(run: RunDir, *args: str, out: Path | None = None) -> float:
    """Seconds of ``ckpteval ARGS`` in a fresh process, its stdout to ``out`` (a file: no colour, as piped)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    t0 = time.perf_counter()
    with open(out or os.devnull, "w") as sink:
        subprocess.run([sys.executable, "-m", "ckpteval.jobs.cli", *args], check=True, cwd=ROOT, env=env, stdout=sink)
    return time.perf_counter() - t0


def _steady_lines(path: Path) -> list[str]:
    """Status's printout without the two parts that move between runs: training's wall time, free space."""
    return [line for line in path.read_text().splitlines() if "training wall" not in line and "GB free" not in line]


def readers(run: RunDir, tmp: Path, points: int, plot: bool) -> dict[str, float]:
    """``status`` and ``plot`` as a user runs them: with the step summaries ingestion wrote (``status_s``,
    ``plot_s``), then with every summary hidden (``status_full_s``, ``plot_full_s``: every result file read,
    the path without summaries, in the same run) — and the two printouts and pictures must be the same."""
    out: dict[str, float] = {}
    runs = {"": ("summary", True), "_full": ("full", False)}
    for suffix, (label, with_summaries) in runs.items():
        hidden = [] if with_summaries else [p.rename(p.with_name(f".{p.name}"))
                                            for p in run.results.glob(f"step-*/{STEP_SUMMARY}")]
        out[f"status{suffix}_s"] = cli_seconds(run, "status", str(run.path), out=tmp / f"status-{points}-{label}.txt")
        if plot:
            out[f"plot{suffix}_s"] = cli_seconds(run, "plot", str(run.path), "-o",
                                                 str(tmp / f"curve-{points}-{label}.png"))
        for p in hidden:
            p.rename(p.with_name(p.name[1:]))
    if _steady_lines(tmp / f"status-{points}-summary.txt") != _steady_lines(tmp / f"status-{points}-full.txt"):
        raise RuntimeError(f"status prints differently with and without step summaries at {points} points")
    if plot and (tmp / f"curve-{points}-summary.png").read_bytes() != (tmp / f"curve-{points}-full.png").read_bytes():
        raise RuntimeError(f"plot draws differently with and without step summaries at {points} points")
    return out


# -- syscalls of one idle poll (a probe process traced after its warm-up) -----------------------------------
PROBES = ("trainer-idle", "trainer-waiting", "worker-idle")
SMOKE_PROBES = ("worker-idle",)  # --smoke: the one probe process that does not import torch


def probe(kind: str, run_dir: Path) -> None:
    """``--probe KIND RUN``: warm up, say READY, poll once on a line from stdin, say DONE, exit on the next."""
    run = RunDir.open(run_dir)
    if kind == "worker-idle":
        w = worker(run)
        poll = w.poll
    else:
        d = dispatcher(run)
        d.step = max(d.ledger.state.dispatched)
        if kind == "trainer-waiting":  # one pending point without results (no snapshot: no worker sees it)
            d.step += INTERVAL
            d.ledger.append("dispatched", d.step, mode="staging")

        def poll() -> None:
            d.poll(force=True)
    poll()
    t0 = time.perf_counter()
    poll()  # timed untraced; the traced poll below is slowed by strace
    os.write(1, b"READY %.6f\n" % (time.perf_counter() - t0))
    sys.stdin.readline()
    poll()
    os.write(1, b"DONE\n")
    sys.stdin.readline()


STRACE_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$")
IGNORED = {"read", "write"}  # the probe's own handshake on stdin/stdout


def idle_poll(run: RunDir, kind: str, tmp: Path) -> tuple[float, dict[str, int]]:
    """Seconds of one poll of ``kind`` after the warm-up, and its syscalls by name (``strace -c`` attached
    after the warm-up: a second poll, counted)."""
    if shutil.which("strace") is None:
        raise RuntimeError("strace not found (make bench installs it)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, __file__, "--probe", kind, str(run.path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, env=env, cwd=ROOT)
    assert p.stdin is not None and p.stdout is not None
    try:
        ready = p.stdout.readline().split()
        if ready[:1] != [b"READY"]:
            raise RuntimeError(f"probe {kind} did not start")
        out = tmp / f"strace-{kind}.txt"
        tracer = subprocess.Popen(["strace", "-c", "-f", "-o", str(out), "-p", str(p.pid)],
                                  stderr=subprocess.PIPE)
        assert tracer.stderr is not None
        tracer.stderr.readline()  # "Process N attached"
        time.sleep(0.2)  # the other threads' attach lines
        p.stdin.write(b"go\n")
        p.stdin.flush()
        if p.stdout.readline() != b"DONE\n":
            raise RuntimeError(f"probe {kind} failed")
        tracer.send_signal(signal.SIGINT)
        tracer.wait(30)
        p.stdin.write(b"bye\n")
        p.stdin.flush()
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
    counts = {}
    for line in out.read_text().splitlines():
        if (m := STRACE_ROW.match(line)) and m.group(2) not in IGNORED and m.group(2) != "total":
            counts[m.group(2)] = int(m.group(1))
    return float(ready[1]), counts


# -- the benchmark ----------------------------------------------------------------------------------------
def measure(path: Path, args: argparse.Namespace, points: int, tmp: Path) -> dict[str, Any]:
    print(f"\n[{points} points] building {points} x {args.datasets} x {args.shards} = "
          f"{points * args.datasets * args.shards:,} results under {path} ...", flush=True)
    built = build_run(path, points, args.datasets, args.shards, args.pending, args.procs)
    print(f"  results written in {built['write_s']:.1f} s ({built['files_per_s']:,.0f} files/s, {args.procs} "
          f"procs), {points - args.pending} points ingested in {built['ingest_build_s']:.1f} s", flush=True)
    run = RunDir.open(path)
    row: dict[str, Any] = {**built, "load": os.getloadavg(), **trainer_polls(run, built["last_step"])}
    row.update(readers(run, tmp, points, plot=not args.smoke))
    row["syscalls"] = {}
    for kind in SMOKE_PROBES if args.smoke else PROBES:
        row[f"{kind.replace('-', '_')}_probe_s"], row["syscalls"][kind] = idle_poll(run, kind, tmp)
    for key in operations(row):
        print(f"  {key:<14} {row[key]:8.3f} s", flush=True)
    for kind, counts in row["syscalls"].items():
        print(f"  syscalls of one {kind} poll: {sum(counts.values())} {dict(sorted(counts.items()))}", flush=True)
    return row


def operations(row: dict[str, Any]) -> list[str]:
    return [key for key in OPERATIONS if key in row]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=1000)
    ap.add_argument("--datasets", type=int, default=20)
    ap.add_argument("--shards", type=int, default=32)
    ap.add_argument("--baseline-points", type=int, default=10)
    ap.add_argument("--pending", type=int, default=2, help="complete points the resumed trainer has to ingest")
    ap.add_argument("--procs", type=int, default=2, help="processes writing the results")
    ap.add_argument("--root", type=Path, default=Path("/dev/shm") if os.path.isdir("/dev/shm") else None,
                    help="where the run dirs go (default /dev/shm: on a disk each result's fsync dominates)")
    ap.add_argument("--json", type=Path, help="also write the results here as JSON")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: a tiny run (4 vs 2 points of 2 x 2 units), no plot, the worker probe only")
    ap.add_argument("--probe", nargs=2, metavar=("KIND", "RUN"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.probe:
        probe(args.probe[0], Path(args.probe[1]))
        return {}
    if args.smoke:
        args.points, args.baseline_points, args.datasets, args.shards, args.pending = 4, 2, 2, 2, 1
    if not 0 <= args.pending < min(args.points, args.baseline_points):
        ap.error("--pending must be below both --points and --baseline-points")
    import ckpteval.jobs.eval.worker.loop  # noqa: F401  (imported before any timing: torch, transformers)
    import ckpteval.jobs.trainer.dispatcher  # noqa: F401

    load0 = os.getloadavg()
    print(f"uptime: {os.popen('uptime').read().strip()}; cpus={os.cpu_count()}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.root, prefix="bench-scale-") as tmp:
        rows = {name: measure(Path(tmp) / name, args, n, Path(tmp))
                for name, n in (("baseline", args.baseline_points), ("scale", args.points))}
    base, big = rows["baseline"], rows["scale"]
    print(f"\n{'operation':<28} {args.baseline_points:>8} pts {args.points:>8} pts {'ratio':>7}  goal")
    for key in operations(big):
        goal = f"< {GOAL_S:g} s" if key in GOALS else ""
        print(f"{key:<28} {base[key]:>10.3f} s {big[key]:>10.3f} s {big[key] / base[key]:>6.1f}x  {goal}")
    for kind in big["syscalls"]:
        b, s = sum(base["syscalls"][kind].values()), sum(big["syscalls"][kind].values())
        print(f"syscalls, {kind + ' poll':<18} {b:>12} {s:>12} {s / max(b, 1):>6.1f}x  O(1): ratio 1")
    out = {"cpus": os.cpu_count(), "datasets": args.datasets, "shards": args.shards, "pending": args.pending,
           "procs": args.procs, "root": str(args.root), "load_at_start": load0, "load_at_end": os.getloadavg(),
           "baseline": base, "scale": big, "goal_s": GOAL_S}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
