"""Worker processes (``python -m ckpteval.jobs.cli worker``) sharing runs: fleets, kills, stalls, preemption.

Real processes, real leases (filelock SoftFileLease), real snapshots of the tiny model. The backend is
the real fn backend ``tests.support.workers:SumBackend`` (it reads the snapshot's safetensors), with a per-
unit delay where a test needs to catch a worker mid-unit; it keeps these tests fast on 2 cores, where
every HF-engine process would pay ~4 s of torch import.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from ckpteval.coord.run.manifest import LeaseSettings
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.lifecycle import EXIT_DONE, EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_USAGE
from tests.support.workers import (
    claimed_at,
    counted_claimers,
    duplicates,
    finish,
    kill_all,
    lease_holder_pid,
    make_eval_run,
    publish_model,
    results,
    spawn,
    wait_for,
)

FN = "fn:tests.support.workers:SumBackend"


def _worker(run_dir: Path, *extra: str, env: dict[str, str] | None = None):
    return spawn("worker", "--run-dir", str(run_dir), "--engine", FN, "--poll-interval", "0.1", *extra, env=env)


def test_three_workers_share_twenty_snapshots_exactly_once(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=8, shard_size=4, engine={"fn": {"delay_s": 0.05}})
    procs = [_worker(run.path, "--worker-id", f"w{i}") for i in range(3)]
    try:
        for step in range(10, 210, 10):  # the trainer publishes while the fleet runs
            publish_model(tmp_path, run.snapshots, step)
            time.sleep(0.05)
        run.mark_training_done(200)
        outs = [finish(p, timeout=60) for p in procs]
    finally:
        kill_all(procs)
    assert [code for code, _ in outs] == [EXIT_DONE] * 3, outs
    got = results(run)
    assert sorted(got) == [WorkUnit(s, "addition", i) for s in range(10, 210, 10) for i in (0, 1)]
    assert all(r.ok and set(r.weight_versions) == {str(r.unit.step)} for r in got.values())
    assert duplicates(run) == []  # every unit evaluated exactly once
    per_worker = Counter(r.worker["worker_id"] for r in got.values())
    assert sum(per_worker.values()) == 40 and len(per_worker) >= 2, per_worker
    lines = [line for _, out in outs for line in out.splitlines() if line.startswith("step=")]
    assert len(lines) == 40  # one line per unit


def _wait_mid_unit(run, proc, timeout: float = 20) -> str:
    """The id of the unit ``proc`` holds a lease on, once its claim is counted (it is mid-unit).

    Waits for both events, not just the lease: a claim is counted (``<unit>.attempts``) just *after* the
    lease is taken, and a worker killed between the two leaves no attempt behind (a load-dependent race
    the attempt-count assertions below once lost).
    """
    def held() -> str | None:
        unit = next((u for u, pid in lease_holder_pid(run).items() if pid == proc.pid), None)
        return unit if unit is not None and proc.pid in counted_claimers(run, unit) else None

    return wait_for(held, timeout, what=f"worker {proc.pid} to claim a unit")


def test_sigkilled_worker_loses_nothing(tmp_path: Path) -> None:
    lease = LeaseSettings(60.0, 0.5)  # long: a takeover before expiry is unmistakable even under load
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4, lease=lease, engine={"fn": {"delay_s": 1.5}})
    for step in (1, 2):
        publish_model(tmp_path, run.snapshots, step)
    a = _worker(run.path, "--once", "--worker-id", "a")
    procs = [a]
    try:
        unit_id = _wait_mid_unit(run, a)
        a.send_signal(signal.SIGKILL)
        killed = time.time()
        a.communicate()
        b = _worker(run.path, "--once", "--worker-id", "b")
        procs.append(b)
        code, out = finish(b, timeout=30)
    finally:
        kill_all(procs)
    assert code == EXIT_DONE, out
    got = results(run)
    assert len(got) == 2 and all(r.ok and r.worker["worker_id"] == "b" for r in got.values())
    taken = got[WorkUnit.from_id(unit_id)]
    assert taken.attempt == 2 and counted_claimers(run, unit_id) == [a.pid, b.pid]  # A's claim was attempt 1
    # same host, dead pid: filelock takes over at once, no lease expiry wait
    assert claimed_at(taken) - killed < lease.duration_s / 2, claimed_at(taken) - killed
    assert duplicates(run) == []


def test_stalled_worker_is_taken_over_after_expiry_not_before(tmp_path: Path) -> None:
    duration = 3.0
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4, lease=LeaseSettings(duration, 0.5),
                        engine={"fn": {"delay_s": 2.5}})
    publish_model(tmp_path, run.snapshots, 1)
    a = _worker(run.path, "--once", "--worker-id", "a")
    procs = [a]
    try:
        unit_id = _wait_mid_unit(run, a)
        a.send_signal(signal.SIGSTOP)  # alive, holding the lease, no heartbeat
        stopped = time.time()
        b = _worker(run.path, "--once", "--worker-id", "b")
        procs.append(b)
        _wait_mid_unit(run, b, timeout=20)  # b took the unit over
        took_over = time.time()
        a.send_signal(signal.SIGCONT)  # a resumes mid-unit, its claim lost
        time.sleep(0.5)
        assert lease_holder_pid(run).get(unit_id) == b.pid  # a's release did not remove b's lease
        code_b, out_b = finish(b, timeout=30)
        code_a, out_a = finish(a, timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        kill_all(procs)
    assert took_over - stopped >= duration, took_over - stopped
    (r,) = results(run).values()
    assert r.worker["worker_id"] == "b" and claimed_at(r) - stopped >= duration - 0.05
    assert code_a == code_b == EXIT_DONE, (out_a, out_b)
    assert "abandoned: lease lost" in out_a and duplicates(run) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_preempted_worker_releases_at_once_and_exits_3(tmp_path: Path, sig: signal.Signals) -> None:
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4, lease=LeaseSettings(60.0, 10.0))
    publish_model(tmp_path, run.snapshots, 1)
    a = _worker(run.path, "--worker-id", "a", env={"SUMBACKEND_DELAY_S": "30"})
    procs = [a]
    try:
        unit_id = _wait_mid_unit(run, a)
        sent = time.monotonic()
        a.send_signal(sig)
        code_a, out_a = finish(a, timeout=25)
        exited = time.monotonic() - sent
        assert unit_id not in lease_holder_pid(run)  # released, not left to expire
        b = _worker(run.path, "--once", "--worker-id", "b")
        procs.append(b)
        code_b, out_b = finish(b, timeout=20)
        took_over = time.monotonic() - sent
    finally:
        kill_all(procs)
    assert code_a == EXIT_PREEMPTED and "abandoned: stop signal" in out_a, out_a
    assert exited < 25.0, exited  # abandoned mid-unit: the unit itself takes 30 s
    assert code_b == EXIT_DONE, out_b
    (r,) = results(run).values()
    assert r.worker["worker_id"] == "b" and r.attempt == 2
    assert took_over < 20.0  # long before the 60 s lease would have expired


@pytest.mark.parametrize(("command", "sig", "code"), [
    ("worker", signal.SIGINT, EXIT_INTERRUPTED), ("backfill", signal.SIGINT, EXIT_INTERRUPTED),
    ("backfill", signal.SIGTERM, EXIT_PREEMPTED),
])
def test_stop_signal_mid_unit_says_so_in_one_line(tmp_path: Path, command: str, sig: int, code: int) -> None:
    """Ctrl-C (or SIGTERM) to a worker or backfill mid-unit: the lease is released, the exit code says which
    signal, one line says it stopped and how to continue, and no traceback (KeyboardInterrupt) is printed."""
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4, lease=LeaseSettings(60.0, 10.0))
    publish_model(tmp_path, run.snapshots, 1)
    proc = spawn(command, "--run-dir", str(run.path), "--engine", FN, "--poll-interval", "0.1",
                 env={"SUMBACKEND_DELAY_S": "30"})
    try:
        _wait_mid_unit(run, proc)
        proc.send_signal(sig)
        got, out = finish(proc, timeout=25)
    finally:
        kill_all([proc])
    assert got == code, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    name = signal.Signals(sig).name
    assert [line for line in out.splitlines() if "stopped by" in line] == [
        f"ckpteval {command}: stopped by {name}: leases released, nothing lost; run it again to continue"], out
    assert lease_holder_pid(run) == {}  # released, not left to expire


def test_cli_usage(tmp_path: Path) -> None:
    code, out = finish(spawn("worker", "--help"), timeout=20)
    assert code == 0 and "--catchup" in out and "exit codes: 0 done" in out and "3 preempted" in out
    code, out = finish(spawn("worker", "--run-dir", str(tmp_path), "--engines", "0"), timeout=20)
    assert code == EXIT_USAGE and "--engines must be >= 1" in out
    code, out = finish(spawn("worker", "--run-dir", str(tmp_path / "none"), "--engine", FN), timeout=20)
    assert code == EXIT_USAGE and "no run.json" in out
    code, out = finish(spawn("worker", "--run-dir", str(tmp_path), "--engine", "fn:x:Y", "--engines", "2"), 20)
    assert code == EXIT_USAGE and "exactly one --engine fn" in out


def _catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler installed for ``sig`` (SigCgt in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_preempted_while_starting_up_exits_for_requeue(tmp_path: Path, sig: int) -> None:
    """A stop signal during start-up (imports, engine build: seconds with torch) is not fatal: the worker
    exits with EXIT_PREEMPTED, as SLURM's requeue logic expects, instead of dying by the signal."""
    from tests.support.workers import make_eval_run

    run = make_eval_run(tmp_path)
    proc = spawn("worker", "--run-dir", str(run.path), "--engine", "hf", "--poll-interval", "0.2")
    try:
        wait_for(lambda: _catches(proc.pid, sig), 30, interval=0.01, what="the early stop handler")
        proc.send_signal(sig)
        code, out = finish(proc, timeout=60)
    finally:
        kill_all([proc])
    assert code == EXIT_PREEMPTED, out


def test_ctrl_c_during_a_generation_ends_with_the_stop_line_not_a_failed_close(tmp_path: Path) -> None:
    """SIGINT while the in-process HF engine is generating (a long generation holds the engine's lock past the
    close's bound): the close it interrupts is not a failure — the worker's stop line ends it, no 'failed'."""
    run = make_eval_run(tmp_path, n_prompts=1024, shard_size=1024, max_new_tokens=56,  # the context's whole room
                        lease=LeaseSettings(60.0, 10.0))
    publish_model(tmp_path, run.snapshots, 1)
    proc = spawn("worker", "--run-dir", str(run.path), "--engine", "hf", "--poll-interval", "0.1")
    try:
        _wait_mid_unit(run, proc, timeout=120)
        time.sleep(1.0)  # into the generation itself, past the load
        proc.send_signal(signal.SIGINT)
        got, out = finish(proc, timeout=60)
    finally:
        kill_all([proc])
    assert got == EXIT_INTERRUPTED, out
    assert "failed" not in out and "Traceback" not in out, out
    assert out.rstrip().splitlines()[-1] == ("ckpteval worker: stopped by SIGINT: leases released, nothing lost; "
                                              "run it again to continue"), out
    assert lease_holder_pid(run) == {}
