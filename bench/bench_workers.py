"""Benchmark: eval throughput (units/s) of 1, 2 and 4 worker processes sharing one run.

Builds a run of ``--steps`` snapshots of the reference tiny model (``ckpteval.jobs.reference.model.build_model``,
published with ``ckpteval.coord.snapshots.snapshot.publish_snapshot``) and the built-in addition eval set, then for each
worker count starts that many ``python -m ckpteval.jobs.cli worker --once --engine hf`` processes on a fresh
copy of the run's results and leases, and prints

* units/s in steady state: results written while every worker was busy, over that window — i.e.
  without the processes' start-up (torch import, first model build) and its skew between processes;
* units/s end to end (wall time from launch until every worker exited);
* the ratio of each to the 1-worker figure.

Every worker runs with ``--threads`` intra-op threads (default 1; ``OMP_NUM_THREADS``). Ratios only
mean something relative to the machine's cores: the load average and CPU count are printed first.

Usage: ``.venv/bin/python bench/bench_workers.py [--workers 1,2,4] [--steps 8] [--n-prompts 256]
[--shard-size 32] [--threads 1] [--root /tmp] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ckpteval.coord.results.files import Result, ResultIndex
from ckpteval.coord.run.identity import run_key
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.snapshot import publish_snapshot
from ckpteval.jobs.eval.kinds.generate.evalsets import write_addition_dataset
from ckpteval.jobs.reference.model import build_model, save_base_model_dir
from ckpteval.jobs.trainer.export.hf_files import write_hf_files

REPO = Path(__file__).resolve().parents[1]


def make_run(root: Path, steps: int, n_prompts: int, shard_size: int) -> RunDir:
    run = RunDir.create(root / "run")
    spec = write_addition_dataset(run, n=n_prompts, shard_size=shard_size)
    manifest = RunManifest(
        run_id="bench-workers",
        eval=EvalSpec(entries=(spec,), engine={"hf": {"max_batch_size": shard_size}}),
        snapshot_roots=(str(run.snapshots),),
        lease=LeaseSettings(60.0, 10.0),
    )
    run = RunDir.create(run.path, manifest)
    base = save_base_model_dir(root / "base")
    for step in range(1, steps + 1):
        model = build_model(seed=step)
        publish_snapshot(run.snapshots, step * 100, lambda d, m=model: write_hf_files(d, m.state_dict(), base),
                         run=run_key(manifest))  # as the trainer stamps it
    return run


def reset(run: RunDir) -> None:
    for d in (run.results, run.leases):
        shutil.rmtree(d)
        d.mkdir()


def measure(run: RunDir, n_workers: int, threads: int) -> dict[str, float]:
    reset(run)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "ckpteval.jobs.cli", "worker", "--run-dir", str(run.path), "--engine", "hf", "--once",
           "--poll-interval", "0.2"]
    t0 = time.time()
    procs = [subprocess.Popen([*cmd, "--worker-id", f"w{i}"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for i in range(n_workers)]
    codes = [p.wait() for p in procs]
    wall = time.time() - t0
    if any(codes):
        raise RuntimeError(f"workers exited with {codes}")
    results = list(ResultIndex(run.results).refresh().values())
    if not all(r.ok for r in results):
        raise RuntimeError("some units were skipped: " + json.dumps([r.skip_reason for r in results if not r.ok]))
    rate, window = steady_rate(results)
    return {"units": len(results), "steady": rate, "window": window, "e2e": len(results) / wall}


def steady_rate(results: list[Result]) -> tuple[float, float]:
    """Units/s while *every* worker was busy: results written between the last worker's first start
    and the first worker's last write, over that window (start-up skew between processes excluded)."""
    by_worker: dict[str, list[Result]] = {}
    for r in results:
        by_worker.setdefault(r.worker["worker_id"], []).append(r)
    start = max(min(r.written_at - r.timings["total_s"] for r in rs) for rs in by_worker.values())
    end = min(max(r.written_at for r in rs) for rs in by_worker.values())
    inside = [r for r in results if start < r.written_at <= end]
    if end - start <= 0 or not inside:
        raise RuntimeError("workers never ran concurrently: use more --steps or --n-prompts")
    return len(inside) / (end - start), end - start


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--n-prompts", type=int, default=256)
    parser.add_argument("--shard-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    print(f"cpus={os.cpu_count()} loadavg={os.getloadavg()} threads/worker={args.threads}")
    with tempfile.TemporaryDirectory(dir=args.root, prefix="bench-workers-") as tmp:
        run = make_run(Path(tmp), args.steps, args.n_prompts, args.shard_size)
        rows = [(int(n), measure(run, int(n), args.threads)) for n in args.workers.split(",")]
    base = rows[0][1]
    print(f"{'workers':>7} {'units':>5} {'steady u/s':>10} {'ratio':>6} {'window s':>8} {'e2e u/s':>8} {'ratio':>6}")
    for n, m in rows:
        print(f"{n:>7} {m['units']:>5.0f} {m['steady']:>10.2f} {m['steady'] / base['steady']:>6.2f} "
              f"{m['window']:>8.1f} {m['e2e']:>8.2f} {m['e2e'] / base['e2e']:>6.2f}")
    out = {"cpus": os.cpu_count(), "threads_per_worker": args.threads, "steps": args.steps,
           "n_prompts": args.n_prompts, "shard_size": args.shard_size,
           "rows": [{"workers": n, **m, "steady_ratio": m["steady"] / base["steady"],
                     "e2e_ratio": m["e2e"] / base["e2e"]} for n, m in rows]}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
