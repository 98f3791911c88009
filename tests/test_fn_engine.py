"""The CheckpointEvalFn contract, the engine factory, and sharding invariance, with real fn backends.

The backends (tests.support.workers) are real CheckpointEvalFn classes loaded by import path; they read
the snapshot's actual safetensors. Workers run in this process (the subprocess paths are covered in
test_worker_procs.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpteval.coord.results.points import derive_point, point_metrics
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.engines.factory import engine_settings, make_engine, normalize_spec, spec_kind
from ckpteval.jobs.eval.engines.fn import EvalSkip, load_fn_class, parse_output
from ckpteval.jobs.eval.worker.options import WorkerOptions
from ckpteval.jobs.lifecycle import EXIT_DONE, EXIT_UNHEALTHY
from tests.support.workers import (
    SumBackend,
    make_eval_run,
    publish_model,
    results,
    row_score,
    run_inprocess,
    safetensors_sum,
)


def _opts(run_dir: Path, spec: str, **kw) -> WorkerOptions:
    return WorkerOptions(run_dir=run_dir, engines=(spec,), once=True, poll_interval_s=0.1, **kw)


def test_fn_backend_scores_every_unit_with_its_versions(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=6, shard_size=4)
    snaps = {step: publish_model(tmp_path, run.snapshots, step) for step in (5, 10)}
    lines: list[str] = []
    code, worker = run_inprocess(_opts(run.path, "fn:tests.support.workers:SumBackend", worker_id="w-fn"), out=lines.append)
    assert code == EXIT_DONE
    assert worker.evaluator.backend.disposed
    got = results(run)
    assert sorted(got) == [WorkUnit(s, "addition", i) for s in (5, 10) for i in (0, 1)]
    rows = worker.evaluator.cache.rows(run.manifest().entry("addition"))
    for unit, r in got.items():
        weight_sum = safetensors_sum(str(snaps[unit.step]))
        want = [row_score(weight_sum, rows[i]["prompt"]) for i in range(unit.shard * 4, min(unit.shard * 4 + 4, 6))]
        assert r.ok and list(r.scores) == pytest.approx(want)
        assert r.weight_versions == (str(unit.step),) * len(want)
        assert r.worker["worker_id"] == "w-fn" and r.lease_token and r.attempt == 1
        assert r.message.startswith("sum=") and {"generate_s", "total_s", "verify_s"} <= set(r.timings)
    assert len(lines) == 4 and all("score=" in line for line in lines)
    point = derive_point(run.manifest(), 10, got)
    assert point.complete and point.datasets["addition"].mixed_version_ratio == 0
    assert point.datasets["addition"].weight_version_mean == 10


def test_eval_skip_becomes_a_skip_result_with_its_reason(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=2)
    publish_model(tmp_path, run.snapshots, 7)
    code, _ = run_inprocess(_opts(run.path, "fn:tests.support.workers:AdapterMissingBackend"), out=lambda _l: None)
    assert code == EXIT_DONE
    got = results(run)
    assert {r.skip_reason for r in got.values()} == {"adapter_missing"} and len(got) == 2
    metrics = point_metrics(derive_point(run.manifest(), 7, got))
    assert metrics["eval/skipped_adapter_missing"] == 2 and "eval/addition" not in metrics


def test_backend_reporting_another_version_is_a_pin_violation(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4, engine={"fn": {"version_offset": 1}})
    publish_model(tmp_path, run.snapshots, 3)
    run_inprocess(_opts(run.path, "fn:tests.support.workers:SumBackend"), out=lambda _l: None)
    (r,) = results(run).values()
    assert r.skip_reason == "pin_violation" and "['4']" in r.message


def test_malformed_backend_output_burns_no_unit(tmp_path: Path) -> None:
    """A backend whose every output is malformed (``crashed``) is a broken worker: it releases the
    unit each time (its tries counted) and exits 4 after ``--max-unhealthy`` failures in a row,
    having written nothing a working worker could not overwrite."""
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4)
    publish_model(tmp_path, run.snapshots, 3)
    lines: list[str] = []
    code, _ = run_inprocess(_opts(run.path, "fn:tests.support.workers:BadOutputBackend"), out=lines.append)
    assert code == EXIT_UNHEALTHY and results(run) == {}
    assert any("list of 4" in line and "released" in line for line in lines), lines
    (attempts,) = run.leases.rglob("*.attempts")
    assert attempts.read_text().count("\n") == 5  # --max-unhealthy (default 5) tries, then out


def test_sharding_does_not_change_the_point_fn(tmp_path: Path) -> None:
    """Same weights (each run's own snapshot of one seed), shard sizes 1, 7 and N: identical derived scores
    (pooled per sample)."""
    n = 15
    points = []
    for size in (1, 7, n):
        run = make_eval_run(tmp_path, n_prompts=n, shard_size=size, name=f"run-s{size}")
        publish_model(tmp_path, run.snapshots, 42)
        run_inprocess(_opts(run.path, "fn:tests.support.workers:SumBackend"), out=lambda _l: None)
        got = results(run)
        assert len(got) == -(-n // size)
        points.append(derive_point(run.manifest(), 42, got))
    assert all(p.complete for p in points)
    scores = [p.datasets["addition"] for p in points]
    assert scores[0] == scores[1] == scores[2] and scores[0].n == n and 0 < scores[0].score < 1


def test_factory_specs_and_errors(tmp_path: Path) -> None:
    assert [spec_kind(s) for s in ("hf", "http:http://h:1", "sglang", "fn:a.b:C")] == ["hf", "http", "sglang", "fn"]
    assert [spec_kind(s) for s in ("vllm", "vllm:http://h:1", "vllm:h:1")] == ["vllm"] * 3  # launch, attach
    assert normalize_spec("vllm:h:1") == "vllm:http://h:1" and normalize_spec("vllm") == "vllm"
    for bad, why in [("vlm", "unknown kind.*vllm"), ("http", "needs a URL"), ("fn:", "needs a module:Class"),
                     ("hf:x", "takes no argument"), ("vllm:h:x", "not a server URL; write vllm:http")]:
        with pytest.raises(ValueError, match=why):
            spec_kind(bad)
    assert engine_settings({"hf": {"dtype": "float32"}, "fn": {"k": 1}}, "hf") == {"dtype": "float32"}
    with pytest.raises(ValueError, match="eval.engine.hf must be an object"):
        engine_settings({"hf": 3}, "hf")
    backend = make_engine("fn:tests.support.workers:SumBackend", "cpu", {"delay_s": 0.5})
    assert isinstance(backend, SumBackend) and backend.delay_s == 0.5
    with pytest.raises(ValueError, match="rejects the settings"):
        make_engine("fn:tests.support.workers:SumBackend", "cpu", {"nope": 1})
    with pytest.raises(ValueError, match="cannot be imported"):
        load_fn_class("tests.support.workers:NoSuchClass")
    with pytest.raises(ValueError, match="not a class with evaluate_checkpoint"):
        load_fn_class("tests.support.workers:row_score")
    with pytest.raises(ValueError, match="rejected"):
        make_engine("hf", "cpu", {"no_such_setting": 1})


def test_eval_skip_and_output_validation() -> None:
    assert EvalSkip("adapter_missing", "x").reason == "adapter_missing"
    with pytest.raises(ValueError, match="identifier"):
        EvalSkip("bad reason!")
    out = parse_output({"scores": [1, 0.5]}, 2, "9")
    assert out.weight_versions == ["9", "9"] and out.scores == [1.0, 0.5]
    for bad in ({"scores": [1]}, {"scores": [float("nan"), 1]}, {"scores": [True, 1]}, [1, 2],
                {"scores": [1, 2], "weight_versions": ["9"]}):
        with pytest.raises(ValueError):
            parse_output(bad, 2, "9")
