"""Seconds from a stop signal to exit, in every wait of the reference trainer (issue 11 §4).

Starts ``python -m ckpteval.jobs.cli train`` as a real process with no eval fleet, so every wait is a wait for
results that never come, each bounded at ``--bound`` seconds:

* ``backpressure`` — step 2 pending, ``--eval-max-in-flight 1``: step 4 waits for a slot;
* ``drain`` — ``--steps 2``: training done, the drain waits for the final point;
* ``final-export`` — measured in-process (the reference trainer has no model-size flag): a ~200 MB
  final export, ``EvalDispatcher.close`` waiting for it, a real SIGUSR1 to this process.

For each, the signal is sent once the trainer is inside the wait (ledger / TRAINING_DONE observed,
plus ``--settle`` seconds) and two times are measured with ``time.monotonic``: until the trainer's
last output line (it left the wait and wrote its summary / "preempted" line) and until the process
exits (``close`` returns, in-process). The gap between the two is interpreter teardown (torch), the
same as after a normal end of training. The ratio is against the wait's own bound (what the trainer did before: wait it
out). Usage: ``.venv/bin/python bench/bench_stop.py [--bound 300] [--settle 1] [--root /tmp]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _trainer(run_dir: Path, bound: float, *extra: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "ckpteval.jobs.cli", "train", "--run-dir", str(run_dir), "--batch-size", "8", "--threads",
            "1", "--no-progress", "--ckpt-interval", "1000", "--eval-interval", "2", "--eval-max-in-flight", "1",
            "--eval-keep-snapshots", "1", "--eval-n-prompts", "4", "--eval-shard-size", "2",
            "--eval-poll-interval", "0.05", "--eval-backpressure-timeout", str(bound),
            "--eval-drain-timeout", str(bound), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_until(predicate, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError("the trainer never reached the wait")
        time.sleep(0.05)


def measure_process(root: Path, wait: str, signum: int, bound: float, settle: float) -> tuple[float, float, int]:
    """(seconds to the trainer's last line — the wait left, checkpoint saved —, seconds to exit, code)."""
    run_dir = root / f"{wait}-{signum}"
    steps = "50" if wait == "backpressure" else "2"
    proc = _trainer(run_dir, bound, "--steps", steps)
    last_line = [0.0]

    def drain_output() -> None:
        assert proc.stdout is not None
        for _line in proc.stdout:
            last_line[0] = time.monotonic()

    reader = threading.Thread(target=drain_output, daemon=True)
    reader.start()
    try:
        if wait == "backpressure":
            _wait_until(lambda: (run_dir / "ledger.jsonl").is_file(), 120)
        else:
            _wait_until(lambda: (run_dir / "TRAINING_DONE").is_file(), 120)
        time.sleep(settle)
        t0 = time.monotonic()
        proc.send_signal(signum)
        code = proc.wait(bound + 60)
        t_exit = time.monotonic()
        reader.join(10)
        return max(0.0, last_line[0] - t0), t_exit - t0, code
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def measure_final_export(root: Path) -> float:
    sys.path.insert(0, str(REPO))
    from ckpteval.jobs.metrics import MetricsSink
    from ckpteval.jobs.reference.model import ModelConfig, build_model
    from ckpteval.jobs.reference.train.main import TrainConfig, base_model_dir, prepare_run
    from ckpteval.jobs.trainer.config import DispatchConfig
    from ckpteval.jobs.trainer.dispatcher import EvalDispatcher

    cfg = TrainConfig(run_dir=root / "final-export", dispatch=DispatchConfig(eval_interval=2), eval_n_prompts=4,
                      eval_shard_size=2)
    dispatch = cfg.validate()
    run = prepare_run(cfg, dispatch)
    got: list[float] = []
    previous = signal.signal(signal.SIGUSR1, lambda _s, _f: got.append(time.monotonic()))
    d = EvalDispatcher.open(dispatch, run, MetricsSink(run.metrics_path), base_model_dir(run), should_stop=lambda: bool(got))
    model = build_model(ModelConfig(num_layers=4, hidden_size=1024, num_heads=8, num_kv_heads=8,
                                    intermediate_size=4096), "llama")
    timer = threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        finished = d.close(2, model)
        t1 = time.monotonic()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    if finished:
        raise RuntimeError("the final export finished before the signal: nothing measured")
    assert d.exporter is not None
    d.exporter.wait(300)
    return t1 - got[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bound", type=float, default=300.0, help="each wait's bound in seconds (the default 300)")
    p.add_argument("--settle", type=float, default=1.0, help="seconds inside the wait before the signal")
    p.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--waits", default="backpressure,drain,final-export",
                   help="comma list of the waits to measure (a smoke run: backpressure alone)")
    p.add_argument("--signals", default="SIGUSR1,SIGTERM", help="comma list of the signals sent to trainer processes")
    args = p.parse_args(argv)
    waits = args.waits.split(",")
    root = Path(tempfile.mkdtemp(prefix="bench-stop-", dir=args.root))
    rows = []
    for wait in (w for w in ("backpressure", "drain") if w in waits):
        for name in args.signals.split(","):
            left, secs, code = measure_process(root, wait, signal.Signals[name], args.bound, args.settle)
            rows.append({"wait": wait, "signal": name, "to_last_line_s": round(left, 3),
                         "seconds": round(secs, 3), "exit": code, "ratio_to_bound": round(secs / args.bound, 5)})
    if "final-export" in waits:
        secs = measure_final_export(root)
        rows.append({"wait": "final-export (in-process)", "signal": "SIGUSR1", "seconds": round(secs, 3), "exit": None,
                     "ratio_to_bound": None})
    for row in rows:
        print(json.dumps(row))
    ratios = [r["ratio_to_bound"] for r in rows if r["ratio_to_bound"] is not None]
    if ratios:
        print(f"ratio seconds-to-exit / bound: max {max(ratios):.4f} ({len(ratios)} trainer processes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
