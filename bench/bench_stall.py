"""Trainer stall and eval latency: the reference trainer's steps/s with an eval fleet consuming.

Runs ``python -m ckpteval.jobs.cli train`` (``--steps`` steps, ``--threads 1``, ``--no-progress``) once per
configuration, all in the same run, and reads the trainer's own JSON summary (``steps_per_second`` =
steps / seconds of the training loop: start-up and the end-of-training drain excluded):

* ``no-eval`` — the baseline (``--no-eval``);
* ``fleet-staging`` — snapshots exported by the AsyncExporter to ``--staging`` (tmpfs) every
  ``--eval-interval`` steps, ``--workers`` ``ckpteval worker --engine hf`` processes consuming;
* ``fleet-reuse`` — the trainer saves an HF checkpoint every ``--eval-interval`` steps anyway
  (``--save-hf``) and marks it complete; same fleet. Its fair baseline is ``no-eval+save-hf``;
* ``shared`` — ``--eval-posture shared``: blocking eval on the trainer's own process (no fleet);
* the fleet runs again with the trainer pinned to core 0 (``taskset -c 0``) and the workers to core 1
  (``taskset -c 1``), against a no-eval baseline pinned to core 0 (``--no-pinned`` skips them).

Configurations run in ``--repeats`` interleaved rounds with one more baseline at the end, so a load
drifting on a shared machine hits each alike; a config's steps/s is the mean of its runs and its ratio
is against the mean of its baseline's runs.

The run dir is prepared first (``ckpteval.jobs.reference.train.main.prepare_run``, as ``ckpteval train`` does) and the workers
are started and left to finish their start-up (torch/transformers import; detected as their CPU time
no longer growing) before the trainer starts with ``--resume`` (nothing to resume: it starts at step 0),
so the trainer's loop competes with the fleet's evaluation, not with its Python start-up.

CPU: the trainer process's CPU seconds (its rusage) and the fleet's (the workers' /proc CPU time from
the trainer's start to its exit, final point included) show what the two compete for.

Latency (fleet runs), per point, from the run's files: snapshot marker ``created`` -> last unit
result's ``written_at`` (the point complete) -> the ledger's ``ingested`` record ``time``; and per unit
``created`` -> ``written_at``. Trainer and workers poll every ``--poll`` seconds (``--eval-poll-interval``,
worker ``--poll-interval``), so each hop is about half a poll interval plus the work.

Usage: ``.venv/bin/python bench/bench_stall.py [--steps 400] [--eval-interval 50] [--workers 2]
[--batch-size 32] [--poll 0.5] [--repeats 2] [--root /tmp] [--staging /dev/shm] [--no-pinned]
[--eval-config FILE] [--json OUT]``. ``--eval-config`` replaces the built-in addition set with a config's
datasets (a code set: the fleet's units then run programs in the sandbox, beside the trainer).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Config:
    name: str
    mode: str  # none | staging | reuse | shared
    save_hf: bool = False
    workers: int = 0
    pinned: bool = False

    @property
    def baseline(self) -> str:
        if self.pinned:
            return "no-eval pinned"
        return "no-eval+save-hf" if self.mode == "reuse" else "no-eval"


def configs(n_workers: int, pinned: bool, repeats: int) -> list[Config]:
    """Interleaved rounds (a drifting load hits every config alike), a baseline first and last."""
    out = []
    for r in range(repeats):
        out += [Config("no-eval", "none"), Config("fleet-staging", "staging", workers=n_workers),
                Config("fleet-reuse", "reuse", save_hf=True, workers=n_workers),
                Config("no-eval+save-hf", "none", save_hf=True)]
        if r == 0:
            out.append(Config("shared", "shared"))
    out.append(Config("no-eval", "none"))
    if pinned:
        for _ in range(repeats):
            out += [Config("no-eval pinned", "none", pinned=True),
                    Config("fleet-staging pinned", "staging", workers=n_workers, pinned=True),
                    Config("fleet-reuse pinned", "reuse", save_hf=True, workers=n_workers, pinned=True)]
        out.append(Config("no-eval pinned", "none", pinned=True))
    return out


def train_argv(cfg: Config, run_dir: Path, staging: Path, args: argparse.Namespace) -> list[str]:
    argv = ["--run-dir", str(run_dir), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
            "--threads", "1", "--no-progress", "--log-interval", str(args.eval_interval),
            "--ckpt-interval", str(args.steps)]
    if cfg.save_hf:
        argv += ["--save-hf", str(run_dir / "hf"), "--save-interval", str(args.eval_interval)]
    if cfg.mode == "none":
        return [*argv, "--no-eval"]
    if getattr(args, "eval_config", None):  # bench_judge.py: a judged set instead of the addition set
        argv += ["--eval-config", str(args.eval_config)]
    argv += ["--eval-interval", str(args.eval_interval), "--eval-poll-interval", str(args.poll),
             "--eval-keep-snapshots", "100000"]  # keep every marker: the latency reads them
    if args.eval_config is not None:
        argv += ["--eval-config", str(args.eval_config.resolve())]
    if cfg.mode == "staging":
        argv += ["--eval-staging-dir", str(staging)]
    if cfg.mode == "shared":
        argv += ["--eval-posture", "shared"]
    return argv


def cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime + stime


def wait_started(procs: list[subprocess.Popen], timeout_s: float = 120.0) -> float:
    """Wait until every process's CPU time stops growing (start-up done, idle polling); returns seconds."""
    t0 = time.monotonic()
    last = [cpu_ticks(p.pid) for p in procs]
    quiet = 0
    while time.monotonic() - t0 < timeout_s:
        time.sleep(0.5)
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a worker exited during start-up: {[p.poll() for p in procs]}")
        now = [cpu_ticks(p.pid) for p in procs]
        grew = max(b - a for a, b in zip(last, now, strict=True))
        quiet = quiet + 1 if grew <= 0.05 * TICKS else 0  # under 10% of a core over 0.5 s
        last = now
        if quiet >= 2 and time.monotonic() - t0 > 2.0:
            return time.monotonic() - t0
    raise RuntimeError("workers did not settle within the start-up timeout")


def run_one(cfg: Config, base: Path, staging_base: Path, args: argparse.Namespace, index: int) -> dict[str, Any]:
    from ckpteval.jobs.reference.train.main import parse_args, prepare_run

    run_dir = base / f"{index:02d}-{cfg.name.replace(' ', '-').replace('+', '-')}"
    staging = staging_base / run_dir.name
    argv = train_argv(cfg, run_dir, staging, args)
    tcfg = parse_args(argv)
    prepare_run(tcfg, tcfg.validate())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(REPO)}
    trainer_pin = ["taskset", "-c", "0"] if cfg.pinned else []
    worker_pin = ["taskset", "-c", "1"] if cfg.pinned else []
    logs = run_dir / "logs"
    logs.mkdir()
    workers = []
    for i in range(cfg.workers):
        with open(logs / f"w{i}.out", "w") as log:
            workers.append(subprocess.Popen(
                [*worker_pin, sys.executable, "-m", "ckpteval.jobs.cli", "worker", "--run-dir", str(run_dir), "--engine",
                 "hf", "--poll-interval", str(args.poll), "--worker-id", f"w{i}", *getattr(args, "worker_args", ())],
                env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            ))
    try:
        startup = wait_started(workers) if workers else 0.0
        load1 = os.getloadavg()[0]
        fleet_ticks0 = sum(cpu_ticks(w.pid) for w in workers)
        children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.time()
        done = subprocess.run(
            [*trainer_pin, sys.executable, "-m", "ckpteval.jobs.cli", "train", *argv, "--resume"],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout,
        )
        wall = time.time() - t0
        # workers not yet reaped (zombies included) still show their CPU time in /proc
        fleet_cpu = (sum(cpu_ticks(w.pid) for w in workers) - fleet_ticks0) / TICKS
        children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        trainer_cpu = (children1.ru_utime + children1.ru_stime) - (children0.ru_utime + children0.ru_stime)
        if done.returncode != 0:
            raise RuntimeError(f"{cfg.name}: trainer exited {done.returncode}:\n{done.stderr[-3000:]}")
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        for w in workers:
            w.wait(timeout=60)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    out: dict[str, Any] = {
        "name": cfg.name, "mode": cfg.mode, "pinned": cfg.pinned, "workers": cfg.workers,
        "baseline": cfg.baseline, "load1_at_start": round(load1, 2), "worker_startup_s": round(startup, 1),
        "wall_s": round(wall, 1), "trainer_cpu_s": round(trainer_cpu, 2), "fleet_cpu_s": round(fleet_cpu, 2),
        **summary,
    }
    out.update(eval_summary(run_dir))
    if cfg.mode in ("staging", "reuse"):
        out["latency"] = latency(run_dir, snapshot_dir_fn(cfg.mode, staging, run_dir))
    if not args.keep:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    return out


def snapshot_dir_fn(mode: str, staging: Path, run_dir: Path) -> Callable[[int], Path]:
    """Where a step's snapshot (and its marker) is: in staging mode under the root run.json lists (the
    staging dir's per-run subdir), in reuse mode the HF checkpoint."""
    if mode == "staging":
        from ckpteval.coord.run.rundir import RunDir
        from ckpteval.coord.snapshots.snapshot import snapshot_dirname

        root = Path(RunDir(run_dir).manifest().snapshot_roots[0])
        return lambda step: root / snapshot_dirname(step)
    return lambda step: run_dir / "hf" / f"checkpoint-{step}"


def eval_lines(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "eval/step" in r]


def eval_summary(run_dir: Path) -> dict[str, Any]:
    points = eval_lines(run_dir)

    def values(key: str) -> list[float]:
        return [p[key] for p in points if isinstance(p.get(key), int | float)]

    skipped: dict[str, int] = {}
    for p in points:
        for k, v in p.items():
            if k.startswith("eval/skipped_") and v:
                reason = k.removeprefix("eval/skipped_")
                skipped[reason] = skipped.get(reason, 0) + 1
    blocked, total = values("eval/export_blocked_seconds"), values("eval/export_time_seconds")
    return {
        "points": len(points),
        "skipped_points": skipped,
        "backpressure_wait_s": round(sum(values("eval/backpressure_wait_seconds")), 3),
        "export_blocked_s_median": round(statistics.median(blocked), 5) if blocked else None,
        "export_time_s_median": round(statistics.median(total), 5) if total else None,
        "export_blocked_s_sum": round(sum(blocked), 5),
        "lag_steps_median": statistics.median(values("eval/lag_steps")) if points else None,
        "final_score": points[-1].get("eval/addition") if points else None,
    }


def latency(run_dir: Path, snap_dir: Callable[[int], Path]) -> dict[str, Any]:
    """Per point: marker created -> last result written -> ingested; per unit: created -> written."""
    ingested = {}
    for line in (run_dir / "ledger.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["event"] == "ingested" and rec.get("outcome") == "complete" and "time" in rec:
            ingested[rec["step"]] = rec["time"]
    results: dict[int, list[dict[str, Any]]] = {}
    for f in (run_dir / "results").glob("step-*/*.json"):  # protocol 2: one dir per step
        r = json.loads(f.read_text())
        results.setdefault(r["unit"]["step"], []).append(r)
    to_result, to_ingest, total, unit = [], [], [], []
    for step, t_ingest in sorted(ingested.items()):
        marker = snap_dir(step) / ".complete"
        rs = [r for r in results.get(step, []) if r["status"] == "ok"]
        if not marker.exists():  # every marker is kept (--eval-keep-snapshots): a wrong path, not a skip
            raise RuntimeError(f"{marker}: no marker for the ingested step {step}: latency cannot be measured")
        if not rs:
            continue
        created = json.loads(marker.read_text())["created"]
        last = max(r["written_at"] for r in rs)
        to_result.append(last - created)
        to_ingest.append(t_ingest - last)
        total.append(t_ingest - created)
        unit += [r["written_at"] - created for r in rs]
    timings: dict[str, list[float]] = {}
    for rs in results.values():
        for r in rs:
            for k, v in (r.get("timings") or {}).items():
                if isinstance(v, int | float):
                    timings.setdefault(k, []).append(v)
    return {"points": len(total), "units": len(unit), "unit_timings": timings, "complete_to_result_s": to_result,
            "result_to_ingested_s": to_ingest, "complete_to_ingested_s": total, "unit_complete_to_result_s": unit}


def stats(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    s = sorted(xs)
    return {"median": round(statistics.median(s), 3), "p95": round(s[min(len(s) - 1, int(0.95 * len(s)))], 3),
            "max": round(s[-1], 3), "n": len(s)}


LATENCY_KEYS = ("complete_to_result_s", "result_to_ingested_s", "complete_to_ingested_s", "unit_complete_to_result_s")


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per config (first-seen order): mean steps/s over its runs, vs its baseline's mean;
    latency samples pooled over its runs."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_name.setdefault(r["name"], []).append(r)
    means = {n: statistics.mean(r["steps_per_second"] for r in rs) for n, rs in by_name.items()}
    out = []
    for name, rs in by_name.items():
        base_name = rs[0]["baseline"]
        base = means.get(base_name)
        blocked = [r["export_blocked_s_median"] for r in rs if r["export_blocked_s_median"] is not None]
        total = [r["export_time_s_median"] for r in rs if r["export_time_s_median"] is not None]
        train_s = sum(r["train_seconds"] for r in rs)
        row = {
            "name": name, "runs": len(rs), "steps_per_second": round(means[name], 3),
            "steps_per_second_each": [r["steps_per_second"] for r in rs], "baseline": base_name,
            "baseline_steps_per_second": round(base, 3) if base else None,
            "ratio": round(means[name] / base, 3) if base and base_name != name else None,
            "points": sum(r["points"] for r in rs),
            "skipped_points": sum(sum(r["skipped_points"].values()) for r in rs),
            "backpressure_wait_s": round(sum(r["backpressure_wait_s"] for r in rs), 3),
            "load1_at_start": [r["load1_at_start"] for r in rs],
            "export_blocked_s_median": statistics.median(blocked) if blocked else None,
            "export_time_s_median": statistics.median(total) if total else None,
            "export_blocked_fraction": round(sum(r["export_blocked_s_sum"] for r in rs) / train_s, 6),
            "worker_startup_s": [r["worker_startup_s"] for r in rs],
            "trainer_cpu_s": round(statistics.mean(r["trainer_cpu_s"] for r in rs), 2),
            "fleet_cpu_s": round(statistics.mean(r["fleet_cpu_s"] for r in rs), 2),
            "wall_s": round(statistics.mean(r["wall_s"] for r in rs), 1),
        }
        if any("latency" in r for r in rs):
            row["latency"] = {k: stats([x for r in rs for x in r["latency"][k]]) for k in LATENCY_KEYS}
            keys = {k for r in rs for k in r["latency"]["unit_timings"]}
            row["unit_timings"] = {k: round(statistics.median(x for r in rs for x in r["latency"]["unit_timings"].get(k, [])), 4)
                                   for k in sorted(keys)}
        out.append(row)
    return out


def fmt_stats(s: dict[str, float] | None) -> str:
    return "-" if s is None else f"{s['median']:.2f} / {s['p95']:.2f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--eval-interval", type=int, default=50)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--poll", type=float, default=0.5, help="trainer and worker poll interval (s)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds of the configs")
    ap.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()), help="where run dirs go")
    ap.add_argument("--staging", type=Path, default=Path("/dev/shm"), help="staging-mode export root")
    ap.add_argument("--no-pinned", dest="pinned", action="store_false", help="skip the taskset runs")
    ap.add_argument("--only", help="comma list of config names to run (default: all)")
    ap.add_argument("--timeout", type=float, default=300.0, help="per trainer run")
    ap.add_argument("--keep", action="store_true", help="keep the run dirs")
    ap.add_argument("--smoke", action="store_true", help="run each config once (tests/test_bench_smoke.py)")
    ap.add_argument("--eval-config", type=Path, help="evaluate this eval-config's datasets instead of the built-in "
                    "addition set (e.g. examples/evalsets/code_tiny.eval.json: every point runs programs in the sandbox)")
    ap.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = ap.parse_args(argv)
    if args.pinned and (os.cpu_count() or 1) < 2:
        args.pinned = False
    print(f"cpus={os.cpu_count()} loadavg={os.getloadavg()} steps={args.steps} batch={args.batch_size} "
          f"eval-interval={args.eval_interval} workers={args.workers} poll={args.poll}s", flush=True)
    args.root.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(dir=args.root, prefix="ckpteval-bench-stall-"))
    staging = Path(tempfile.mkdtemp(dir=args.staging, prefix="ckpteval-bench-stall-"))
    todo = configs(args.workers, args.pinned, args.repeats)
    if args.only:
        wanted = set(args.only.split(","))
        todo = [c for c in todo if c.name in wanted]
    if args.smoke:  # each config once: the closing baseline runs no code path its first run did not
        todo = list(dict.fromkeys(todo))
    rows = []
    try:
        for i, cfg in enumerate(todo):
            row = run_one(cfg, base, staging, args, i)
            rows.append(row)
            print(f"  {cfg.name:<22} {row['steps_per_second']:7.2f} steps/s  load {row['load1_at_start']:.2f}  "
                  f"points {row['points']}  skipped {row['skipped_points'] or '-'}  "
                  f"backpressure {row['backpressure_wait_s']}s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
            shutil.rmtree(staging, ignore_errors=True)
    summary = aggregate(rows)
    print(f"\n{'config':<22} {'runs':>4} {'steps/s':>8} {'baseline':>8} {'ratio':>6} {'points':>6} {'skipped':>7} "
          f"{'bp wait s':>9} {'export blocked / total s':>24} {'cpu s trainer/fleet':>19}")
    for r in summary:
        exp = (f"{r['export_blocked_s_median']:.4f} / {r['export_time_s_median']:.4f}"
               if r["export_blocked_s_median"] is not None else "-")
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        print(f"{r['name']:<22} {r['runs']:>4} {r['steps_per_second']:>8.2f} {r['baseline_steps_per_second'] or 0:>8.2f} "
              f"{ratio:>6} {r['points']:>6} {r['skipped_points']:>7} {r['backpressure_wait_s']:>9.2f} {exp:>24} "
              f"{r['trainer_cpu_s']:>9.1f} / {r['fleet_cpu_s']:<7.1f}")
    print("\nlatency, median / p95 s (marker created -> last result written -> ingested by the trainer)")
    print(f"{'config':<22} {'complete->result':>16} {'result->ingested':>16} {'complete->ingested':>18} "
          f"{'per unit c->r':>14}")
    for r in summary:
        if "latency" in r:
            lat = r["latency"]
            print(f"{r['name']:<22} {fmt_stats(lat['complete_to_result_s']):>16} "
                  f"{fmt_stats(lat['result_to_ingested_s']):>16} {fmt_stats(lat['complete_to_ingested_s']):>18} "
                  f"{fmt_stats(lat['unit_complete_to_result_s']):>14}")
    for r in rows:  # the raw samples stay in the per-run rows of the JSON only as statistics
        if "latency" in r:
            r["latency"] = {k: (stats(v) if isinstance(v, list) else v) for k, v in r["latency"].items()
                            if k != "unit_timings"}
    out = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "summary": summary, "runs": rows}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
