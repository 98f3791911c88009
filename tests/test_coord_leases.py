"""Leases under real concurrency: racing processes, SIGKILL and SIGSTOP of holders.

Every process here is a real OS process; "another node" is a real process in its own UTS namespace
(``unshare --uts`` with a different hostname), which is part of what the lease uses to tell hosts apart.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ckpteval.coord.results.files import ResultIndex, ok_result, write_result
from ckpteval.coord.run.manifest import LeaseSettings
from ckpteval.coord.work.claims import UnitClaimer, lease_holders, lease_path, read_lease_holder
from ckpteval.coord.work.units import WorkUnit

ROOT = Path(__file__).parents[1]


def _race_worker(leases: str, results: str, units: list[tuple[int, str, int]], seed: int) -> None:
    import random

    claimer = UnitClaimer(Path(leases), LeaseSettings(30.0, 5.0), results_dir=Path(results))
    index = ResultIndex(Path(results))
    todo = [WorkUnit(*u) for u in units]
    random.Random(seed).shuffle(todo)
    while todo:
        done = index.refresh()
        todo = [u for u in todo if u not in done]
        for unit in todo:
            if index.get(unit) is not None:
                continue
            claim = claimer.try_claim(unit)
            if claim is None:
                continue
            if not claim.compromised.is_set():
                write_result(Path(results), ok_result(unit, [1.0], [str(unit.step)], lease_token=claim.token))
            claim.release()
            break
        else:
            time.sleep(0.01)


def test_eight_processes_race_for_200_units(tmp_path: Path) -> None:
    leases, results = tmp_path / "leases", tmp_path / "results"
    leases.mkdir()
    results.mkdir()
    units = [(step, "ds", shard) for step in range(20) for shard in range(10)]
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_race_worker, args=(str(leases), str(results), units, i)) for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    files = list(results.glob("step-*/*.json"))  # per-step directories (protocol 2, the default)
    assert len(files) == 200
    got = ResultIndex(results).refresh()
    assert sorted((u.step, u.dataset, u.shard) for u in got) == sorted(units)
    # no lease was compromised (30 s leases, sub-second units), so there is no duplicate either
    assert not (results / "duplicates").exists()


HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from ckpteval.coord.run.manifest import LeaseSettings
    from ckpteval.coord.work.claims import UnitClaimer
    from ckpteval.coord.work.units import WorkUnit
    claimer = UnitClaimer(Path(sys.argv[1]), LeaseSettings(float(sys.argv[2]), float(sys.argv[2]) / 6))
    claim = claimer.try_claim(WorkUnit(1, "ds", 0))
    print("held" if claim else "busy", flush=True)
    time.sleep(600)
    """
)


def _start_holder(leases: Path, duration: float, other_host: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-c", HOLDER, str(leases), str(duration)]
    if other_host:
        cmd = ["unshare", "--uts", "sh", "-c", 'hostname other-node && exec "$@"', "sh", *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"held"
    return proc


def _seconds_until_claimed(leases: Path, duration: float, limit: float) -> float:
    claimer = UnitClaimer(leases, LeaseSettings(duration, duration / 6))
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if (claim := claimer.try_claim(WorkUnit(1, "ds", 0))) is not None:
            claim.release()
            return time.monotonic() - t0
        time.sleep(0.1)
    return float("inf")


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare(1) to run a holder as another host")
def test_sigkilled_holder_on_another_node_is_taken_over_after_expiry_not_before(tmp_path: Path) -> None:
    duration = 3.0
    holder = _start_holder(tmp_path, duration, other_host=True)
    try:
        claimer = UnitClaimer(tmp_path, LeaseSettings(duration, duration / 6))
        assert claimer.try_claim(WorkUnit(1, "ds", 0)) is None  # live claim: refused
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        waited = _seconds_until_claimed(tmp_path, duration, limit=30)
    finally:
        holder.kill()
    assert duration * 0.95 <= waited < duration + 10  # not before expiry, but soon after it


def test_sigstopped_holder_keeps_claim_until_expiry(tmp_path: Path) -> None:
    duration = 3.0
    holder = _start_holder(tmp_path, duration, other_host=False)
    try:
        holder.send_signal(signal.SIGSTOP)  # alive but silent: a hung node
        waited = _seconds_until_claimed(tmp_path, duration, limit=30)
    finally:
        holder.kill()
        holder.wait()
    assert duration * 0.95 <= waited < duration + 10


def test_sigkilled_holder_on_same_host_is_taken_over_at_once(tmp_path: Path) -> None:
    """The contender sees the holder's pid is dead on this host and does not wait for expiry."""
    holder = _start_holder(tmp_path, 60.0, other_host=False)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert _seconds_until_claimed(tmp_path, 60.0, limit=20) < 20


def test_compromised_claim_is_flagged(tmp_path: Path) -> None:
    """A holder whose claim was taken over (it stalled past expiry) learns it must abandon the unit."""
    duration = 2.0
    settings = LeaseSettings(duration, 0.5)
    mine = UnitClaimer(tmp_path, settings).try_claim(WorkUnit(3, "ds", 0))
    assert mine is not None
    # simulate the stall from the contender's side: replace the marker like a takeover does
    lock = lease_path(tmp_path, WorkUnit(3, "ds", 0).id, 3)
    lock.unlink()
    lock.write_text("someone else")
    deadline = time.monotonic() + 10
    while not mine.compromised.is_set() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert mine.compromised.is_set()
    mine.release()


def test_lease_holder_is_read_from_the_lease_record(tmp_path: Path) -> None:
    """The holder (pid, host, token) comes from the record the claim wrote; no file means nobody holds it."""
    unit = WorkUnit(4, "ds", 1)
    claim = UnitClaimer(tmp_path, LeaseSettings(30.0, 5.0)).try_claim(unit)
    assert claim is not None
    try:
        holder = read_lease_holder(lease_path(tmp_path, unit.id, unit.step))
        assert holder is not None
        assert (holder.pid, holder.token) == (os.getpid(), claim.token)
        assert {u: r.pid for u, r in lease_holders(tmp_path).items()} == {unit.id: os.getpid()}
    finally:
        claim.release()
    with pytest.raises(FileNotFoundError):
        read_lease_holder(lease_path(tmp_path, unit.id, unit.step))
    assert lease_holders(tmp_path) == {}
    lease_path(tmp_path, unit.id, unit.step).write_bytes(b"pid=12")  # torn: no complete record
    assert read_lease_holder(lease_path(tmp_path, unit.id, unit.step)) is None


STALLED_HOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from ckpteval.coord.run.manifest import LeaseSettings
    from ckpteval.coord.work.claims import UnitClaimer
    from ckpteval.coord.work.units import WorkUnit
    claimer = UnitClaimer(Path(sys.argv[1]), LeaseSettings(float(sys.argv[2]), float(sys.argv[2]) / 6))
    claim = claimer.try_claim(WorkUnit(1, "ds", 0))
    print("held" if claim else "busy", flush=True)
    sys.stdin.readline()  # SIGSTOPped and continued before this line arrives
    print("ours" if claim.still_ours() else "lost", flush=True)
    claim.release()
    print("released", flush=True)
    """
)


def test_stalled_holder_learns_it_lost_and_its_release_keeps_the_successors_marker(tmp_path: Path) -> None:
    """A holder stopped past expiry, continued after a takeover: it sees the claim is not its own any more,
    and its release (no longer fresh, so checked) leaves the new holder's marker in place."""
    duration = 2.0
    proc = subprocess.Popen([sys.executable, "-c", STALLED_HOLDER, str(tmp_path), str(duration)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None and proc.stdin is not None
    try:
        assert proc.stdout.readline().strip() == b"held"
        proc.send_signal(signal.SIGSTOP)
        claimer = UnitClaimer(tmp_path, LeaseSettings(duration, duration / 6))
        deadline = time.monotonic() + 30
        while (claim := claimer.try_claim(WorkUnit(1, "ds", 0))) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert claim is not None, "the stalled holder's lease was never taken over"
        proc.send_signal(signal.SIGCONT)
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == b"lost"
        assert proc.stdout.readline().strip() == b"released"
        holder = read_lease_holder(lease_path(tmp_path, "0000000001.ds.00000", 1))
        assert holder is not None and holder.token == claim.token  # the successor's marker survived
        assert claim.still_ours()
        claim.release()
    finally:
        proc.kill()
        proc.wait()


def test_takeover_that_moved_a_renewed_marker_puts_it_back(tmp_path: Path) -> None:
    """Two contenders watched the same expired marker; the first took it over. The second's takeover
    (it still believes the old marker is there) moves the new one aside, sees it is not the marker it
    watched, and links it back: the new holder keeps its claim and its inode."""
    from ckpteval.coord.work.lease import LeaseKeeper, UnitLease

    path = tmp_path / "u.lock"
    path.write_text("torn")  # a marker nobody refreshes
    keeper = LeaseKeeper(60.0)
    first, second = UnitLease(path, 0.2, keeper), UnitLease(path, 0.2, keeper)
    assert not first.acquire() and not second.acquire()  # both start watching the old marker
    old = os.lstat(path)
    time.sleep(0.3)
    assert first.acquire()  # expired: taken over
    new = os.lstat(path)
    assert second._move_aside((old.st_dev, old.st_ino, old.st_mtime_ns, old.st_ctime_ns)) is False
    assert os.lstat(path).st_ino == new.st_ino and first.still_ours()
    assert [p.name for p in tmp_path.iterdir()] == ["u.lock"]  # nothing left aside
    first.release()
    assert not path.exists()


def test_marker_with_another_lease_duration_is_refused_naming_the_file(tmp_path: Path) -> None:
    from ckpteval.coord.work.lease import LeaseMismatch

    holder = UnitClaimer(tmp_path, LeaseSettings(30.0, 5.0)).try_claim(WorkUnit(2, "ds", 0))
    assert holder is not None
    try:
        with pytest.raises(LeaseMismatch, match=r"0000000002\.ds\.00000\.lock.*30\.0"):
            UnitClaimer(tmp_path, LeaseSettings(60.0, 5.0)).try_claim(WorkUnit(2, "ds", 0))
    finally:
        holder.release()


def test_contender_looks_at_a_held_unit_once_per_recheck(tmp_path: Path) -> None:
    """A unit found held is refused without a look (no syscall) for recheck_s (half the heartbeat), so a
    fleet polling one step does not stat every held lease on every poll; after that it is looked at again
    and, released meanwhile, claimed."""
    settings = LeaseSettings(4.0, 0.4)
    unit = WorkUnit(5, "ds", 0)
    holder, contender = UnitClaimer(tmp_path, settings), UnitClaimer(tmp_path, settings)
    assert contender.recheck_s == pytest.approx(0.2)
    held = holder.try_claim(unit)
    assert held is not None and contender.try_claim(unit) is None
    assert contender.seen_held_lately(unit)
    held.release()
    assert contender.try_claim(unit) is None  # within recheck_s: not looked at, so not seen free
    time.sleep(0.25)
    assert not contender.seen_held_lately(unit)
    claim = contender.try_claim(unit)
    assert claim is not None
    claim.release()


def test_a_walk_lists_a_contended_step_once_and_passes_over_its_held_units(tmp_path: Path) -> None:
    """claim_next: after the first held unit of a step, the walk lists the step's leases and tries only the
    units not listed (and those it watches for expiry); a walk that finds nothing free looks at them all."""
    from collections import deque

    settings = LeaseSettings(30.0, 5.0)
    units = [WorkUnit(7, "ds", s) for s in range(8)]
    holder, contender = UnitClaimer(tmp_path, settings), UnitClaimer(tmp_path, settings)
    held = [holder.try_claim(u) for u in units[:6]]
    try:
        claim = contender.claim_next(deque(units), {})
        assert claim is not None and claim.unit == units[6]
        tried = {u for u in units[1:6] if u.id in contender._leases}
        assert tried == {u for u in units[1:6] if contender._watches(u, 6)}  # the others: passed over, no syscall
        claim.release()
        idle = UnitClaimer(tmp_path, settings)
        assert idle.claim_next(deque(units[:6]), {}) is None
        assert all(idle.seen_held_lately(u) for u in units[:6])  # nothing free: every held unit looked at
    finally:
        for c in held:
            assert c is not None
            c.release()


def test_coord_and_jobs_use_no_private_filelock_name() -> None:
    """The lease format and liveness check are ckpteval's own (coord/work/lease.py): no module of coord/ or
    jobs/ imports or touches a private filelock name (``filelock._identity``, ``filelock._soft``, ...), so
    no filelock release can break a claim."""
    import ast

    used = []
    for path in sorted([*(ROOT / "coord").rglob("*.py"), *(ROOT / "jobs").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "filelock":
                names = [f"filelock.{node.attr}"]
            used += [f"{path.relative_to(ROOT)}: {n}" for n in names
                     if n.split(".")[0] == "filelock" and any(part.startswith("_") for part in n.split(".")[1:])]
    assert used == []


def test_a_record_in_another_format_counts_as_held_and_expires(tmp_path: Path) -> None:
    """A lease file holding filelock's owner record (what an older ckpteval wrote) is no holder record:
    not parsed as one, not taken over at once although its pid is dead here, taken over once expired."""
    from ckpteval.coord.work.lease import LeaseKeeper, UnitLease

    path = tmp_path / "u.lock"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path.write_text(f"filelock/2\npid={dead.pid}\nhost={os.uname().nodename}\nmode=lease\ntoken=ab\nduration=0.3\n")
    assert read_lease_holder(path) is None
    lease = UnitLease(path, 0.3, LeaseKeeper(60.0))
    assert not lease.acquire()  # a holder dead on this host would be taken over here: this is no holder
    time.sleep(0.4)
    assert lease.acquire()
    lease.release()


def test_liveness_takes_over_only_a_dead_or_recycled_pid_of_this_host(tmp_path: Path) -> None:
    """dead_here: our host and a gone pid, or our host and a pid now naming a process started at another
    time (recycled); never another host's holder, never a live one."""
    from ckpteval.coord.work.lease import LeaseHolder, host_identity, process_start

    me = os.getpid()
    here = host_identity()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert LeaseHolder(dead.pid, "h", here, "t", 60.0, None).dead_here()
    assert not LeaseHolder(dead.pid, "h", here + "x", "t", 60.0, None).dead_here()  # another host: wait
    assert not LeaseHolder(me, "h", here, "t", 60.0, process_start(me)).dead_here()  # alive
    if process_start(me) is None:
        pytest.skip("no /proc/<pid>/stat start time on this platform: a recycled pid waits for expiry")
    assert LeaseHolder(me, "h", here, "t", 60.0, process_start(me) + 1).dead_here()  # recycled pid
