"""Issue 17 §1: the scorer registry — one place to add a scorer, asked by the run.json parser; rows keep
their fields; counters, extras and identity reach results and points; a scorer's own exception is its
unit's ``crashed`` skip at once, in the fleet and in the shared posture.

Real parts: ``parse_manifest`` on run.json objects, the real ``ckpteval worker`` CLI on tiny-model
snapshots, the trainer's real dispatcher with an in-process hf engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.results.files import ResultIndex, ok_result, write_result
from ckpteval.coord.results.points import derive_point, point_metrics
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest, parse_manifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import WorkUnit, units_for_step
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.kinds.generate.evalsets import load_dataset, write_jsonl
from ckpteval.jobs.eval.scorers import SCORERS
from ckpteval.jobs.lifecycle import EXIT_DONE
from ckpteval.jobs.metrics import MetricsSink
from ckpteval.jobs.reference.model import ModelConfig, build_model
from ckpteval.jobs.trainer.dispatcher import EvalDispatcher
from ckpteval.jobs.trainer.gate import ProducerGate, SharedEval, shared_eval
from tests.support.training import eval_lines, make_train_run
from tests.support.workers import finish, make_eval_run, publish_model, results, spawn

RAISING = "tests.support.scorers:raise_always"


def _manifest(**dataset: object) -> dict:
    entry = {"name": "d", "path": "data/d.jsonl", "n_prompts": 2, **dataset}
    return {"run_id": "r", "snapshot_roots": ["/abs"], "eval": {"datasets": [entry]}}


@pytest.fixture
def length_scorer(monkeypatch: pytest.MonkeyPatch) -> str:
    """A scorer added the documented way: one line in SCORERS."""
    monkeypatch.setitem(SCORERS, "length", "tests.support.scorers:LengthScorer")
    return "length"


def test_the_run_json_parser_asks_the_registry(length_scorer: str) -> None:
    src = Path("run.json")
    spec = parse_manifest(_manifest(scorer=length_scorer, scorer_options={"limit": 3}), src).eval.entries[0]
    assert spec.scorer == "length" and spec.scorer_options == {"limit": 3}
    with pytest.raises(ValueError, match=r"eval.datasets\[0\].scorer 'exakt' is not a scorer \(did you mean 'exact'"):
        parse_manifest(_manifest(scorer="exakt"), src)
    with pytest.raises(ValueError, match=r"scorer_options.limt is not a setting .*did you mean 'limit'"):
        parse_manifest(_manifest(scorer=length_scorer, scorer_options={"limt": 3}), src)
    with pytest.raises(ValueError, match=r"scorer_options.limit must be >= 0, got -1"):
        parse_manifest(_manifest(scorer=length_scorer, scorer_options={"limit": -1}), src)
    with pytest.raises(ValueError, match=r"scorer_options.x is not a setting of this scorer"):
        parse_manifest(_manifest(scorer="exact", scorer_options={"x": 1}), src)
    # a module:function is not imported when run.json is parsed (the trust check comes later)
    assert parse_manifest(_manifest(scorer="no_such_module:f"), src).eval.entries[0].scorer == "no_such_module:f"


def test_rows_keep_their_fields_and_the_scorer_s_needs_are_checked_at_load(tmp_path: Path, length_scorer: str) -> None:
    run = RunDir.create(tmp_path / "run")
    spec = GenerateEntry("d", "data/d.jsonl", n_prompts=2, scorer=length_scorer)
    write_jsonl(run.data / "d.jsonl", [{"prompt": "a", "want_len": 1, "tests": ["t"]}, {"prompt": "b", "want_len": 2}])
    rows = load_dataset(run, spec)  # no "answer": this scorer does not need one
    assert rows[0] == {"prompt": "a", "want_len": 1, "tests": ["t"]}
    write_jsonl(run.data / "d.jsonl", [{"prompt": "a", "want_len": 1}, {"prompt": "b"}])
    with pytest.raises(ValueError, match=r"d\.jsonl:2: the row has no 'want_len' \(needed by its scorer\)"):
        load_dataset(run, spec)
    write_jsonl(run.data / "d.jsonl", [{"prompt": "a", "answer": 1}, {"prompt": "b"}])
    with pytest.raises(ValueError, match=r"d\.jsonl:2: the row has no 'answer'"):
        load_dataset(run, GenerateEntry("d", "data/d.jsonl", n_prompts=2))


def _length_run(tmp: Path, scorer: str, options: dict | None = None) -> tuple[RunDir, RunManifest]:
    spec = GenerateEntry("len", "data/len.jsonl", n_prompts=4, shard_size=2, scorer=scorer, max_new_tokens=3,
                       scorer_options=options or {})
    manifest = RunManifest(run_id="len", eval=EvalSpec(entries=(spec,)), snapshot_roots=(str(tmp / "snaps"),),
                           lease=LeaseSettings(30.0, 5.0))
    run = RunDir.create(tmp / "run", manifest)
    write_jsonl(run.data / "len.jsonl", [{"prompt": f"{i}{i}+11=", "want_len": 99} for i in range(4)])
    return run, manifest


def test_counters_extras_and_identity_reach_the_result_and_the_point(
    tmp_path: Path, tiny_snapshot: Path, length_scorer: str
) -> None:
    run, manifest = _length_run(tmp_path, length_scorer, {"limit": 0, "tag": "a"})
    engine = HFEngine()
    try:
        written = shared_eval(engine, ProducerGate(), run, 3, tiny_snapshot)
    finally:
        engine.close()
    assert [r.status for r in written] == ["ok", "ok"]
    lengths = [len(a) if a else 0 for r in written for a in r.answers]
    for r in written:
        assert r.scorer == {"name": "length", "tag": "a"}
        assert r.counters == {"long": sum(int(a) > 0 for a in r.answers)}
        assert r.extras["length"]["n"] == 2
    stored = ResultIndex(run.results).refresh()
    assert all(stored[r.unit].scorer == r.scorer and stored[r.unit].counters == r.counters for r in written)
    metrics = point_metrics(derive_point(manifest, 3, stored))
    assert metrics["eval/len/long"] == sum(r.counters["long"] for r in written)
    assert metrics["eval/len/length"] == pytest.approx(sum(int(a) for r in written for a in r.answers) / 4)
    assert metrics["eval/len/grader_timeouts"] == 0
    assert lengths  # the tiny model answered something


def test_units_scored_by_different_scorer_identities_are_never_pooled(tmp_path: Path) -> None:
    run, manifest = _length_run(tmp_path, "exact")
    u0, u1 = units_for_step(manifest, 2)
    write_result(run.results, ok_result(u0, [1.0, 1.0], ["v", "v"], scorer={"name": "judge", "model": "m1"}))
    write_result(run.results, ok_result(u1, [0.0, 0.0], ["v", "v"], scorer={"name": "judge", "model": "m2"}))
    point = derive_point(manifest, 2, ResultIndex(run.results).refresh())
    assert point.complete and "len" not in point.datasets and point.mixed_scorers == ("len",)
    metrics = point_metrics(point)
    assert "eval/len" not in metrics and metrics["eval/len/scorer_mixed"] == 1.0


def test_a_raising_scorer_is_its_unit_s_crashed_skip_at_once_in_the_fleet(tmp_path: Path) -> None:
    """Fleet mode, training done: the worker writes each unit's crashed skip on its first claim (no
    release, no unhealthy engine, no restart) and exits 0, so a trainer's drain sees every unit done."""
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=2, scorer=RAISING)
    publish_model(tmp_path, run.snapshots, 1)
    run.mark_training_done(1)
    code, out = finish(spawn("worker", "--run-dir", str(run.path), "--engine", "hf", "--poll-interval", "0.05",
                             "--max-attempts", "3"), 240)
    assert code == EXIT_DONE, out
    got = results(run)
    assert sorted(got) == [WorkUnit(1, "addition", 0), WorkUnit(1, "addition", 1)]
    for r in got.values():
        assert r.skip_reason == "crashed" and r.blame == "scorer" and r.attempt == 1, r
        assert r.message.startswith(f"scorer {RAISING!r} raised: KeyError: \"no grading rule for '"), r.message
    assert "released" not in out and "unhealthy" not in out and "Traceback" not in out, out


def test_a_raising_scorer_in_the_shared_posture_skips_its_units_and_training_goes_on(tmp_path: Path) -> None:
    run, dispatch = make_train_run(tmp_path / "run", eval_interval=2, eval_scorer=RAISING)
    engine = HFEngine(device="cpu")
    d = EvalDispatcher.open(dispatch.with_waits(poll_interval_s=0.0), run, MetricsSink(run.metrics_path), run.base,
                       shared=SharedEval(engine, ProducerGate()))
    model = build_model(ModelConfig(), "llama")
    try:
        for step in range(1, 5):
            d.maybe_dispatch(step, model)  # returns: the scorer's exception does not end training
        d.close(4, model)
    finally:
        engine.close()
    points = {r["eval/step"]: r for r in eval_lines(run.path)}
    assert sorted(points) == [2, 4]
    assert all(p["eval/skipped_crashed"] == 2 and "eval/addition" not in p for p in points.values())
    skips = ResultIndex(run.results).refresh().values()
    assert {(r.skip_reason, r.blame) for r in skips} == {("crashed", "scorer")}
    assert all("KeyError: \"no grading rule for" in r.message for r in skips)
    assert json.loads(run.manifest_path.read_text())["eval"]["datasets"][0]["scorer"] == RAISING
