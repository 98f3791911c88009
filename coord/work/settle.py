"""Settling an ended run: units whose snapshot is gone for good become ``ckpt_missing`` results.

Owns :func:`settle_vanished`. When a run has *ended* (``RUN/INTERRUPTED`` or ``RUN/TRAINING_DONE``, see
:meth:`ckpteval.coord.run.rundir.RunDir.ended`) no trainer will publish another snapshot, so a unit without a result
whose dispatched step has no complete snapshot under any of the run's ``snapshot_roots`` can never be
evaluated: left alone it would stay "pending" in ``ckpteval status`` forever while ``ckpteval backfill``
(which only evaluates snapshots that exist) says there is nothing to do. Writing its ``ckpt_missing``
skip makes every reader agree.

Guarantee: only units *without* a result get one (first-writer-wins, so a result written concurrently
wins), only for steps the trainer's ledger says it dispatched (a service run's watched checkpoints are
not the trainer's to settle), only when the run has ended. Limits: it trusts this host's view of the
snapshot roots; call it only when nothing publishes into them any more (the supervisor has stopped its
trainer and removed its staging) — the worker's own path for a missing snapshot
(:mod:`ckpteval.jobs.eval.worker.loop`, after one lease duration) covers shared filesystems with slow visibility.
"""

from __future__ import annotations

from pathlib import Path

from ckpteval.coord.results.files import ResultIndex, skip_result, write_result
from ckpteval.coord.run.identity import run_key
from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
from ckpteval.coord.work.steps import run_step_selection
from ckpteval.coord.work.units import WorkUnit, units_for_step


def vanished_units(run: RunDir) -> list[WorkUnit]:
    """Units without a result of dispatched steps that have no complete snapshot (empty unless ended)."""
    if not run.ended() or not run.ledger_path.exists():
        return []
    manifest = run.manifest()
    key = run_key(manifest)
    present = {ref.step for root in manifest.snapshot_roots for ref in SnapshotDiscovery(Path(root), run=key).poll()}
    dispatched = set(Ledger(run.ledger_path, repair=False).state.dispatched)
    selection = run_step_selection(manifest.trainer, str(run.manifest_path))
    results = ResultIndex(run.results, manifest).refresh()
    return [
        unit
        for step in sorted(dispatched - present)
        if selection is None or step in selection
        for unit in units_for_step(manifest, step)
        if unit not in results
    ]


def settle_vanished(run: RunDir, why: str) -> list[WorkUnit]:
    """Write a ``ckpt_missing`` skip (message: ``why``) for every :func:`vanished_units` unit; returns them."""
    units = vanished_units(run)
    for unit in units:
        write_result(run.results, skip_result(unit, "ckpt_missing", f"step {unit.step}: no snapshot remains; {why}"))
    return units
