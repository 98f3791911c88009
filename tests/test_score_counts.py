"""A result must carry exactly its unit's scores, (prompts in its shard) x (samples in its range) (#37).

Pooled with a wrong count, samples would move across prompts and a wrong score be logged as a complete point:
every reader with the run's manifest refuses such a file as malformed (docs/PROTOCOL.md, results), and
``derive_point`` refuses one it is handed anyway. Real result files in a real run dir throughout.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.entries.lm_eval import LmEvalEntry
from ckpteval.coord.results.files import ResultIndex, ok_result, write_result
from ckpteval.coord.results.points import derive_point
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest
from ckpteval.coord.run.rundir import RunDir, unit_dir
from ckpteval.coord.work.units import WorkUnit, expected_scores
from ckpteval.jobs.eval.worker.options import WorkerOptions
from ckpteval.jobs.lifecycle import EXIT_DONE
from tests.support.workers import make_eval_run, publish_model, run_inprocess, version

ROOT = Path(__file__).resolve().parents[1]
STEP = 10


def _run(tmp: Path) -> RunDir:
    """4 prompts in shards of 2, 2 samples each: every unit carries 2 prompts x 2 samples = 4 scores."""
    entry = GenerateEntry(name="add", path="data/add.jsonl", n_prompts=4, shard_size=2, n_samples=2)
    manifest = RunManifest(run_id="counts", eval=EvalSpec(entries=(entry,)),
                           snapshot_roots=(str(tmp / "run" / "snapshots"),), lease=LeaseSettings(30.0, 5.0))
    return RunDir.create(tmp / "run", manifest)


def _write(run: RunDir, unit: WorkUnit, n: int) -> Path:
    write_result(run.results, ok_result(unit, [1.0] * n, [str(STEP)] * n))
    return unit_dir(run.results, STEP) / unit.result_name


@pytest.mark.parametrize("n", [5, 3], ids=["one too many", "one too few"])
def test_a_wrong_score_count_is_malformed_and_its_point_incomplete(tmp_path: Path, n: int) -> None:
    run = _run(tmp_path)
    manifest = run.manifest()
    bad, good = WorkUnit(STEP, "add", 0), WorkUnit(STEP, "add", 1)
    path = _write(run, bad, n)
    _write(run, good, 4)
    index = ResultIndex(run.results, manifest)
    results = index.refresh()
    assert set(results) == {good}
    name = f"step-{STEP:010d}/{bad.result_name}"
    assert index.errors == {name: f"{path}: {n} scores, but unit {bad.id} has 2 prompts x 2 samples = 4"}
    point = derive_point(manifest, STEP, results)
    assert not point.complete and "add" not in point.datasets
    status = subprocess.run([sys.executable, "-m", "ckpteval.jobs.cli", "status", str(run.path), "--json"],
                            capture_output=True, text=True, check=True, cwd=ROOT)
    health = json.loads(status.stdout)["health"]
    assert f"{n} scores, but unit {bad.id} has 2 prompts x 2 samples = 4" in health["malformed_results"][name]
    assert not json.loads(status.stdout)["points"][0]["complete"]


def test_the_right_count_passes(tmp_path: Path) -> None:
    run = _run(tmp_path)
    manifest = run.manifest()
    for shard in (0, 1):
        _write(run, WorkUnit(STEP, "add", shard), 4)
    index = ResultIndex(run.results, manifest)
    point = derive_point(manifest, STEP, index.refresh())
    assert index.errors == {} and point.complete and point.datasets["add"].n == 8


def test_derive_point_refuses_a_wrong_count_it_is_handed(tmp_path: Path) -> None:
    """The second line of defence: results read without the manifest are never regrouped."""
    run = _run(tmp_path)
    _write(run, WorkUnit(STEP, "add", 0), 5)
    _write(run, WorkUnit(STEP, "add", 1), 4)
    results = ResultIndex(run.results).refresh()
    with pytest.raises(ValueError, match=rf"5 scores, but unit {WorkUnit(STEP, 'add', 0).id} has 2 prompts x 2 samples = 4"):
        derive_point(run.manifest(), STEP, results)


def test_a_published_wrong_count_is_not_indexed_by_its_writer(tmp_path: Path) -> None:
    """A worker's own index agrees with every other reader: what it published with a wrong count is an error."""
    run = _run(tmp_path)
    index = ResultIndex(run.results, run.manifest())
    unit = WorkUnit(STEP, "add", 0)
    assert index.publish(ok_result(unit, [1.0] * 3, [str(STEP)] * 3))
    assert index.get(unit) is None and "3 scores, but unit" in index.errors[f"step-{STEP:010d}/{unit.result_name}"]


def test_expected_scores_of_split_replayed_and_per_unit_kinds(tmp_path: Path) -> None:
    run = _run(tmp_path)
    split = replace(run.manifest().eval.entries[0], n_prompts=5, samples_per_unit=1)
    harness = LmEvalEntry("harness", tasks=("t",))
    manifest = RunManifest(run_id="counts", eval=EvalSpec(entries=(split, harness)), snapshot_roots=())
    first, last = split.units(STEP)[0], split.units(STEP)[-1]  # shard 0 sample 0; shard 2 (1 prompt) sample 1
    assert (first.sample_start, last.shard, last.sample_start) == (0, 2, 1)
    assert expected_scores(manifest, first) == 2 and expected_scores(manifest, last) == 1
    assert expected_scores(manifest, first.as_replay(1)) == 2  # a replay counts like its unit
    assert expected_scores(manifest, harness.units(STEP)[0]) is None  # scored per unit: its metrics


def test_a_worker_leaves_a_wrong_count_unit_alone_and_scores_the_rest(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The unit's name is taken, so re-evaluating could never publish: the worker says why and moves on
    (a human removes the file; the point is then re-evaluated)."""
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=2)
    publish_model(tmp_path, run.snapshots, STEP)
    bad = WorkUnit(STEP, "addition", 0)
    write_result(run.results, ok_result(bad, [1.0] * 3, [version(run, STEP)] * 3))
    opts = WorkerOptions(run_dir=run.path, engines=("fn:tests.support.workers:SumBackend",), once=True,
                         poll_interval_s=0.05)
    code, _ = run_inprocess(opts, out=lambda _line: None)
    assert code == EXIT_DONE
    assert f"unit left alone: its result file is malformed ({unit_dir(run.results, STEP) / bad.result_name}: " \
           f"3 scores, but unit {bad.id} has 2 prompts x 1 samples = 2)" in capsys.readouterr().err
    index = ResultIndex(run.results, run.manifest())
    results = index.refresh()
    assert set(results) == {WorkUnit(STEP, "addition", 1)} and len(index.errors) == 1
    (unit_dir(run.results, STEP) / bad.result_name).unlink()  # the human's fix
    code, _ = run_inprocess(opts, out=lambda _line: None)
    point = derive_point(run.manifest(), STEP, ResultIndex(run.results, run.manifest()).refresh())
    assert code == EXIT_DONE and point.complete and point.units_done == 2
