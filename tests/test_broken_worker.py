"""Issue 11 §3-4 (worker side): a broken worker burns no unit; start order; missing protocol dirs.

Every case runs the real ``ckpteval worker``/``backfill`` CLI as a subprocess against a run with real
snapshots of the tiny model; "burned" means a result file written.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from ckpteval.coord.run.identity import snapshots_key
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.snapshot import publish_snapshot
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.lifecycle import EXIT_DONE, EXIT_USAGE
from tests.support.workers import finish, make_eval_run, model_writer, publish_model, results, spawn, version

FN = "fn:tests.support.workers:SumBackend"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def _run_with_snapshots(tmp: Path, steps: tuple[int, ...] = (1, 2)) -> RunDir:
    run = make_eval_run(tmp, n_prompts=4, shard_size=2)
    for step in steps:
        publish_model(tmp, run.snapshots, step)
    return run


def _nan_temperature(run: RunDir) -> list[str]:
    obj = json.loads(run.manifest_path.read_text())
    obj["eval"]["datasets"][0]["temperature"] = float("nan")
    run.manifest_path.write_text(json.dumps(obj))  # json writes NaN, as a hand-edited run.json could hold
    return ["--engine", "hf"]


BROKEN = {
    "dead-engine-url": lambda run: ["--engine", f"http:http://127.0.0.1:{_closed_port()}"],
    "cuda-without-cuda": lambda run: ["--engine", "hf", "--device", "cuda"],
    "nan-temperature": _nan_temperature,
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_worker_writes_nothing(tmp_path: Path, case: str) -> None:
    """Dead engine URL, a CUDA device on a machine without CUDA, a run.json with an unusable
    sampling setting: the worker exits non-zero, says why on stderr, and writes no result."""
    import torch

    if case == "cuda-without-cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is not broken here")
    run = _run_with_snapshots(tmp_path)
    argv = BROKEN[case](run)
    code, out = finish(spawn("worker", "--run-dir", str(run.path), "--once", "--poll-interval", "0.05", *argv), 180)
    assert code != EXIT_DONE, out
    assert "Traceback" not in out, out
    assert results(run) == {}, f"{case}: a broken worker burned units:\n{out}"
    assert not (run.results / "duplicates").exists()


def test_a_healthy_worker_after_a_broken_one_scores_every_unit(tmp_path: Path) -> None:
    run = _run_with_snapshots(tmp_path)
    dead = ["--engine", f"http:http://127.0.0.1:{_closed_port()}"]
    code, out = finish(spawn("worker", "--run-dir", str(run.path), "--once", *dead), 60)
    assert code != EXIT_DONE and len([ln for ln in out.splitlines() if ln.strip()]) == 1, out
    code, out = finish(spawn("worker", "--run-dir", str(run.path), "--once", "--engine", "hf"), 180)
    assert code == EXIT_DONE, out
    got = results(run)
    assert sorted(got) == [WorkUnit(s, "addition", i) for s in (1, 2) for i in (0, 1)]
    assert all(r.ok and set(r.weight_versions) == {version(run, r.unit.step)} for r in got.values())


def test_worker_started_before_run_json_waits_for_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "later"
    proc = spawn("worker", "--run-dir", str(run_dir), "--once", "--engine", FN, "--poll-interval", "0.05",
                 "--wait-for-run", "120")
    time.sleep(2.0)  # the worker is up and waiting; now the trainer writes its run
    assert proc.poll() is None, proc.communicate()[0]
    # the run and its snapshot are made aside, then moved in whole: a --once worker that saw run.json before
    # the snapshot was published would rightly be done with nothing to do
    staged = make_eval_run(tmp_path / "staging", n_prompts=4, shard_size=2, name="later",
                           snapshot_root=tmp_path / "snapshots")
    publish_snapshot(tmp_path / "snapshots", 5, model_writer(tmp_path, 5), run=snapshots_key(staged.manifest()))
    os.rename(staged.path, run_dir)
    run = RunDir.open(run_dir)
    code, out = finish(proc, 120)
    assert code == EXIT_DONE, out
    assert "waiting up to 120s" in out
    assert sorted(results(run)) == [WorkUnit(5, "addition", 0), WorkUnit(5, "addition", 1)], out


def test_wait_for_run_is_bounded(tmp_path: Path) -> None:
    code, out = finish(spawn("worker", "--run-dir", str(tmp_path / "never"), "--engine", FN,
                             "--wait-for-run", "0.5"), 60)
    assert code == EXIT_USAGE and "Traceback" not in out and "run.json" in out.splitlines()[-1], out


@pytest.mark.parametrize("command", ["backfill", "worker"])
@pytest.mark.parametrize("missing", ["results", "leases"])
def test_a_run_copy_without_results_or_leases_is_scored(tmp_path: Path, command: str, missing: str) -> None:
    """A finished run copied with its ``results/`` (or ``leases/``) removed to re-score it: the
    protocol dirs are created before any work, every unit is published, no traceback."""
    import shutil

    run = _run_with_snapshots(tmp_path, (3,))
    shutil.rmtree(run.path / missing)
    extra = ["--once"] if command == "worker" else []
    code, out = finish(spawn(command, "--run-dir", str(run.path), "--engine", FN, "--poll-interval", "0.05",
                             *extra), 120)
    assert code == EXIT_DONE and "Traceback" not in out, out
    assert sorted(results(run)) == [WorkUnit(3, "addition", 0), WorkUnit(3, "addition", 1)]
