"""SIGKILL storm: random workers of a 3-worker fleet are killed (mostly mid-unit) and restarted at once,
while a training loop keeps publishing snapshots. Every point must land, every unit exactly one result."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from tests.chaos import harness


def test_sigkill_storm_loses_nothing(tmp_path: Path, procs: harness.Procs, request: pytest.FixtureRequest) -> None:
    kills_wanted = harness.scaled(10, 100)
    rand = harness.rng("sigkill-storm")
    t_start = time.monotonic()
    trainer = harness.InProcTrainer(tmp_path / "run", eval_interval=8, lease=(3.0, 0.5))
    run = trainer.run
    fleet = harness.Fleet(procs, run.path, 3, env=harness.base_env(SUMBACKEND_DELAY_S="1.0"))
    fleet.start_all()

    kills = {"total": 0, "mid_unit": 0}
    failure: list[BaseException] = []
    stop = threading.Event()

    def monkey() -> None:
        try:
            while kills["total"] < kills_wanted and not stop.is_set():
                time.sleep(rand.uniform(0.4, 1.4))
                # a random moment; the victim is mostly one in the middle of a unit, sometimes an idle one
                # or one still starting up
                live = fleet.live()
                busy = [(i, p) for i, p in live if harness.units_held_by(run, p.pid)]
                pool = busy if busy and rand.random() < 0.85 else live
                if not pool:
                    continue
                i, p = rand.choice(pool)
                kills["mid_unit"] += bool(harness.units_held_by(run, p.pid))
                fleet.signal(i, signal.SIGKILL)
                kills["total"] += 1
                fleet.start(i)  # restarted at once, as a scheduler would
        except BaseException as e:  # noqa: BLE001 — reported by the test thread
            failure.append(e)

    chaos = threading.Thread(target=monkey, daemon=True)
    chaos.start()
    try:
        # the loop publishes a point every ~8 steps * 0.1 s (about what the fleet drains) while the monkey
        # kills, holding back (ingesting only) while 6 points are pending so the backlog stays bounded
        deadline = time.monotonic() + harness.scaled(120, 900)
        while chaos.is_alive():
            assert time.monotonic() < deadline, f"only {kills['total']} kills"
            trainer.advance(1, step_s=0.1, dispatch=len(trainer.dispatcher.pending) < 6)
        trainer.advance(3)
        trainer.close()
        codes = fleet.wait_all(timeout=120)
    finally:
        stop.set()
        chaos.join(30)
    assert not failure, failure
    sentinel_deleted = trainer.sentinel.deleted_bytes()
    t = harness.tally(run.path, trainer.dispatched())
    harness.record(
        request.node.nodeid, "SIGKILL workers (3-worker fleet, restarted)",
        f"{kills['total']} SIGKILL ({kills['mid_unit']} mid-unit)", t,
        stalls=trainer.stalls, max_gap_s=trainer.max_block, outside_deleted=sentinel_deleted,
        wall_s=time.monotonic() - t_start,
        notes=f"{fleet.starts} worker starts; lease 3 s / heartbeat 0.5 s; dead holders on the same host are "
              f"taken over at once (filelock checks the pid); units retried after a kill: "
              f"{_retried_units(run)}, most attempts on one unit: {_max_attempts(run)}",
    )
    assert kills["total"] >= kills_wanted
    assert codes == [0, 0, 0], fleet.logs()
    assert t.lost == [] and t.unexpected == [], t
    assert t.skips == {}, (t.skips, t.skip_steps)  # a SIGKILL is never a skip: the unit is taken over
    assert t.units_without_result == [], t.units_without_result
    assert t.dup_ingestions == 0
    assert trainer.stalls == 0, trainer.max_block
    assert sentinel_deleted == 0


def _retried_units(run) -> int:
    return sum(p.read_text().count("\n") > 1 for p in run.leases.rglob("*.attempts"))


def _max_attempts(run) -> int:
    return max((p.read_text().count("\n") for p in run.leases.rglob("*.attempts")), default=0)
