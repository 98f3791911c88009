"""Issue #29, first half: deterministic decision sets and the engine in every point's identity.

Real parts throughout: units evaluated by real HF engines on a real tiny snapshot, the sglang launch of the
worker's engine factory running a real (fake-sglang) process whose argv is read back from /proc, and the
``ckpteval serve`` stand-in as a real HTTP server.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest

from ckpteval.coord.results.engine_identity import EngineIdentity, differing_fields
from ckpteval.coord.results.files import ok_result, write_result
from ckpteval.coord.results.points import derive_point, point_metrics
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import WorkUnit, shard_range, units_for_step
from ckpteval.jobs.decide import best, compare
from ckpteval.jobs.eval.engines.factory import make_engine
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.engines.http.engine import HTTPEngine
from ckpteval.jobs.eval.engines.sglang.deterministic import DETERMINISTIC_FLAG
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
from ckpteval.jobs.eval.worker.evaluators import EngineEvaluator, _settings, evaluate_unit
from ckpteval.jobs.views.status.main import collect_status, cost_line, points_table
from tests.support import fake_sglang
from tests.support.runs import make_run
from tests.support.workers import REPO, make_eval_run, publish_model, results
from tests.test_serve_http import in_process

SGLANG_A = EngineIdentity("sglang", "0.5.23", "bfloat16", tp=1, deterministic=True, attention_backend="fa3",
                          device="cuda", concurrency=64)


# -- the identity itself ------------------------------------------------------------------------------
def test_the_key_changes_with_every_completion_field_but_not_batch_size_when_batch_invariant() -> None:
    base = SGLANG_A.key()
    for change in ({"tp": 2}, {"version": "0.5.19"}, {"dtype": "float16"}, {"deterministic": False},
                   {"quantization": "fp8"}, {"attention_backend": "triton"}, {"kind": "hf"}):
        assert replace(SGLANG_A, **change).key() != base, change
    assert replace(SGLANG_A, concurrency=8).key() == base  # batch-invariant: batch-mates change nothing
    loose = replace(SGLANG_A, deterministic=False)
    assert replace(loose, concurrency=8).key() != loose.key()
    assert EngineIdentity.from_json(json.loads(json.dumps(SGLANG_A.to_json()))).key() == base  # stable via JSON
    assert differing_fields(SGLANG_A, replace(SGLANG_A, tp=2, dtype="float16")) == ["dtype", "tp"]


def _server_info_0523(top: dict[str, object], states: list[dict[str, object]]) -> dict[str, object]:
    """A ``/server_info`` body shaped as sglang 0.5.23 returns it (``entrypoints/http_server.py`` ``server_info``:
    ``build_server_info`` — ``ServerArgs.resolved_dict()``, ``launch_command``, the scheduler's init info,
    ``kv_events`` — then ``startup_time``, ``internal_states`` (per DP: ``resolved_server_args_dict()`` with
    its post-publish overrides, topology, memory), ``version``, ``frontend``), recorded from a T4 launch of a
    Qwen2 model with ``--enable-deterministic-inference --attention-backend triton`` (values abridged to
    the args an identity reads and their neighbours)."""
    args = {"model_path": "/ckpt/step-100", "tokenizer_path": "/ckpt/step-100", "load_format": "auto",
            "dtype": "auto", "quantization": None, "kv_cache_dtype": "auto", "tp_size": 1, "dp_size": 1,
            "pp_size": 1, "enable_dp_attention": False, "device": "cuda", "attention_backend": "triton",
            "prefill_attention_backend": None, "decode_attention_backend": None, "sampling_backend": "pytorch",
            "enable_deterministic_inference": True, "enable_lora": None, "max_running_requests": None,
            "max_queued_requests": None, "disable_radix_cache": False, "weight_version": "default", **top}
    return {**args, "launch_command": "python -m sglang.launch_server --model-path /ckpt/step-100 "
            "--enable-deterministic-inference --attention-backend triton",
            "status": "ready", "max_total_num_tokens": 401408, "max_req_input_len": 32762,
            "hicache_object_layout": {"enabled": False}, "kv_events": None, "startup_time": 1767225600.5,
            "internal_states": [{**args, **state, "world_size": 1, "startup_time": 1767225600.5,
                                 "effective_max_running_requests_per_dp": 48, "last_gen_throughput": 0.0,
                                 "memory_usage": {"weight": 0.93, "kvcache": 4.6}} for state in states],
            "version": "0.5.23", "frontend": "python"}


def test_the_identity_records_the_resolved_dtypes_and_both_attention_backends() -> None:
    """Before: ``dtype: auto`` (the launch value, though the T4's scheduler runs float16: sglang's SM<80
    fallback, reported in ``internal_states``), no KV cache dtype, no prefill/decode backends."""
    from ckpteval.jobs.eval.engines.http.server_info import server_identity

    t4 = server_identity(_server_info_0523({}, [{"dtype": "float16"}]), max_batch_size=64)
    assert (t4.dtype, t4.kv_cache_dtype, t4.attention_backend) == ("float16", "auto", "triton")
    assert (t4.prefill_attention_backend, t4.decode_attention_backend) == ("triton", "triton")
    assert (t4.version, t4.device, t4.deterministic, t4.concurrency) == ("0.5.23", "cuda", True, 48)
    split = _server_info_0523({"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3", "attention_backend": "fa3",
                               "prefill_attention_backend": "fa3", "decode_attention_backend": "flashinfer",
                               "dp_size": 2}, [{}, {}])
    h100 = server_identity(split, max_batch_size=64)
    assert (h100.dtype, h100.kv_cache_dtype) == ("bfloat16", "fp8_e4m3")
    assert (h100.prefill_attention_backend, h100.decode_attention_backend) == ("fa3", "flashinfer")
    assert differing_fields(h100, replace(h100, decode_attention_backend="fa3")) == ["decode_attention_backend"]
    assert differing_fields(h100, replace(h100, kv_cache_dtype="auto")) == ["kv_cache_dtype"]
    # an identity recorded before these fields (all None) keeps its key
    assert SGLANG_A.key() == EngineIdentity.from_json({**SGLANG_A.to_json(), "kv_cache_dtype": None}).key()
    assert SGLANG_A.key() == "sglang-" + hashlib.blake2b(json.dumps(
        {k: v for k, v in SGLANG_A.to_json().items() if k not in
         ("concurrency", "kv_cache_dtype", "prefill_attention_backend", "decode_attention_backend")},
        sort_keys=True, separators=(",", ":")).encode(), digest_size=8).hexdigest()


# -- pooling -------------------------------------------------------------------------------------------
def _evaluate(tmp_path: Path, engines: list[HFEngine]) -> RunDir:
    """Step 1's two units, unit i evaluated by ``engines[i]`` (real HF engines on a real snapshot)."""
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=2, max_new_tokens=2)
    publish_model(tmp_path, run.snapshots, 1)
    from ckpteval.coord.snapshots.discovery import SnapshotDiscovery

    (ref,) = SnapshotDiscovery(run.snapshots).poll()
    cache = DatasetCache(run, run.manifest())
    for shard, engine in enumerate(engines):
        try:
            result = evaluate_unit(EngineEvaluator(engine, cache, 5.0, 120.0), WorkUnit(1, "addition", shard), ref, "fast")
        finally:
            engine.close()
        assert result.ok, result.message
        write_result(run.results, result)
    return run


def test_two_units_of_a_step_from_engines_of_different_identity_are_not_pooled(tmp_path: Path) -> None:
    run = _evaluate(tmp_path, [HFEngine(max_batch_size=4), HFEngine(max_batch_size=4, dtype="bfloat16")])
    got = results(run)
    identities = [EngineIdentity.from_json(got[WorkUnit(1, "addition", s)].engine) for s in (0, 1)]
    assert [i.kind for i in identities] == ["hf", "hf"] and identities[1].dtype == "bfloat16"
    point = derive_point(run.manifest(), 1, got)
    assert point.complete and "addition" not in point.datasets and point.mixed_engines == {"addition": ("dtype",)}
    metrics = point_metrics(point)
    assert "eval/addition" not in metrics and metrics["eval/addition/engine_mixed"] == 1.0
    table = points_table(collect_status(run.path))
    assert "not pooled: engines differ (dtype)" in table.rows[0], table.rows


def test_units_of_one_identity_from_two_engine_instances_are_pooled(tmp_path: Path) -> None:
    run = _evaluate(tmp_path, [HFEngine(max_batch_size=4), HFEngine(max_batch_size=4)])
    point = derive_point(run.manifest(), 1, results(run))
    assert "addition" in point.datasets and point.mixed_engines == {}


# -- compare / best ------------------------------------------------------------------------------------
def _write_step(run: RunDir, step: int, per_prompt: np.ndarray, identity: EngineIdentity) -> None:
    manifest = run.manifest()
    for unit in units_for_step(manifest, step):
        idx = list(shard_range(manifest, unit))
        write_result(run.results, ok_result(unit, [float(per_prompt[i]) for i in idx], [str(step)] * len(idx),
                                            engine=identity.to_json()))


@pytest.fixture
def mixed_run(tmp_path: Path) -> RunDir:
    """Steps 100 and 200 on one engine, step 300 at TP 2 without the deterministic mode."""
    run = make_run(tmp_path, n_prompts=20, shard_size=10)
    rng = np.random.default_rng(3)
    _write_step(run, 100, (rng.random(20) < 0.3).astype(float), SGLANG_A)
    _write_step(run, 200, (rng.random(20) < 0.8).astype(float), replace(SGLANG_A, concurrency=8))  # same key
    _write_step(run, 300, (rng.random(20) < 0.8).astype(float), replace(SGLANG_A, tp=2, deterministic=False))
    return run


def test_compare_refuses_points_of_different_engines_naming_the_fields_unless_told(
    mixed_run: RunDir, capsys: pytest.CaptureFixture[str]
) -> None:
    assert compare.main([str(mixed_run.path), "--steps", "100", "200"]) == 0  # one identity
    assert compare.main([str(mixed_run.path), "--steps", "200", "300"]) == 2
    err = capsys.readouterr().err
    assert "tp, deterministic" in err and "tp 1 vs 2" in err and "--allow-engine-mismatch" in err, err
    assert compare.main([str(mixed_run.path), "--steps", "200", "300", "--allow-engine-mismatch", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["datasets"]
    assert "tp, deterministic" in row["engine_notes"][0]


def test_best_refuses_steps_of_different_engines_unless_told(mixed_run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    assert best.main([str(mixed_run.path)]) == 2
    err = capsys.readouterr().err
    assert "step 100 and step 300" in err and "tp, deterministic" in err and "--allow-engine-mismatch" in err, err
    assert not mixed_run.best_path("eval/add").exists()
    assert best.main([str(mixed_run.path), "--allow-engine-mismatch"]) == 0
    rec = json.loads(mixed_run.best_path("eval/add").read_text())
    assert len(rec["engine_notes"]) == 1 and "step 300" in rec["engine_notes"][0]


# -- deterministic decision sets ------------------------------------------------------------------------
def _launched_argv(tmp_path: Path, manifest: RunManifest, extra: dict[str, object] | None = None) -> list[str]:
    """The argv of the sglang server the worker's engine factory launches for ``manifest`` (fake sglang)."""
    delay = tmp_path / "delay"
    delay.write_text("0")
    env = fake_sglang.install(tmp_path / f"py{len(list(tmp_path.iterdir()))}", delay)
    settings = {**_settings(manifest, "sglang"), "env": env, "startup_timeout": 60, "stop_grace": 5,
                "log_path": str(tmp_path / "sglang.log"), **(extra or {})}
    engine = make_engine("sglang", "cpu", settings)
    try:
        engine.load(str(tmp_path), "v1")  # the first load launches
        return Path(f"/proc/{engine.pid}/cmdline").read_bytes().decode().split("\0")
    finally:
        engine.close()


def test_greedy_sets_launch_sglang_deterministic_and_an_opt_out_is_recorded(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path)
    manifest = run.manifest()
    assert manifest.eval.entries[0].temperature == 0  # greedy
    assert DETERMINISTIC_FLAG in _launched_argv(tmp_path, manifest)
    out = replace(manifest, eval=replace(manifest.eval, entries=(replace(manifest.eval.entries[0], deterministic=False),)))
    RunDir.create(run.path, out)  # the opt-out is part of run.json
    recorded = json.loads(run.manifest_path.read_text())["eval"]["datasets"][0]
    assert recorded["deterministic"] is False and run.manifest().eval.entries[0].deterministic is False
    assert DETERMINISTIC_FLAG not in _launched_argv(tmp_path, run.manifest())


def test_the_launch_refuses_an_attention_backend_sglang_refuses_in_deterministic_mode(tmp_path: Path) -> None:
    manifest = make_eval_run(tmp_path).manifest()
    with pytest.raises(ValueError, match="torch_native.*--attention-backend"):
        _launched_argv(tmp_path, manifest, {"extra_args": ["--attention-backend", "torch_native"]})
    argv = _launched_argv(tmp_path, manifest, {"extra_args": ["--attention-backend=triton"]})
    assert DETERMINISTIC_FLAG in argv and "--attention-backend=triton" in argv


def test_a_sampling_set_cannot_opt_out() -> None:
    from ckpteval.coord.entries.generate import GenerateEntry
    from ckpteval.coord.run.fields import FieldError

    with pytest.raises(FieldError, match="deterministic"):
        GenerateEntry("s", "s.jsonl", 4, temperature=0.7, deterministic=False)


# -- the stand-in --------------------------------------------------------------------------------------
def test_the_stand_in_rejects_what_sglang_rejects(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    cmd = [sys.executable, "-m", "ckpteval.jobs.cli", "serve", "--model", str(tmp_path), "--port", "0",
           "--enable-deterministic-inference", "--attention-backend", "torch_native"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Currently only" in done.stderr and "'torch_native'" in done.stderr, done.stderr


def test_the_deterministic_stand_in_reports_its_identity_and_is_batch_invariant(tiny_snapshot: Path) -> None:
    with in_process(tiny_snapshot, deterministic=True, max_running=32) as (_, url), \
            HTTPEngine(url, max_batch_size=64) as engine:
        identity = engine.engine_identity()
        assert (identity.kind, identity.version, identity.deterministic) == ("sglang", "0.5.23", True)
        assert identity.attention_backend == "fa3" and identity.concurrency == 32  # the server's running cap
        info = httpx.get(f"{url}/server_info").json()
        assert info["sampling_backend"] == "pytorch" and info["disable_radix_cache"] is False
        body = {"sampling_params": {"max_new_tokens": 6, "temperature": 0}}
        alone = httpx.post(f"{url}/generate", json={**body, "text": "12+34="}).json()["text"]
        batch = httpx.post(f"{url}/generate", json={**body, "text": ["1+1=", "12+34=", "987+6="]}).json()
        assert batch[1]["text"] == alone


# -- cost: eval/cost/fraction_of_training ----------------------------------------------------------------
def test_fraction_of_training_is_eval_gpu_seconds_over_the_trainers_across_a_restart(tmp_path: Path) -> None:
    """A 4-GPU trainer (its clock driven by the test) trains 100 s to step 2, is requeued, trains 50 s more to
    step 4; each point's two units cost 10 GPU-s each. Fractions: 20/400 at step 2, (20+20)/600 at step 4."""
    from ckpteval.coord.run.ledger import Ledger
    from ckpteval.jobs.metrics import MetricsSink
    from ckpteval.jobs.reference.model import ModelConfig, build_model
    from ckpteval.jobs.trainer.dispatcher import EvalDispatcher
    from tests.support.training import eval_lines, make_train_run

    run, dispatch = make_train_run(tmp_path / "run", eval_interval=2)
    dispatch = replace(dispatch, trainer_gpus=4)
    model = build_model(ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2,
                                    intermediate_size=64), "llama", seed=0)
    now = [0.0]

    def point(d: EvalDispatcher, step: int) -> None:
        now[0] += {2: 100.0, 4: 50.0}[step]
        d.maybe_dispatch(step, model)
        assert d.exporter is not None and d.exporter.wait(60)
        manifest = run.manifest()
        for unit in units_for_step(manifest, step):
            n = len(shard_range(manifest, unit))
            write_result(run.results, ok_result(unit, [1.0] * n, [str(step)] * n, cost={"gpu_s": 10.0}))
        d.poll(force=True)

    def dispatcher() -> EvalDispatcher:
        return EvalDispatcher.open(dispatch.with_waits(poll_interval_s=0.0), run, MetricsSink(run.metrics_path), run.base,
                              clock=lambda: now[0])

    point(dispatcher(), 2)
    now[0] += 1000.0  # requeued: the time the trainer was down is not training
    point(dispatcher(), 4)
    logged = {int(r["eval/step"]): r for r in eval_lines(run.path)}
    assert logged[2]["eval/cost/fraction_of_training"] == pytest.approx(20 / 400)
    assert logged[4]["eval/cost/fraction_of_training"] == pytest.approx(40 / 600)
    assert Ledger(run.ledger_path, repair=False).state.dispatched[4]["train_gpu_s"] == pytest.approx(600)
    status = collect_status(run.path)
    assert status["cost"]["fraction_of_training"] == pytest.approx(40 / 600)
    assert "6.7% of training GPU-s" in cost_line(status["cost"])
