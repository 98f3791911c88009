"""SLURM-style preemption: SIGTERM / SIGUSR1 to workers in the middle of units. Each exits with
EXIT_PREEMPTED, its lease is released at once (long before the 30 s lease could expire), and the
restarted fleet finishes everything."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from ckpteval.jobs.lifecycle import EXIT_PREEMPTED
from tests.chaos import harness


def test_preemption_signals_release_at_once(tmp_path: Path, procs: harness.Procs,
                                            request: pytest.FixtureRequest) -> None:
    signals_wanted = harness.scaled(4, 30)
    lease_s = 30.0
    rand = harness.rng("preemption")
    t_start = time.monotonic()
    trainer = harness.InProcTrainer(tmp_path / "run", eval_interval=5, lease=(lease_s, 5.0))
    run = trainer.run
    # units take 1 s, so a signal lands mid-unit
    fleet = harness.Fleet(procs, run.path, 3, env=harness.base_env(SUMBACKEND_DELAY_S="1.0"))
    fleet.start_all()
    sent: list[str] = []
    exit_s: list[float] = []
    bad: list[str] = []
    points = harness.scaled(6, 40)
    deadline = time.monotonic() + harness.scaled(120, 600)
    while len(sent) < signals_wanted or len(trainer.dispatched()) < points:
        assert time.monotonic() < deadline, f"only {len(sent)} signals sent"
        # new points while signals or points remain, keeping a small backlog so workers stay busy
        trainer.advance(1, step_s=0.05, dispatch=len(trainer.dispatcher.pending) < 3)
        if len(sent) >= signals_wanted:
            continue
        busy = [(i, p) for i, p in fleet.live() if harness.units_held_by(run, p.pid)]
        if not busy or rand.random() > 0.1:
            continue
        i, victim = rand.choice(busy)
        held = harness.units_held_by(run, victim.pid)
        sig = signal.SIGTERM if len(sent) % 2 == 0 else signal.SIGUSR1
        t0 = time.monotonic()
        code = fleet.signal(i, sig, timeout=15)
        exit_s.append(time.monotonic() - t0)
        sent.append(sig.name)
        if code != EXIT_PREEMPTED:
            bad.append(f"{sig.name}: exit {code}: {procs.tail(victim)}")
        still = [u for u in held if harness.lease_holders(run).get(u, ("", 0))[1] == victim.pid]
        if still:
            bad.append(f"{sig.name}: leases {still} not released by {victim.pid}")
        fleet.start(i)
    trainer.close()
    codes = fleet.wait_all(timeout=120)
    t = harness.tally(run.path, trainer.dispatched())
    harness.record(
        request.node.nodeid, "SIGTERM/SIGUSR1 preemption mid-unit",
        f"{sent.count('SIGTERM')} SIGTERM + {sent.count('SIGUSR1')} SIGUSR1", t,
        stalls=trainer.stalls, max_gap_s=trainer.max_block, outside_deleted=trainer.sentinel.deleted_bytes(), wall_s=time.monotonic() - t_start,
        notes=f"every victim held a lease when signalled; signal→exit max {max(exit_s, default=0):.2f} s; "
              f"lease 30 s, so every takeover came from the released lease, not expiry; whole run "
              f"{time.monotonic() - t_start:.0f} s",
    )
    assert not bad, bad
    assert max(exit_s) < 5.0, exit_s
    assert codes == [0, 0, 0], fleet.logs()
    assert t.lost == [] and t.skips == {} and t.units_without_result == [], t
    assert t.dup_ingestions == 0
    assert trainer.stalls == 0, trainer.max_block
    assert trainer.sentinel.deleted_bytes() == 0
