"""Issue 27: adding a dataset kind is one module and one registry line.

``tests/support/echo_kind.py`` holds both halves of a kind ckpteval does not ship; the tests below add it with
one line in :data:`ckpteval.coord.entries.KINDS` (and nothing else) and run it end to end: run.json written
and read back, the point's units asked of the entry, a real in-process worker on a real snapshot of the tiny
model running the kind's start check and its evaluation, the point derived by the entry's point rule.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ckpteval.coord.entries import KINDS, Kind
from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.entries.lm_eval import LmEvalEntry
from ckpteval.coord.results.files import ResultIndex
from ckpteval.coord.results.points import derive_point, point_metrics
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest, load_manifest, parse_manifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import WorkUnit, units_for_step
from ckpteval.jobs.eval.kinds.generate.evalsets import write_addition_dataset
from ckpteval.jobs.eval.worker.options import WorkerOptions
from ckpteval.jobs.lifecycle import EXIT_DONE
from ckpteval.jobs.metrics import MetricsSink
from ckpteval.jobs.trainer.config import DispatchConfig
from ckpteval.jobs.trainer.dispatcher import EvalDispatcher
from tests.support import echo_kind
from tests.support.echo_kind import EchoEntry
from tests.support.workers import finish, make_eval_run, publish_model, run_inprocess, spawn, version

ECHO = Kind("tests.support.echo_kind:EchoEntry", "tests.support.echo_kind:evaluate", "tests.support.echo_kind:check")


@pytest.fixture
def echo_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(KINDS, "echo", ECHO)  # the one registry line


def _run(tmp: Path) -> RunDir:
    run = RunDir.create(tmp / "run")
    addition = write_addition_dataset(run, n=2, shard_size=2)
    manifest = RunManifest(run_id="echo", eval=EvalSpec(entries=(EchoEntry("echo", n_prompts=2), addition)),
                           snapshot_roots=(str(run.snapshots),), lease=LeaseSettings(30.0, 5.0))
    return RunDir.create(run.path, manifest)


def test_an_unregistered_kind_is_refused_naming_the_field(tmp_path: Path) -> None:
    obj = {"run_id": "r", "snapshot_roots": ["/abs"], "eval": {"datasets": [{"name": "e", "kind": "echo"}]}}
    with pytest.raises(ValueError, match=r"run.json: field eval.datasets\[0\].kind 'echo' must be one of generate"):
        parse_manifest(obj, tmp_path / "run.json")


def test_a_kind_defined_in_the_tests_round_trips_and_answers_its_units(tmp_path: Path, echo_registered: None) -> None:
    run = _run(tmp_path)
    on_disk = json.loads(run.manifest_path.read_text())["eval"]["datasets"]
    assert [d["kind"] for d in on_disk] == ["echo", "generate"]  # run.json's shape: one list of entries
    manifest = load_manifest(run.manifest_path)
    assert manifest.entry("echo") == EchoEntry("echo", n_prompts=2)
    assert units_for_step(manifest, 3) == [WorkUnit(3, "echo", 0), WorkUnit(3, "echo", 1), WorkUnit(3, "addition", 0)]
    obj = {**on_disk[0], "n_prompts": 0}
    with pytest.raises(ValueError, match=r"eval.datasets\[0\].n_prompts and every must be >= 1"):
        parse_manifest({**manifest.to_json(), "eval": {"datasets": [obj]}}, run.manifest_path)


def test_a_kind_defined_in_the_tests_runs_end_to_end_on_a_real_worker(tmp_path: Path, echo_registered: None) -> None:
    run = _run(tmp_path)
    publish_model(tmp_path, run.snapshots, 3)
    echo_kind.CHECKED.clear()
    code, _ = run_inprocess(WorkerOptions(run_dir=run.path, engines=("hf",), once=True, poll_interval_s=0.05),
                            out=lambda _line: None)
    assert code == EXIT_DONE
    assert echo_kind.CHECKED == ["echo"]  # the kind's own start check ran
    manifest = run.manifest()
    results = ResultIndex(run.results).refresh()
    echo = [results[WorkUnit(3, "echo", i)] for i in range(2)]
    assert all(r.ok and r.scores == (1.0,) and r.weight_versions == (version(run, 3),) for r in echo)
    point = derive_point(manifest, 3, results)
    assert point.complete and set(point.datasets) == {"echo", "addition"}  # the samples rule, like generate's
    metrics = point_metrics(point)
    assert metrics["eval/echo"] == 1.0 and metrics["eval/echo/pass@1"] == 1.0
    assert metrics["eval/echo/weight_version/mean"] == 3.0


def test_a_kind_that_needs_an_engine_is_refused_an_fn_backend(tmp_path: Path, echo_registered: None) -> None:
    run = _run(tmp_path)
    with pytest.raises(ValueError, match=r"has echo entries \['echo'\]: they need an engine"):
        run_inprocess(WorkerOptions(run_dir=run.path, engines=("fn:tests.support.workers:SumBackend",), once=True),
                      out=lambda _line: None)


def test_a_cadence_error_names_the_entry_s_own_index_in_run_json(tmp_path: Path) -> None:
    """#36: with an lm_eval entry first, the trainer's cadence check names the generate entry after it as
    ``eval.datasets[1]`` (its place in run.json), not its place among the per-sample entries."""
    run = RunDir.create(tmp_path / "run")
    entries = (LmEvalEntry("harness", tasks=("t",)), GenerateEntry("g", "data/g.jsonl", n_prompts=1, every=3))
    run = RunDir.create(run.path, RunManifest(run_id="cadence", eval=EvalSpec(entries=entries),
                                              snapshot_roots=(str(run.snapshots),)))
    with pytest.raises(ValueError, match=r"field eval.datasets\[1\].every is 3, not a multiple of the eval interval 2"):
        EvalDispatcher.open(DispatchConfig(eval_interval=2), run, MetricsSink(run.metrics_path), None)


@pytest.mark.parametrize(("entry", "says"), [
    ({"name": "e", "kind": "env", "path": "data/e.jsonl", "n_prompts": 2, "env": "gues"},
     r"eval.datasets\[0\].env 'gues' is not an environment \(did you mean 'guess'"),
    ({"name": "d", "path": "data/d.jsonl", "n_prompts": 2, "scorer": "exakt"},
     r"eval.datasets\[0\].scorer 'exakt' is not a scorer \(did you mean 'exact'"),
])
def test_status_checks_environment_names_as_it_checks_scorer_names(tmp_path: Path, entry: dict, says: str) -> None:
    """#36: every program installs the registries' checks at start (not by what it happens to import), so
    ``ckpteval status`` refuses a run.json naming an unknown environment as it does an unknown scorer."""
    run = make_eval_run(tmp_path, n_prompts=2, shard_size=2)
    obj = json.loads(run.manifest_path.read_text())
    obj["eval"]["datasets"] = [entry]
    run.manifest_path.write_text(json.dumps(obj))
    code, out = finish(spawn("status", str(run.path)), timeout=120)
    assert code != 0 and re.search(says, out), out
