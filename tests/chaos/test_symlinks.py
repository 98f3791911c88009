"""Symlinks in the staging root pointing outside it, while the trainer's GC runs on every ingestion.

Planted once some points are retired (so the fakes claim *retired* steps, the ones GC deletes):
a symlink named like a snapshot to an outside directory holding a valid-looking staging marker and the
sentinel files; a symlinked ``.tmp-step-*`` (old enough for the stale-temp rule) to an outside directory;
a symlink to an outside file; a real directory inside the root with a staging marker of a retired step
whose contents are symlinks to outside files and directories (GC may delete the directory — it is inside
the root — but never what its links point to); and a symlink squatting on the name a *future* snapshot
will be published under. Every byte outside the staging root must survive.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ckpteval.coord.atomic import write_json_atomic
from ckpteval.coord.snapshots.snapshot import MARKER, Marker, snapshot_dirname
from tests.chaos import harness


def _staging_marker(directory: Path, step: int) -> None:
    write_json_atomic(directory / MARKER, Marker(step, str(step), {}, {"host": "elsewhere"}, "staging", 0.0).to_json())


def test_symlinks_out_of_the_staging_root(tmp_path: Path, procs: harness.Procs,
                                         request: pytest.FixtureRequest) -> None:
    t_start = time.monotonic()
    outside = tmp_path / "outside"
    sentinels = [harness.Sentinel(outside / f"d{i}") for i in range(4)]
    _staging_marker(sentinels[0].root, 2)  # looks like the retired snapshot of step 2
    trainer = harness.InProcTrainer(tmp_path / "run", eval_interval=2, max_in_flight=2, keep=2)
    root = trainer.run.snapshots
    squat_step = 2 * harness.scaled(8, 30)
    fleet = harness.Fleet(procs, trainer.run.path, 2, env=harness.base_env(SUMBACKEND_DELAY_S="0.05"))
    fleet.start_all()
    planted: list[str] = []

    def plant() -> None:
        os.symlink(sentinels[0].root, root / snapshot_dirname(902))
        os.symlink(sentinels[1].root, root / ".tmp-step-0000000903.evil")
        os.symlink(next(iter(sentinels[2].files)), root / snapshot_dirname(905))
        inside = root / snapshot_dirname(904)
        inside.mkdir()
        _staging_marker(inside, 4)
        os.symlink(sentinels[3].root, inside / "weights")
        os.symlink(next(iter(sentinels[2].files)), inside / "model.safetensors")
        os.symlink(sentinels[3].root, root / snapshot_dirname(squat_step))  # a future snapshot's name
        planted.extend(["snapshot-named link to a marked outside dir", "stale .tmp link to an outside dir",
                        "link to an outside file", "dir inside with links out", "link squatting a future name"])

    retired = trainer.dispatcher.ledger.state.retired
    trainer.run_until(lambda: {2, 4} <= retired, step_s=0.05, max_s=60)
    plant()
    final = squat_step + 2 * harness.scaled(6, 20)
    trainer.run_until(lambda: trainer.step >= final, step_s=0.05, max_s=harness.scaled(120, 400))
    trainer.close()
    codes = fleet.wait_all(60)
    t = harness.tally(trainer.run.path, trainer.dispatched())
    deleted_outside = sum(s.deleted_bytes() for s in [*sentinels, trainer.sentinel])
    gc_deleted = [s for s in range(2, final + 1, 2) if not (root / snapshot_dirname(s)).exists()]
    links_left = sorted(p.name for p in root.iterdir() if p.is_symlink())
    harness.record(
        request.node.nodeid, "symlinks out of the staging root",
        f"{len(planted)} planted ({'; '.join(planted)})", t, stalls=trainer.stalls, max_gap_s=trainer.max_block,
        outside_deleted=deleted_outside, wall_s=time.monotonic() - t_start,
        notes=f"GC ran on every ingestion and deleted {len(gc_deleted)} retired snapshots meanwhile; the links "
              f"were left in place ({len(links_left)}); the export of step {squat_step}, whose name a link "
              f"squatted, became {sorted(r for r, s in t.skip_steps.items() if squat_step in s) or 'ok'}; "
              f"{sum(s.total for s in sentinels)} sentinel bytes outside",
    )
    assert codes == [0, 0], fleet.logs()
    assert deleted_outside == 0
    assert len(gc_deleted) >= 3  # GC was active while the links were there
    assert set(links_left) >= {snapshot_dirname(902), snapshot_dirname(905), ".tmp-step-0000000903.evil"}
    assert t.lost == [] and t.dup_ingestions == 0 and t.units_without_result == [], t
    assert set(t.skips) <= {"export_failed"} and t.skip_steps.get("export_failed", [squat_step]) == [squat_step], t
    assert trainer.stalls == 0, trainer.max_block
