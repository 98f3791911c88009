"""A full staging filesystem (a real size-limited tmpfs, mounted here as root).

(a) ``ckpteval train`` exports into a 96 MiB tmpfs that a ballast file fills to the last byte, then frees
    (``cycles`` times): while full, points are ``export_failed`` (the room check refuses before writing)
    and training goes on; once room returns, exports land again, and the final point lands.
(b) A 2 MiB tmpfs and a room check that passes (another writer fills the disk after the check, the
    documented limit of the check): every export hits a real ENOSPC mid-write and becomes
    ``export_failed`` — including the final point, the documented rule — with no partial snapshot or
    temp dir left behind and no stall.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos import harness


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[callable]:
    mounted: list[Path] = []

    def mount(name: str, size: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a size-limited tmpfs here ({proc.stderr.strip()}); needs root")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(directory: Path) -> int:
    """Write a ballast file until the filesystem is full (ENOSPC); returns its size."""
    n = 0
    chunk = b"\0" * (1 << 20)
    with open(directory / "ballast", "ab") as f:
        while True:
            try:
                n += os.write(f.fileno(), chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
    return n


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _export_outcomes(run_dir: Path) -> tuple[list[int], list[int]]:
    """(steps exported, steps skipped export_failed) from the trainer's ledger."""
    recs = harness.read_jsonl_tolerant(run_dir / "ledger.jsonl")
    return ([r["step"] for r in recs if r.get("event") == "exported"],
            [r["step"] for r in recs if r.get("event") == "skipped" and r.get("reason") == "export_failed"])


def test_full_staging_filesystem(tmp_path: Path, procs: harness.Procs, tmpfs,
                                 request: pytest.FixtureRequest) -> None:
    cycles = harness.scaled(1, 3)
    t_start = time.monotonic()
    sentinel = harness.Sentinel(tmp_path / "outside")

    # -- (a) a real trainer, its staging tmpfs full and then not ------------------------------------------
    stage = tmpfs("stage", "96m")
    staging = stage / "snapshots"
    staging.mkdir()
    os.symlink(sentinel.root, staging / "step-0000000001")  # GC must never follow it
    run_dir = tmp_path / "run"
    steps = harness.scaled(800, 2400)
    filled = fill(stage)
    assert free_bytes(stage) < 1 << 20
    trainer = procs.cli(*harness.train_argv(
        run_dir, "--steps", str(steps), "--eval-interval", "10", "--eval-staging-dir", str(staging),
        "--eval-max-in-flight", "3", "--eval-keep-snapshots", "3", "--ckpt-interval", "1000"), name="train")
    monitor = harness.ProgressMonitor(run_dir / "metrics.jsonl")
    monitor.start()
    harness.wait_for(lambda: (run_dir / "run.json").exists() or trainer.poll() is not None, 60, "run.json")
    fleet = harness.Fleet(procs, run_dir, 2, env=harness.base_env(SUMBACKEND_DELAY_S="0.05"))
    fleet.start_all()
    phases = []
    try:
        for c in range(cycles):
            failed0 = len(_export_outcomes(run_dir)[1])
            harness.wait_for(lambda f=failed0: len(_export_outcomes(run_dir)[1]) >= f + 2 or trainer.poll() is not None,
                             120, "export_failed points while the staging fs is full")
            (stage / "ballast").unlink()  # room returns
            phases.append(f"full until step {monitor.last_step()}")
            if c == cycles - 1:
                break
            exported0 = len(_export_outcomes(run_dir)[0])
            harness.wait_for(lambda e=exported0: len(_export_outcomes(run_dir)[0]) >= e + 2 or trainer.poll() is not None,
                             120, "exports after room returned")
            filled += fill(stage)
        code = procs.wait(trainer, 300)
        fleet_codes = fleet.wait_all(120)
    finally:
        monitor.stop.set()
    exported, failed = _export_outcomes(run_dir)
    expected_a = list(range(10, steps + 1, 10))
    ta = harness.tally(run_dir, expected_a)
    leftovers_a = [p.name for p in staging.rglob(".tmp-*")]  # snapshots live in staging/<run key>/

    # -- (b) the room check passes, the write hits ENOSPC ------------------------------------------------
    small = tmpfs("small", "2m")
    inproc = harness.InProcTrainer(tmp_path / "run-enospc", eval_interval=2, staging_dir=small,
                                   room_check=lambda _path, _n: True)
    inproc.advance(harness.scaled(10, 40))
    inproc.close()
    tb = harness.tally(inproc.run.path, inproc.dispatched())
    messages = [r.get("message", "") for r in harness.read_jsonl_tolerant(inproc.run.ledger_path)
                if r.get("event") == "skipped" and r.get("reason") == "export_failed"]
    leftovers_b = sorted(p.name for p in small.rglob("*")  # the run-scoped subdir itself is no leftover
                         if not p.is_symlink() and (p.is_file() or p.name.startswith(".tmp-")))

    merged = ta.merged(tb, step_offset=100_000)
    outside = sentinel.deleted_bytes() + inproc.sentinel.deleted_bytes()
    harness.record(
        request.node.nodeid, "full staging filesystem (tmpfs)",
        f"{cycles}× 96 MiB tmpfs filled to the last byte ({filled >> 20} MiB ballast) then freed; "
        f"{len(tb.expected)} exports into a full 2 MiB tmpfs (real ENOSPC mid-write)", merged,
        stalls=monitor.stalls() + inproc.stalls, max_gap_s=max(monitor.max_gap(), inproc.max_block),
        outside_deleted=outside, wall_s=time.monotonic() - t_start,
        notes=f"trainer process: {len(failed)} export_failed while full ({'; '.join(phases)}), {len(exported)} "
              f"exported, final point {'ok' if steps in ta.ok else 'NOT ok'}; ENOSPC run: every point "
              "export_failed incl. the final one (the documented rule: export failures are skips), no temp "
              "dir left behind; a symlink in the staging root to the outside sentinel survived GC",
    )
    assert code == 0, procs.tail(trainer)
    assert fleet_codes == [0, 0], fleet.logs()
    assert len(failed) >= 2 * cycles and set(ta.skips) <= {"export_failed"}, ta.skips
    assert steps in ta.ok  # room returned: the final point landed
    assert ta.lost == [] and ta.units_without_result == [] and ta.dup_ingestions == 0, ta
    assert leftovers_a == [], leftovers_a
    assert monitor.stalls() == 0, monitor.gaps()
    assert tb.skips == {"export_failed": len(tb.expected)} and tb.lost == [] and tb.dup_ingestions == 0, tb
    assert messages and all("No space left" in m for m in messages), messages
    assert leftovers_b == [], leftovers_b  # the failed exports cleaned up their temp dirs
    assert inproc.stalls == 0, inproc.max_block
    assert outside == 0
