"""Issue 20: results and leases in one directory per step (protocol 2; a protocol 1 run dir is refused, #27),
and the per-unit savings that must not weaken a guarantee (verification once per snapshot,
one unit thread per worker).

Real workers (in this process) with the real fn backend ``tests.support.workers:SumBackend`` on real
safetensors snapshots.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from ckpteval.coord.results.files import ResultIndex, ok_result, write_result
from ckpteval.coord.run.manifest import load_manifest, parse_manifest
from ckpteval.coord.run.rundir import RunDir, step_dir_name
from ckpteval.coord.snapshots.snapshot import (
    SnapshotCorrupt,
    VerifiedSnapshots,
    publish_snapshot,
    read_marker,
)
from ckpteval.coord.work.claims import lease_holders
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.worker.options import WorkerOptions
from ckpteval.jobs.eval.worker.runner import UnitRunner
from ckpteval.jobs.lifecycle import EXIT_DONE
from tests.support.runs import write_tiny_shards
from tests.support.workers import counted_claimers, make_eval_run, publish_as_trainer, results, run_inprocess

FN = "fn:tests.support.workers:SumBackend"


def _snapshot(run: RunDir, step: int) -> Path:
    return publish_as_trainer(run.snapshots, step, lambda d: write_tiny_shards(d, n_shards=1, numel=8, seed=step))


def _work(run: RunDir) -> int:
    code, _ = run_inprocess(WorkerOptions(run_dir=run.path, engines=(FN,), once=True, poll_interval_s=0.1),
                            out=lambda _line: None)
    return code


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_new_run_keeps_each_steps_results_and_leases_in_its_own_directory(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=2)
    assert load_manifest(run.manifest_path).protocol == 2
    for step in (1, 2):
        _snapshot(run, step)
    assert _work(run) == EXIT_DONE
    units = [WorkUnit(s, "addition", i) for s in (1, 2) for i in (0, 1)]
    assert sorted(results(run)) == units
    assert _files(run.results) == [f"{step_dir_name(u.step)}/{u.id}.json" for u in units]
    assert _files(run.leases) == [f"{step_dir_name(u.step)}/{u.id}.attempts" for u in units]  # locks released
    assert counted_claimers(run, units[0].id) and lease_holders(run.leases) == {}


def test_a_protocol_1_run_dir_is_refused_in_one_line_naming_the_version(tmp_path: Path) -> None:
    """Protocol 1 (flat results/ and leases/) was never released: its run dir is not read, nor written to,
    by any reader — the worker and backfill stop at run.json with one line that names the version."""
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=2)
    run.manifest_path.write_text(json.dumps({**run.manifest().to_json(), "protocol": 1}))
    _snapshot(run, 1)
    with pytest.raises(ValueError) as e:
        load_manifest(run.manifest_path)
    line = str(e.value)
    assert "\n" not in line and str(run.manifest_path) in line
    assert "protocol is 1; this ckpteval reads only protocol 2 run dirs" in line
    with pytest.raises(ValueError, match="protocol is 1"):
        _work(run)
    assert _files(run.results) == [] and _files(run.leases) == []  # nothing written in the old run dir


def test_a_run_json_of_an_unknown_protocol_is_refused_naming_the_field(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path)
    obj = {**run.manifest().to_json(), "protocol": 3}
    with pytest.raises(ValueError, match=r"run.json.*protocol.*is 3; this ckpteval reads only protocol 2"):
        parse_manifest(obj, run.manifest_path)


def test_result_index_reads_step_dirs_only_and_lists_only_the_steps_it_waits_for(tmp_path: Path) -> None:
    unit = WorkUnit(2, "ds", 0)
    (tmp_path / WorkUnit(1, "ds", 0).result_name).write_text(json.dumps(ok_result(WorkUnit(1, "ds", 0), [1.0],
                                                                                   ["1"]).to_json()))
    write_result(tmp_path, ok_result(unit, [1.0], ["2"]))
    assert not write_result(tmp_path, ok_result(unit, [0.0], ["2"]))  # first writer won
    index = ResultIndex(tmp_path)
    assert set(index.refresh()) == {unit} and index.get(unit).scores == (1.0,)  # a flat file is no result
    later = WorkUnit(2, "ds", 1)
    write_result(tmp_path, ok_result(later, [1.0], ["2"]))
    assert later not in index.refresh(skip_steps={2})  # a settled step's directory is not listed again
    assert later in index.refresh()
    assert set(ResultIndex(tmp_path).refresh(only_steps={2})) == {unit, later}  # results/ itself not listed


def test_verification_is_remembered_per_marker_and_failures_never(tmp_path: Path) -> None:
    root = tmp_path / "snaps"
    snap = publish_snapshot(root, 1, lambda d: write_tiny_shards(d, n_shards=1, numel=8))
    verified = VerifiedSnapshots()
    assert verified.verify(snap, "fast").step == 1
    weights = next(snap.glob("*.safetensors"))
    with open(weights, "r+b") as f:
        f.truncate(10)
    assert verified.verify(snap, "fast").step == 1  # the documented limit: same marker, not checked again
    marker = read_marker(snap)
    (snap / ".complete").unlink()
    (snap / ".complete").write_text(json.dumps(marker.to_json()))  # re-marked: a new marker file
    for _ in range(2):  # checked again, and a failure is not remembered
        with pytest.raises(SnapshotCorrupt):
            verified.verify(snap, "fast")


def test_unit_runner_uses_one_thread_and_never_queues_behind_an_abandoned_unit() -> None:
    runner, names = UnitRunner(), []
    for i in range(3):
        job = runner.submit(lambda i=i: names.append(threading.current_thread().ident) or i)
        assert job.done.wait(10) and job.result == i
    assert len(set(names)) == 1  # one thread for every unit
    release = threading.Event()
    stuck = runner.submit(lambda: release.wait(30))  # abandoned after a stop signal
    assert runner.busy
    job = runner.submit(lambda: "next")
    assert job.done.wait(10) and job.result == "next" and not stuck.done.is_set()
    release.set()
    assert stuck.done.wait(10)
