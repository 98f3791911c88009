"""Clock skew between workers: workers whose wall clock is shifted by ±10 minutes (Debian's libfaketime,
preloaded) and who run as *another host* (their own UTS namespace and hostname, so filelock cannot use
pid liveness and must judge expiry by observation). Units run longer than the lease, so only heartbeats
keep claims alive. A skewed clock must neither steal live claims nor lose its own, and a dead holder
on either side is taken over after about one lease duration — not earlier, not much later.

libfaketime fakes CLOCK_MONOTONIC too unless ``FAKETIME_DONT_FAKE_MONOTONIC=1`` (the test measures it
and records it); the protocol's expiry is on the contender's monotonic clock, so two skewed workers keep
a real monotonic clock (through tests/chaos/faketime_shim.py: libfaketime 0.9.10 breaks Python 3.11's
``time.sleep`` in that mode, wolfcw/libfaketime#426). With libfaketime's default (monotonic faked as
well) Python's timed waits hang — ``threading.Event().wait(0.5)`` never returns, measured here — which
silences filelock's heartbeat thread: that is a frozen holder (taken over after the lease, as it must
be), not a skewed clock, so such workers are not used.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckpteval.coord.results.files import ResultIndex
from tests.chaos import harness

LEASE = (3.0, 0.5)
UNIT_S = "4.0"  # longer than the lease: claims live only through heartbeats


@dataclass(frozen=True)
class Side:
    """How to start a worker: as this host, or as another host with a shifted wall clock."""

    name: str  # also the hostname for a skewed side
    offset: str | None = None  # libfaketime FAKETIME, e.g. "+10m"
    fake_monotonic: bool = False

    def env(self, unit_s: str = UNIT_S) -> dict[str, str]:
        env = harness.base_env(SUMBACKEND_DELAY_S=unit_s)
        if self.offset:
            env.update(LD_PRELOAD=str(harness.LIBFAKETIME), FAKETIME=self.offset)
            if not self.fake_monotonic:
                env["FAKETIME_DONT_FAKE_MONOTONIC"] = "1"
        return env

    def fleet(self, procs: harness.Procs, run_dir: Path, n: int = 1, unit_s: str = UNIT_S) -> harness.Fleet:
        if not self.offset:
            return harness.Fleet(procs, run_dir, n, env=self.env(unit_s), name=self.name)
        return harness.Fleet(
            procs, run_dir, n, env=self.env(unit_s), name=self.name,
            prefix=["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.name],
            module="ckpteval.jobs.cli" if self.fake_monotonic else "tests.chaos.faketime_shim",
        )


NORMAL = Side("vm")
PLUS = Side("skew-plus", "+10m")
MINUS = Side("skew-minus", "-10m")
MONO = Side("skew-mono", "+10m", fake_monotonic=True)  # only probed: its timed waits hang (see above)


def _clock_probe(side: Side) -> tuple[float, float]:
    """(wall clock offset, monotonic offset) of a process started like ``side``, in seconds."""
    code = "import time; print(time.time(), time.monotonic())"
    out = subprocess.run([harness.PYTHON, "-c", code], env=side.env(), capture_output=True, text=True, check=True)
    wall, mono = map(float, out.stdout.split())
    return wall - time.time(), mono - time.monotonic()


def _timed_wait_works(side: Side) -> bool:
    code = "import threading; threading.Event().wait(0.2); print('ok')"
    try:
        out = subprocess.run([harness.PYTHON, "-c", code], env=side.env(), capture_output=True, text=True, timeout=3)
    except subprocess.TimeoutExpired:
        return False
    return out.stdout.strip() == "ok"


def _holder(run, unit: str) -> tuple[str, int] | None:
    return harness.lease_holders(run).get(unit)


def _takeover(procs: harness.Procs, run_dir: Path, victim_side: Side, contender_side: Side) -> float:
    """A one-unit point; the victim claims it, the contender (another host) polls it; SIGKILL the victim;
    seconds until the contender holds the lease."""
    trainer = harness.InProcTrainer(run_dir, eval_interval=1, n_prompts=4, shard_size=4, lease=LEASE)
    run = trainer.run
    trainer.advance(1)
    trainer.dispatcher.exporter.wait()
    victim = victim_side.fleet(procs, run.path)
    victim.start_all()
    unit = f"{1:010d}.addition.00000"
    harness.wait_for(lambda: _holder(run, unit), 30, "the victim to claim the unit")
    contender = contender_side.fleet(procs, run.path, unit_s="0.1")
    contender.start_all()
    time.sleep(1.5)  # the contender is up and polling the held unit
    assert (_holder(run, unit) or ("",))[0].startswith(victim_side.name), "the live claim was stolen or dropped"
    victim.signal(0, signal.SIGKILL)
    killed = time.monotonic()
    harness.wait_for(lambda: (h := _holder(run, unit)) and h[0].startswith(contender_side.name), 30, "the takeover")
    took = time.monotonic() - killed
    trainer.close()
    assert contender.wait_all(60) == [0], contender.logs()
    return took


def test_clock_skew_neither_steals_nor_loses_claims(tmp_path: Path, procs: harness.Procs,
                                                   request: pytest.FixtureRequest) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux)")
    if (why := harness.ensure_libfaketime()) is not None:
        pytest.skip(why)
    if subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot create a UTS namespace here (needs root)")
    t_start = time.monotonic()
    points = harness.scaled(3, 16)
    faked_mono = _clock_probe(MONO)
    faked_mono_waits = _timed_wait_works(MONO)
    real_mono = _clock_probe(PLUS)
    assert _timed_wait_works(PLUS) and _timed_wait_works(MINUS)
    assert abs(real_mono[0] - 600) < 30 and abs(real_mono[1]) < 30, real_mono
    assert abs(_clock_probe(MINUS)[0] + 600) < 30

    # -- phase 1: a mixed fleet on one run, units longer than the lease --------------------------------
    trainer = harness.InProcTrainer(tmp_path / "run", eval_interval=1, lease=LEASE)
    run = trainer.run
    fleets = [NORMAL.fleet(procs, run.path, 2), PLUS.fleet(procs, run.path, 2), MINUS.fleet(procs, run.path)]
    for f in fleets:
        f.start_all()
    trainer.advance(points, step_s=0.3)
    trainer.run_until(lambda: not trainer.dispatcher.pending, step_s=0.1, max_s=harness.scaled(120, 400),
                      dispatch=False)
    trainer.close()
    codes = [c for f in fleets for c in f.wait_all(60)]
    logs = "\n".join(f.logs() for f in fleets)
    attempts = {p.name: p.read_text().count("\n") for p in run.leases.rglob("*.attempts")}
    by_host: dict[str, int] = {}
    skewed_stamps = 0
    for r in ResultIndex(run.results).refresh().values():
        host = r.worker.get("host", "?")
        by_host[host] = by_host.get(host, 0) + 1
        skewed_stamps += host == PLUS.name and r.written_at > time.time() + 300
    t = harness.tally(run.path, trainer.dispatched())

    # -- phase 2: a dead holder on the other side is taken over after about one lease ------------------
    takeovers = []
    pairs = [(PLUS, NORMAL), (NORMAL, MINUS)] if not harness.FULL else [(PLUS, NORMAL), (NORMAL, PLUS), (MINUS, PLUS)] * 3
    for i, (victim, contender) in enumerate(pairs):
        took = _takeover(procs, tmp_path / f"takeover-{i}", victim, contender)
        takeovers.append((f"{victim.name}→{contender.name}", took))

    harness.record(
        request.node.nodeid, "clock skew ±10 min between workers (other hosts)",
        f"3 skewed workers (2× +10 min, 1× -10 min wall clock) beside 2 normal; {len(takeovers)} cross-host "
        "SIGKILL takeovers", t, stalls=trainer.stalls, max_gap_s=trainer.max_block,
        outside_deleted=trainer.sentinel.deleted_bytes(),
        wall_s=time.monotonic() - t_start,
        notes=f"libfaketime shifts CLOCK_MONOTONIC by {faked_mono[1]:+.0f} s unless FAKETIME_DONT_FAKE_MONOTONIC=1 "
              f"(then {real_mono[1]:+.1f} s; Python's time.sleep then needs tests/chaos/faketime_shim.py, "
              f"libfaketime#426); with the faked monotonic clock a timed threading wait "
              f"{'works' if faked_mono_waits else 'hangs (no heartbeats: a frozen holder, not skew; not used)'}; each skewed worker in its own UTS namespace (another hostname: no pid "
              f"liveness shortcut); units {UNIT_S} s > lease {LEASE[0]:g} s (heartbeat {LEASE[1]:g} s); units per "
              f"host {by_host}; results stamped 10 min ahead: {skewed_stamps}; max attempts per unit "
              f"{max(attempts.values(), default=0)}; takeover after SIGKILL: "
              + ", ".join(f"{k} {v:.1f} s" for k, v in takeovers),
    )
    assert codes == [0] * 5, logs
    assert max(attempts.values()) == 1, {k: v for k, v in attempts.items() if v > 1}  # no claim stolen
    assert "lease lost" not in logs and "Traceback" not in logs and t.double_evals == 0
    assert {PLUS.name, MINUS.name} <= set(by_host), by_host  # the skewed workers did work
    assert skewed_stamps > 0  # their clocks really were 10 minutes ahead
    assert t.lost == [] and t.skips == {} and t.units_without_result == [] and t.dup_ingestions == 0, t
    assert trainer.stalls == 0, trainer.max_block
    assert trainer.sentinel.deleted_bytes() == 0
    for kind, took in takeovers:  # the contender watched the dead claim for a lease duration, no more
        assert LEASE[0] - LEASE[1] - 0.3 <= took <= LEASE[0] + 4.0, (kind, took)
