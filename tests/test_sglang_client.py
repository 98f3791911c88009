"""The sglang client against a stub that misbehaves the way real sglang can.

A fake is needed here because real sglang needs a GPU, and ``ckpteval serve`` cannot be made to abort
a sample on cue, fail a load halfway or split a sample across two versions. The stub is a real HTTP
server speaking sglang 0.5.23's shapes (sglang wheel paths): HTTP 200 with ``finish_reason.type ==
"abort"`` (``srt/managers/tokenizer_manager.py`` ``_handle_abort_finish_reason`` leaves aborts without a
status code at 200), 400 rejections in the three body shapes, a failed ``/update_weights_from_disk`` that
keeps the old label (``tokenizer_manager.py`` ``update_weights_from_disk``; the weights may be partly
replaced, ``model_runner_components/weight_updater.py``), ``weight_versions`` spans
(``srt/utils/weight_versions.py``), ``/server_info`` ``version``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from ckpteval.coord.atomic import read_json_object
from ckpteval.coord.results.files import ResultIndex, ok_result, parse_result, retry_due
from ckpteval.coord.results.points import derive_point, point_metrics
from ckpteval.coord.run.rundir import RunDir, unit_dir
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.engines.base import EngineError, RequestRejected, SamplesAborted, SamplingParams
from ckpteval.jobs.eval.engines.http.engine import HEALTH_TIMEOUT_S, HTTPEngine
from ckpteval.jobs.eval.engines.http.limits import (
    BUSY_MESSAGES,
    QUEUE_FULL,
    RUNNING_TIMEOUT,
    RunningTimedOut,
    ServerBusy,
)
from ckpteval.jobs.eval.engines.sglang.version import UnsupportedServer
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
from ckpteval.jobs.eval.worker.evaluators import EngineEvaluator, evaluate_unit
from ckpteval.jobs.eval.worker.options import WorkerOptions
from tests.support.workers import make_eval_run, publish_model, run_inprocess

Reply = tuple[int, Any]


def item(text: str, version: str, finish: dict[str, Any] | None = None, spans: list | None = None) -> dict[str, Any]:
    meta = {
        "id": "x",
        "finish_reason": finish or {"type": "stop", "matched": 2},
        "prompt_tokens": 3,
        "weight_version": version,
        "completion_tokens": len(text),
        "weight_versions": spans or [{"version": version, "start": 0, "end": len(text)}],
    }
    return {"text": text, "output_ids": list(range(len(text))), "meta_info": meta}


def aborted(version: str) -> dict[str, Any]:
    """An abort as sglang reports one cut by /abort_request: partial text, no prompt_tokens."""
    finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    return {
        "text": "par",
        "output_ids": [5, 6, 7],
        "meta_info": {"id": "x", "finish_reason": finish, "weight_version": version, "completion_tokens": 3,
                      "weight_versions": [{"version": version, "start": 0, "end": 3}]},
    }  # fmt: skip


class Stub:
    """Scripted sglang: ``generate``/``load`` replies are taken from the scripts, else behave normally."""

    def __init__(self, version: str | None = "0.5.23", deterministic: bool = True, new_routes: bool = True) -> None:
        self.version, self.deterministic, self.new_routes = version, deterministic, new_routes
        self.label = "default"
        self.requests: list[tuple[str, Any]] = []
        self.generate_script: list[Callable[[dict[str, Any]], Reply]] = []
        self.load_script: list[Reply] = []
        self.extra_info: dict[str, Any] = {}  # more /server_info fields (server args)

    def normal(self, body: dict[str, Any]) -> Reply:
        return 200, [item("ok", self.label) for _ in body["text"]]

    def handle(self, method: str, path: str, body: Any) -> Reply:
        self.requests.append((path, body))
        if path in ("/server_info", "/model_info") and not self.new_routes:
            return 404, {"detail": "Not Found"}
        if path in ("/server_info", "/get_server_info"):
            info = {"enable_deterministic_inference": self.deterministic, **self.extra_info}
            return 200, info | ({} if self.version is None else {"version": self.version})
        if path in ("/model_info", "/get_model_info"):
            return 200, {"model_path": "/m", "weight_version": self.label}
        if path == "/health_generate":
            return 200, None
        if path == "/generate":
            return (self.generate_script.pop(0) if self.generate_script else self.normal)(body)
        if path == "/update_weights_from_disk":
            if self.load_script:
                return self.load_script.pop(0)
            self.label = body["weight_version"]
            return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        return 404, {"detail": "Not Found"}

    def calls(self, path: str) -> list[Any]:
        return [body for p, body in self.requests if p == path]


@pytest.fixture
def stub() -> Iterator[tuple[Stub, str]]:
    state = Stub()

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            status, payload = state.handle(self.command, self.path, body)
            data = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _serve

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


SAMPLED = SamplingParams(max_new_tokens=4, temperature=0.7)


def engine(url: str, **kw: Any) -> HTTPEngine:
    return HTTPEngine(url, **{"abort_retry_delay": 0.0, "busy_retry_delay": 0.0, **kw})


# --------------------------------------------------------------------------------------------------
# HTTPEngine alone
# --------------------------------------------------------------------------------------------------


def test_an_aborted_sample_is_resent_with_its_seed_and_never_scored(stub: tuple[Stub, str]) -> None:
    state, url = stub
    state.generate_script.append(lambda body: (200, [item("aa", "default"), aborted("default"), item("cc", "default")]))
    gens = engine(url).generate(["a", "b", "c"], SAMPLED, seeds=[11, 22, 33])
    assert [g.text for g in gens] == ["aa", "ok", "cc"]  # the partial "par" never comes back
    first, retry = state.calls("/generate")
    assert [p["sampling_seed"] for p in first["sampling_params"]] == [11, 22, 33]
    assert retry["text"] == ["b"] and [p["sampling_seed"] for p in retry["sampling_params"]] == [22]


def test_samples_aborted_on_every_try_fail_the_call(stub: tuple[Stub, str]) -> None:
    state, url = stub
    state.generate_script += [lambda body: (200, [aborted("default") for _ in body["text"]])] * 3
    with pytest.raises(SamplesAborted, match="2 of 2 samples came back aborted .* 3 times"):
        engine(url, abort_retries=2).generate(["a", "b"], SAMPLED)
    assert len(state.calls("/generate")) == 3


@pytest.mark.parametrize(
    "payload",
    [
        {"error": "unknown field `foo`, expected one of `max_new_tokens`"},
        {"error": {"message": "The input (70 tokens) is longer than the model's context length (64 tokens)."}},
        {"object": "error", "message": "text: Input should be a valid string", "type": "Bad Request",
         "param": None, "code": 400},
    ],
    ids=["schema-gate", "value-error", "error-response"],
)  # fmt: skip
def test_a_4xx_is_a_rejection_carrying_the_servers_message(stub: tuple[Stub, str], payload: dict) -> None:
    state, url = stub
    state.generate_script.append(lambda body: (400, payload))
    with pytest.raises(RequestRejected) as caught:
        engine(url).generate(["a"], SAMPLED)
    message = payload["error"] if isinstance(payload.get("error"), str) else payload.get("message") or payload["error"]["message"]
    assert message in str(caught.value)


@pytest.mark.parametrize("status, payload", [(429, "overloaded"), (500, "boom"), (502, "bad gateway"), (503, None)])
def test_a_5xx_or_rate_limit_is_not_a_rejection(stub: tuple[Stub, str], status: int, payload: str | None) -> None:
    """Other 5xx and a bare 503 (no message: a proxy, a server shutting down) keep the restart."""
    state, url = stub
    body = None if payload is None else {"object": "error", "message": payload, "code": status}
    state.generate_script.append(lambda _: (status, body))
    with pytest.raises(EngineError) as caught:
        engine(url).generate(["a"], SAMPLED)
    assert not isinstance(caught.value, RequestRejected) and caught.value.restart_helps
    assert len(state.calls("/generate")) == 1  # not retried


def _busy(message: str) -> Callable[[dict[str, Any]], Reply]:
    """sglang's 503 for a shed request: an HTTPException rendered as ErrorResponse (http_limits docstring)."""
    return lambda _: (503, {"object": "error", "message": message, "type": "503", "param": None, "code": 503})


@pytest.mark.parametrize("message", [m for m in BUSY_MESSAGES if m != RUNNING_TIMEOUT])
def test_a_503_with_a_message_is_retried_not_restarted(stub: tuple[Stub, str], message: str) -> None:
    state, url = stub
    state.generate_script += [_busy(message)] * 2
    assert [g.text for g in engine(url, busy_retries=2).generate(["a"], SAMPLED)] == ["ok"]
    assert len(state.calls("/generate")) == 3
    state.generate_script += [_busy(message)] * 3
    with pytest.raises(ServerBusy, match="overloaded") as caught:
        engine(url, busy_retries=2).generate(["a"], SAMPLED)
    assert caught.value.reason == "overloaded" and not caught.value.restart_helps


def test_a_queue_full_chunk_is_resent_halved_and_finished_chunks_are_kept(stub: tuple[Stub, str]) -> None:
    """sglang throws away a batch's finished items when one is shed (tokenizer_manager.py
    _collect_batch_responses): the client resends only the chunk that failed, halved."""
    state, url = stub
    state.extra_info = {"max_queued_requests": 8}  # chunks of 4
    state.generate_script += [state.normal, _busy(QUEUE_FULL)]
    out = engine(url, busy_retries=0).generate([f"p{i}" for i in range(10)], SAMPLED)
    assert len(out) == 10
    assert [b["text"] for b in state.calls("/generate")] == [
        ["p0", "p1", "p2", "p3"], ["p4", "p5", "p6", "p7"], ["p4", "p5"], ["p6", "p7"], ["p8", "p9"]]


def test_a_running_timeout_is_not_retried(stub: tuple[Stub, str]) -> None:
    state, url = stub
    state.generate_script += [_busy(RUNNING_TIMEOUT)] * 5
    with pytest.raises(RunningTimedOut) as caught:
        engine(url, busy_retries=4).generate(["a"], SAMPLED)
    assert caught.value.reason == "generate_timeout" and not caught.value.restart_helps
    assert len(state.calls("/generate")) == 1


def test_the_canary_request_is_handled_like_a_generate(stub: tuple[Stub, str]) -> None:
    """A busy 503 or an aborted reply to the canary's /generate is retried, never a restart (EngineError
    with restart_helps); staying aborted is SamplesAborted; a 4xx is the canary absent."""
    state, url = stub
    refused = (400, {"error": {"message": "return_logprob is not supported"}})
    state.generate_script += [_busy(QUEUE_FULL), lambda body: (200, [aborted("default")] * len(body["text"])),
                              lambda _: refused]
    with pytest.raises(RequestRejected, match="return_logprob"):
        engine(url, busy_retries=1).teacher_forced([("1+1=", "2")])
    assert len(state.calls("/generate")) == 3
    state.generate_script += [lambda body: (200, [aborted("default")] * len(body["text"]))] * 3
    with pytest.raises(SamplesAborted) as caught:
        engine(url, abort_retries=2).teacher_forced([("1+1=", "2")])
    assert not caught.value.restart_helps


def test_gpus_count_pipeline_parallelism_and_not_dp_attention(stub: tuple[Stub, str]) -> None:
    state, url = stub
    state.extra_info = {"tp_size": 4, "dp_size": 2, "pp_size": 2}
    assert engine(url).gpus == 16
    state.extra_info = {"tp_size": 8, "dp_size": 8, "pp_size": 1, "enable_dp_attention": True}  # attention DP in TP
    assert engine(url).gpus == 8


def test_the_generate_timeout_grows_with_max_new_tokens_and_waves(stub: tuple[Stub, str]) -> None:
    """A flat timeout cuts a long batch (and sglang aborts a request whose client left); the derived one
    is base + per-token time x max_new_tokens x waves of ``max_running_requests``."""
    state, url = stub

    def slow(body: dict[str, Any]) -> Reply:
        time.sleep(1.0)
        return state.normal(body)

    state.generate_script += [slow] * 3
    patient = engine(url, timeout=0.2, token_timeout_s=0.15)
    assert len(patient.generate(["a"], SamplingParams(max_new_tokens=8))) == 1  # 0.2 + 1.2 s > 1 s
    with pytest.raises(EngineError, match="Timeout"):
        patient.generate(["a"], SamplingParams(max_new_tokens=2))  # 0.2 + 0.3 s < 1 s
    state.extra_info = {"max_running_requests": 64,  # the arg; what runs is what the scheduler reports
                        "internal_states": [{"effective_max_running_requests_per_dp": 1}]}
    waves = engine(url, timeout=0.2, token_timeout_s=0.15)
    assert len(waves.generate(["a", "b"], SamplingParams(max_new_tokens=4))) == 2  # 0.2 + 0.6 x 2 s > 1 s


def test_a_sample_spanning_two_versions_carries_both(stub: tuple[Stub, str]) -> None:
    state, url = stub
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    state.generate_script.append(lambda body: (200, [item("hello", "4", spans=spans), item("one", "4")]))
    mixed, clean = engine(url).generate(["a", "b"], SAMPLED)
    assert mixed.weight_version == "3|4" and clean.weight_version == "4"


def test_a_failed_load_leaves_the_version_unknown_until_a_good_load(stub: tuple[Stub, str]) -> None:
    state, url = stub
    e = engine(url)
    e.load("/snap/1", "1")
    state.load_script.append(
        (400, {"success": False, "message": "Failed to update weights: boom.\nRolling back to original weights.",
               "num_paused_requests": 0})
    )  # fmt: skip
    with pytest.raises(EngineError, match="weights are now unknown"):
        e.load("/snap/2", "2")
    assert e.model_info()["weight_version"] == "1"  # sglang keeps the old label ...
    assert e.weight_version() is None  # ... the engine does not trust it
    e.load("/snap/1", "1")
    assert e.weight_version() == "1"


def test_seeds_travel_per_prompt_inside_sampling_params(stub: tuple[Stub, str]) -> None:
    state, url = stub
    e = engine(url)
    e.generate(["a", "b"], SAMPLED, seeds=[1, 2])
    e.generate(["a", "b"], SamplingParams(max_new_tokens=4), seeds=[1, 2])  # greedy: seeds are moot
    e.generate(["a", "b"], SamplingParams(max_new_tokens=4, temperature=0.5, top_k=0, seed=9))
    per_prompt, greedy, one_seed = state.calls("/generate")
    assert per_prompt["sampling_params"] == [
        {"max_new_tokens": 4, "temperature": 0.7, "top_p": 1.0, "top_k": -1, "sampling_seed": s} for s in (1, 2)
    ]
    assert greedy["sampling_params"] == {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "top_k": -1}
    assert one_seed["sampling_params"]["sampling_seed"] == 9 and one_seed["sampling_params"]["top_k"] == -1
    with pytest.raises(ValueError, match="one int per prompt"):
        e.generate(["a", "b"], SAMPLED, seeds=[1])


def test_a_server_ignoring_seeds_is_reported_once(stub: tuple[Stub, str], capsys: pytest.CaptureFixture[str]) -> None:
    state, url = stub
    state.deterministic = False
    e = engine(url)
    e.generate(["a"], SAMPLED, seeds=[1])
    e.generate(["a"], SAMPLED, seeds=[2])
    assert capsys.readouterr().err.count("--enable-deterministic-inference") == 1


@pytest.mark.parametrize("version", ["0.4.10", "0.5.3", "0.5.18", "0.6.0", "dev", None])
def test_a_server_outside_the_pinned_range_is_refused(stub: tuple[Stub, str], version: str | None) -> None:
    state, url = stub
    state.version = version
    e = engine(url)
    for call in (e.weight_version, lambda: e.generate(["a"], SAMPLED), lambda: e.load("/snap", "1")):
        with pytest.raises(UnsupportedServer, match=r"sglang>=0\.5\.19,<0\.6"):
            call()
    assert state.calls("/generate") == [] and state.calls("/update_weights_from_disk") == []


def test_older_route_names_are_used_when_the_new_ones_404(stub: tuple[Stub, str]) -> None:
    state, url = stub
    state.new_routes, state.version = False, "0.5.19"
    e = engine(url)
    e.load("/snap", "5")
    assert e.weight_version() == "5"
    paths = [p for p, _ in state.requests]
    assert "/get_server_info" in paths and "/get_model_info" in paths


def test_the_health_probe_outwaits_sglangs_own_20s_budget() -> None:
    assert HEALTH_TIMEOUT_S > 21  # health_generate: HEALTH_CHECK_TIMEOUT = 20 s, polled once a second
    assert HTTPEngine("http://127.0.0.1:1")._health_timeout == HEALTH_TIMEOUT_S


# --------------------------------------------------------------------------------------------------
# The worker's evaluator on top: skip reasons, restarts, reloads, pin
# --------------------------------------------------------------------------------------------------


def _unit(tmp_path: Path, url: str) -> tuple[EngineEvaluator, Any, list[str], DatasetCache]:
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4)
    publish_model(tmp_path, run.snapshots, 1)
    (ref,) = SnapshotDiscovery(run.snapshots).poll()
    restarts: list[str] = []
    cache = DatasetCache(run, run.manifest())
    http = engine(url, launcher=lambda: restarts.append("restart"))
    return EngineEvaluator(http, cache, 1.0, 60.0), ref, restarts, cache


def test_a_rejected_unit_is_skipped_without_a_restart(stub: tuple[Stub, str], tmp_path: Path) -> None:
    state, url = stub
    evaluator, ref, restarts, _ = _unit(tmp_path, url)
    message = "The input (70 tokens) is longer than the model's context length (64 tokens)."
    state.generate_script.append(lambda body: (400, {"error": {"message": message}}))
    result = evaluate_unit(evaluator, WorkUnit(1, "addition", 0), ref, "fast")
    assert result.skip_reason == "rejected" and message in result.message
    assert restarts == []


def test_an_aborted_unit_is_skipped_without_a_restart(stub: tuple[Stub, str], tmp_path: Path) -> None:
    state, url = stub
    evaluator, ref, restarts, _ = _unit(tmp_path, url)
    state.generate_script += [lambda body: (200, [aborted(state.label) for _ in body["text"]])] * 3
    result = evaluate_unit(evaluator, WorkUnit(1, "addition", 0), ref, "fast")
    assert result.skip_reason == "aborted" and restarts == []


def test_a_dead_server_is_restarted(stub: tuple[Stub, str], tmp_path: Path) -> None:
    state, url = stub
    evaluator, ref, restarts, _ = _unit(tmp_path, url)
    state.generate_script += [lambda body: (500, {"object": "error", "message": "down", "code": 500})] * 2
    result = evaluate_unit(evaluator, WorkUnit(1, "addition", 0), ref, "fast")
    assert restarts == ["restart"] and result.skip_reason == "unhealthy"


def test_a_unit_on_an_overloaded_server_is_skipped_without_a_restart(stub: tuple[Stub, str], tmp_path: Path) -> None:
    state, url = stub
    evaluator, ref, restarts, _ = _unit(tmp_path, url)
    state.generate_script += [_busy("The request queue is full.")] * 200  # full at every chunk size, every retry
    result = evaluate_unit(evaluator, WorkUnit(1, "addition", 0), ref, "fast")
    assert result.skip_reason == "overloaded" and "queue is full" in result.message and restarts == []


def test_after_a_failed_load_the_next_unit_reloads_whatever_the_label(stub: tuple[Stub, str], tmp_path: Path) -> None:
    state, url = stub
    evaluator, ref, _, _ = _unit(tmp_path, url)
    first = evaluate_unit(evaluator, WorkUnit(1, "addition", 0), ref, "fast")
    assert first.ok
    pinned = state.label  # the label the evaluator pins for step 1
    state.load_script.append((400, {"success": False, "message": "Failed to update weights: boom.", "num_paused_requests": 0}))
    with pytest.raises(EngineError):
        evaluator.engine.load(str(ref.path), pinned)  # someone's load on this engine fails halfway
    assert state.label == pinned  # the label still says step 1
    loads = len(state.calls("/update_weights_from_disk"))
    again = evaluate_unit(evaluator, WorkUnit(1, "addition", 0), ref, "fast")
    assert again.ok and len(state.calls("/update_weights_from_disk")) == loads + 1


def test_a_sample_spanning_a_weight_update_fails_the_pin_and_counts_as_mixed(
    stub: tuple[Stub, str], tmp_path: Path
) -> None:
    state, url = stub
    evaluator, ref, _, cache = _unit(tmp_path, url)
    evaluate_unit(evaluator, WorkUnit(1, "addition", 0), ref, "fast")  # pins the label for step 1
    want = state.label
    spans = [{"version": "0", "start": 0, "end": 1}, {"version": want, "start": 1, "end": 2}]
    state.generate_script.append(lambda body: (200, [item("ok", want, spans=spans)] + [item("ok", want)] * 3))
    result = evaluate_unit(evaluator, WorkUnit(1, "addition", 0), ref, "fast")
    assert result.skip_reason == "pin_violation" and f"0|{want}" in result.message
    versions = [f"0|{want}", want, want, want]
    point = derive_point(cache.manifest, 1, {WorkUnit(1, "addition", 0): ok_result(WorkUnit(1, "addition", 0), [0.0] * 4, versions)})
    assert point.datasets["addition"].mixed_version_ratio > 0


# --------------------------------------------------------------------------------------------------
# A dataset's own /generate timeout (run.json generate_timeout_s)
# --------------------------------------------------------------------------------------------------


def _with_dataset(run: RunDir, **fields: Any) -> RunDir:
    """``run`` with its one dataset's settings changed (run.json rewritten, as a run is created)."""
    manifest = run.manifest()
    datasets = tuple(replace(d, **fields) for d in manifest.eval.entries)
    return RunDir.create(run.path, replace(manifest, eval=replace(manifest.eval, entries=datasets)))


def test_a_datasets_generate_timeout_bounds_its_requests(stub: tuple[Stub, str], tmp_path: Path) -> None:
    """A slow batch outliving a small ``generate_timeout_s`` is a ``generate_timeout`` skip, without a
    restart (sglang aborts a request whose client left); a large one lets it finish although the engine's
    derived timeout (0.2 s here) would have cut it."""
    state, url = stub

    def slow(body: dict[str, Any]) -> Reply:
        time.sleep(1.0)
        return state.normal(body)

    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4)
    publish_model(tmp_path, run.snapshots, 1)
    (ref,) = SnapshotDiscovery(run.snapshots).poll()
    outcomes, restarts = [], []
    for timeout_s in (0.3, 5.0):
        cache = DatasetCache(run, _with_dataset(run, generate_timeout_s=timeout_s).manifest())
        http = engine(url, timeout=0.2, token_timeout_s=0.0, launcher=lambda: restarts.append("restart"))
        state.generate_script.append(slow)
        result = evaluate_unit(EngineEvaluator(http, cache, 1.0, 60.0), WorkUnit(1, "addition", 0), ref, "fast")
        outcomes.append((result.status, result.skip_reason))
        if not result.ok:
            assert "generate_timeout_s (0.3 s)" in result.message
    assert outcomes == [("skipped", "generate_timeout"), ("ok", None)] and restarts == []


# --------------------------------------------------------------------------------------------------
# An overloaded skip is retried later (an infrastructure skip), after a backoff
# --------------------------------------------------------------------------------------------------


def test_a_unit_shed_by_an_overloaded_server_is_retried_after_a_backoff_and_scored(
    stub: tuple[Stub, str], tmp_path: Path
) -> None:
    """A real worker (``--once --retry-infra-skips``, what every backfill does) against a server that sheds
    with sglang's 503 for a while, then serves: the unit is first skipped ``overloaded``, re-evaluated no
    sooner than ``--retry-backoff`` after that skip was written (retry generation 1), and the point ends
    scored."""
    state, url = stub
    engine_settings = {"http": {"busy_retries": 1, "busy_retry_delay": 0.0, "abort_retry_delay": 0.0}}
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4, engine=engine_settings)
    publish_model(tmp_path, run.snapshots, 1)
    state.generate_script += [_busy("The request queue is full.")] * 6  # 4, 2, 1 prompts, 1 + 1 retry each: shed
    opts = WorkerOptions(run_dir=run.path, engines=(f"http:{url}",), once=True, retry_infra_skips=True,
                         retry_backoff_s=0.5, poll_interval_s=0.05, pin_timeout_s=0.3)
    lines: list[str] = []
    code, _ = run_inprocess(opts, out=lines.append)
    assert code == 0, lines
    unit = WorkUnit(1, "addition", 0)
    step_dir = unit_dir(run.results, unit.step)
    first, retry = (parse_result(read_json_object(p), p) for p in (step_dir / f"{unit.id}.json",
                                                                   step_dir / f"{unit.id}.retry1.json"))
    assert first.skip_reason == "overloaded" and "queue is full" in first.message
    assert retry.ok and retry.written_at - first.written_at >= 0.5  # waited out the backoff (a lower bound)
    # the next generation waits twice as long, on the skip's own written_at (every worker agrees)
    assert [retry_due(first, 1, 0.5, now=first.written_at + dt) for dt in (0.9, 1.0)] == [False, True]
    point = derive_point(run.manifest(), 1, ResultIndex(run.results).refresh())
    assert point.complete and not point.skips and "eval/skipped_overloaded" not in point_metrics(point)
