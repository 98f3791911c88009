"""SIGKILL of the trainer process (``ckpteval train`` with a worker fleet) and ``--resume``, repeatedly in one
run: every point is ingested exactly once (one ``eval/step`` line and one ``ingested`` record per step)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from ckpteval.coord.run.rundir import RunDir
from tests.chaos import harness


def test_trainer_sigkill_and_resume(tmp_path: Path, procs: harness.Procs, request: pytest.FixtureRequest) -> None:
    kills_wanted = harness.scaled(2, 6)
    steps, interval = harness.scaled(300, 600), 10
    rand = harness.rng("trainer-kills")
    t_start = time.monotonic()
    run_dir = tmp_path / "run"
    args = ("--steps", str(steps), "--eval-interval", str(interval), "--ckpt-interval", "20",
            "--eval-max-in-flight", "64", "--eval-keep-snapshots", "64")
    trainer = procs.cli(*harness.train_argv(run_dir, *args), name="train")
    monitor = harness.ProgressMonitor(run_dir / "metrics.jsonl")
    monitor.start()
    harness.wait_for(lambda: (run_dir / "run.json").exists() or trainer.poll() is not None, 60, "run.json")
    sentinel = harness.guard_outside(run_dir / "snapshots", tmp_path / "outside")
    fleet = harness.Fleet(procs, run_dir, 2, env=harness.base_env(SUMBACKEND_DELAY_S="0.15"))
    fleet.start_all()
    run = RunDir(run_dir)
    torn = 0
    kills = []
    try:
        last = 0
        for k in range(kills_wanted):
            # a random step between the previous kill and the end, spread so every kill happens in training;
            # the resumed trainer restarts from its last 20-step checkpoint, so it retrains a little first
            span = max(10, (steps - last) // (kills_wanted - k + 1))
            target = min(steps - 5, last + rand.randint(5, span))
            proc = trainer
            harness.wait_for(lambda t=target, p=proc: monitor.last_step() >= t or p.poll() is not None, 120,
                             f"the trainer to reach step {target}")
            assert trainer.poll() is None, f"trainer finished before kill {k + 1}: {procs.tail(trainer)}"
            trainer.send_signal(signal.SIGKILL)
            trainer.wait()
            kills.append(monitor.last_step())
            last = kills[-1]
            if k == 0:  # what a kill in the middle of an append leaves: a torn last line in both logs
                for name in ("ledger.jsonl", "metrics.jsonl"):
                    with open(run_dir / name, "ab") as f:
                        f.write(b'{"event": "ingested", "step": 99')
                torn += 2
            monitor.new_incarnation()
            trainer = procs.cli(*harness.train_argv(run_dir, *args, "--resume"), name="train-resume")
        code = procs.wait(trainer, 300)
        fleet_codes = fleet.wait_all(120)
    finally:
        monitor.stop.set()
    expected = list(range(interval, steps + 1, interval))
    t = harness.tally(run_dir, expected)
    harness.record(
        request.node.nodeid, "SIGKILL trainer + --resume", f"{len(kills)} SIGKILL (at train steps {kills}), "
        f"{torn} torn log tails", t, stalls=monitor.stalls(), max_gap_s=monitor.max_gap(),
        outside_deleted=sentinel.deleted_bytes(),
        wall_s=time.monotonic() - t_start,
        notes="each kill at a random step (the steps are the last train line seen); resumed from the last training checkpoint (every 20 steps); points "
              "whose snapshot was never published are re-dispatched when the resumed loop reaches them again "
              "(or skipped `crashed`, the documented rule); torn ledger/metrics tails are cut on resume",
    )
    assert code == 0, procs.tail(trainer)
    assert fleet_codes == [0, 0], fleet.logs()
    assert run.training_done() == steps
    assert t.lost == [] and t.unexpected == [], t
    assert set(t.skips) <= {"crashed"}, t.skips  # the only documented skip a trainer kill may cause
    assert t.dup_ingestions == 0, t
    assert t.units_without_result == [], t.units_without_result
    assert monitor.stalls() == 0, monitor.gaps()
    assert sentinel.deleted_bytes() == 0
