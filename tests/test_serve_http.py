"""``ckpteval serve`` as a real subprocess, spoken to over HTTP directly and through ``HTTPEngine``.

The expectations are sglang 0.5.23's, read from its wheel (paths inside it): routes from
``srt/entrypoints/http_server.py``, 400 bodies from its three error paths (``validation_exception_handler``,
the ``sglang/api/v1/api_types.py`` schema gate, ``_create_error_response``), sampling checks from
``srt/sampling/sampling_params.py`` ``verify``, length checks from ``srt/managers/tokenizer_manager.py``
``_validate_one_request``, aborts and spans from ``schedule_batch.py`` / ``srt/utils/weight_versions.py``.
"""

from __future__ import annotations

import contextlib
import json
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from ckpteval.jobs.eval.engines.base import EngineError, SamplingParams
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.engines.http.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, Unauthorized
from ckpteval.jobs.eval.engines.http.engine import HTTPEngine
from ckpteval.jobs.eval.engines.http.limits import ServerBusy
from ckpteval.jobs.eval.engines.sglang.engine import free_port
from ckpteval.jobs.reference.model import make_addition_examples
from ckpteval.jobs.reference.serve.engine import EngineService
from ckpteval.jobs.reference.serve.http import EngineHTTPServer

REPO = Path(__file__).resolve().parents[1]
SnapshotFactory = Callable[..., Path]
PROMPTS = [ex["prompt"] for ex in make_addition_examples(10, seed=1)] + ["5", "12+"]
GREEDY = SamplingParams(max_new_tokens=6)


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[str]
    snapshot: Path


def start_server(snapshot: Path, version: str, log: Path, *extra: str, timeout: float = 60.0) -> Server:
    """Launch ``python -m ckpteval.jobs.cli serve`` on a free port; return once it prints its URL."""
    cmd = [sys.executable, "-m", "ckpteval.jobs.cli", "serve", "--model", str(snapshot), "--port", "0"]
    cmd += ["--weight-version", version, *extra]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line.startswith("serving on "):
                return Server(line.split()[-1], proc, snapshot)
    proc.kill()
    raise RuntimeError(f"serve did not start (rc={proc.poll()}): {log.read_text()[-2000:]}")


def stop_server(server: Server) -> int:
    server.proc.send_signal(signal.SIGTERM)
    return server.proc.wait(timeout=20)


@pytest.fixture(scope="module")
def server(snapshot_factory: SnapshotFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(snapshot_factory(seed=0), "0", tmp_path_factory.mktemp("serve") / "stderr.log")
    yield s
    if s.proc.poll() is None:
        stop_server(s)


@pytest.fixture(scope="module")
def deterministic_server(
    snapshot_factory: SnapshotFactory, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("serve-det") / "stderr.log"
    s = start_server(snapshot_factory(seed=0), "0", log, "--enable-deterministic-inference")
    yield s
    if s.proc.poll() is None:
        stop_server(s)


def post(server: Server, path: str, body: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=120
    )


def load(server: Server, snapshot: Path, version: str | None) -> httpx.Response:
    body = {"model_path": str(snapshot)} | ({} if version is None else {"weight_version": version})
    return post(server, "/update_weights_from_disk", body)


def plain_transformers_greedy(snapshot: Path, prompts: list[str], max_new_tokens: int) -> list[str]:
    """An independent reference: one prompt at a time through ``model.generate``."""
    model = AutoModelForCausalLM.from_pretrained(snapshot, use_safetensors=True, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(snapshot, local_files_only=True)
    texts = []
    for prompt in prompts:
        enc = tok(prompt, return_tensors="pt")
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        new = out[0, enc["input_ids"].shape[1] :].tolist()
        if tok.eos_token_id in new:
            new = new[: new.index(tok.eos_token_id)]
        texts.append(tok.decode(new, skip_special_tokens=True))
    return texts


# --------------------------------------------------------------------------------------------------
# Raw HTTP: sglang's request and response shapes
# --------------------------------------------------------------------------------------------------


def test_generate_answers_in_sglang_shapes(server: Server) -> None:
    assert load(server, server.snapshot, "0").status_code == 200
    single = post(
        server, "/generate", {"text": "07+35=", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    )
    assert single.status_code == 200
    item = single.json()
    meta = item["meta_info"]
    assert isinstance(item["text"], str) and meta["weight_version"] == "0"
    assert meta["completion_tokens"] == len(item["output_ids"]) and meta["prompt_tokens"] == 7
    assert meta["finish_reason"]["type"] in {"stop", "length"}
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": meta["completion_tokens"]}]

    batch = post(
        server, "/generate", {"text": ["1+1=", "22+"], "sampling_params": {"temperature": 0}, "rid": "b"}
    ).json()
    assert isinstance(batch, list) and [b["meta_info"]["id"] for b in batch] == ["b_0", "b_1"]
    by_ids = post(
        server,
        "/generate",
        {"input_ids": [1, 4, 11, 14, 7, 9, 15], "sampling_params": {"temperature": 0, "max_new_tokens": 4}},
    )
    assert by_ids.json()["output_ids"] == item["output_ids"]  # the same prompt, tokenized by hand
    per_item = [{"max_new_tokens": 1}, {"max_new_tokens": 3, "temperature": 0}]
    mixed = post(server, "/generate", {"input_ids": [[1, 5], [1, 6, 7]], "sampling_params": per_item}).json()
    assert len(mixed[0]["output_ids"]) == 1 and 1 <= len(mixed[1]["output_ids"]) <= 3


def test_max_new_tokens_zero_is_valid_and_the_default_is_capped_at_the_context(server: Server) -> None:
    zero = post(server, "/generate", {"text": "1+1=", "sampling_params": {"max_new_tokens": 0}})
    assert zero.status_code == 200
    meta = zero.json()["meta_info"]
    assert zero.json()["text"] == "" and meta["completion_tokens"] == 0
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    # No max_new_tokens: sglang's default 128, capped by the scheduler at context - prompt - 2 (64 - 7 - 2).
    unbounded = post(server, "/generate", {"text": "07+35=", "sampling_params": {"temperature": 0, "top_k": -1}})
    assert unbounded.status_code == 200 and unbounded.json()["meta_info"]["completion_tokens"] <= 55


def test_update_weights_from_disk_and_model_info_read_back(
    server: Server, snapshot_factory: SnapshotFactory
) -> None:
    other = snapshot_factory(seed=1)
    reply = load(server, other, "11")
    assert reply.status_code == 200
    assert reply.json()["success"] is True and "11" in reply.json()["message"]
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(server.url + path).json()
        assert info["weight_version"] == "11" and info["model_path"] == str(other)
    gen = post(server, "/generate", {"text": "1", "sampling_params": {"max_new_tokens": 1}}).json()
    assert gen["meta_info"]["weight_version"] == "11"

    failed = load(server, other / "missing", "12")
    assert failed.status_code == 400 and failed.json()["success"] is False and failed.json()["message"]
    info = httpx.get(server.url + "/model_info").json()
    assert info["weight_version"] == "11" and info["model_path"] == str(other)  # only a success changes them

    # Without a weight_version the version is left as it was (sglang's behaviour).
    assert load(server, server.snapshot, None).status_code == 200
    info = httpx.get(server.url + "/model_info").json()
    assert info["weight_version"] == "11" and info["model_path"] == str(server.snapshot)


def test_server_info_reports_the_emulated_sglang_release(server: Server) -> None:
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(server.url + path).json()
        assert info["version"] == "0.5.23" and info["enable_deterministic_inference"] is False


def test_v1_models_lists_the_served_model_as_sglang_0_5_23_does(server: Server) -> None:
    """``GET /v1/models``: a ``ModelList`` with one ``ModelCard`` (sglang ``http_server.py`` ``available_models``):
    id and root the served name (the launch path, as ``/server_info``'s ``served_model_name``), owned by
    sglang, the model's context length; no adapter cards (no LoRA)."""
    reply = httpx.get(server.url + "/v1/models")
    assert reply.status_code == 200
    body = reply.json()
    name = httpx.get(server.url + "/server_info").json()["served_model_name"]
    assert body["object"] == "list" and len(body["data"]) == 1, body
    card = body["data"][0]
    assert {k: card[k] for k in ("id", "object", "owned_by", "root", "parent")} == {
        "id": name, "object": "model", "owned_by": "sglang", "root": name, "parent": None}
    assert isinstance(card["created"], int) and card["max_model_len"] > 0


def test_update_weight_version_relabels_without_a_load(server: Server) -> None:
    reply = post(server, "/update_weight_version", {"new_version": "relabelled"})
    assert reply.status_code == 200
    assert reply.json() == {"success": True, "message": "Weight version updated to relabelled", "new_version": "relabelled"}
    assert httpx.get(server.url + "/model_info").json()["weight_version"] == "relabelled"
    gen = post(server, "/generate", {"text": "1", "sampling_params": {"max_new_tokens": 2}}).json()
    assert gen["meta_info"]["weight_versions"][-1]["version"] == "relabelled"
    assert load(server, server.snapshot, "0").status_code == 200


def test_health_endpoints_answer_200_with_empty_bodies(server: Server) -> None:
    for path in ("/health", "/health_generate"):
        reply = httpx.get(server.url + path, timeout=30)
        assert reply.status_code == 200 and reply.content == b""


def _message(payload: dict[str, Any], shape: str) -> str:
    if shape == "error_response":  # FastAPI validation: ErrorResponse
        assert payload["object"] == "error" and payload["code"] == 400
        return payload["message"]
    if shape == "contract":  # the schema gate: a plain string
        assert isinstance(payload["error"], str)
        return payload["error"]
    assert shape == "value_error"  # a ValueError in the tokenizer manager
    return payload["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "shape", "says"),
    [
        ("/generate", b"{not json", "error_response", "JSON"),
        ("/generate", {"text": 5}, "error_response", "text"),
        ("/generate", {}, "value_error", "Either text, input_ids or input_embeds"),
        ("/generate", {"input_ids": []}, "value_error", "input_ids cannot be empty"),
        ("/generate", {"text": "1", "sampling_params": {"foo": 1}}, "contract", "unknown field `foo`"),
        ("/generate", {"text": "1", "sampling_params": {"max_new_tokens": 16.0}}, "contract",
         "invalid type: floating point `16.0`, expected i64"),
        ("/generate", {"text": "1", "sampling_params": {"max_new_tokens": "5"}}, "contract", 'string "5"'),
        ("/generate", {"text": "1", "sampling_params": {"temperature": True}}, "contract", "boolean `true`"),
        ("/generate", {"text": "1", "sampling_params": {"top_k": 0}}, "value_error",
         "top_k must be -1 (disable) or at least 1, got 0."),
        ("/generate", {"text": "1", "sampling_params": {"top_p": 0}}, "value_error", "top_p must be in (0, 1]"),
        ("/generate", {"text": "1", "sampling_params": {"temperature": -1}}, "value_error", "temperature must be"),
        ("/generate", {"text": "1", "sampling_params": {"max_new_tokens": -1}}, "value_error",
         "max_new_tokens must be at least 0"),
        ("/generate", {"text": "1" * 70}, "value_error", "longer than the model's context length (64 tokens)"),
        ("/generate", {"text": "1+1=", "sampling_params": {"max_new_tokens": 60}}, "value_error",
         "Requested token count exceeds the model's maximum context length"),
        ("/generate", {"text": "1", "lora_path": "adapter"}, "value_error", "LoRA is not enabled"),
        ("/generate", {"text": ["1", "2"], "rid": ["a"]}, "value_error", "rids length mismatch"),
        ("/generate", {"text": "1", "stream": True}, "value_error", "does not implement"),
        ("/generate", {"text": "1", "sampling_params": {"stop": "x"}}, "value_error", "does not implement"),
        ("/generate", {"input_ids": [[1, 999]]}, "value_error", "input_ids must be in"),
        ("/generate", {"text": ["1", "2"], "sampling_params": [{}]}, "value_error", "same length"),
        ("/update_weights_from_disk", {}, "error_response", "model_path"),
        ("/update_weights_from_disk", {"model_path": "/x", "weight_version": 3}, "error_response", "weight_version"),
        ("/update_weight_version", {}, "error_response", "new_version"),
        ("/pause_generation", {"mode": "sideways"}, "error_response", "mode"),
    ],
)  # fmt: skip
def test_bad_requests_get_sglangs_status_and_body(server: Server, path: str, body: object, shape: str, says: str) -> None:
    reply = post(server, path, body)
    assert reply.status_code == 400
    assert says in _message(reply.json(), shape)


def test_routes_sglang_0_5_23_lacks_are_404(server: Server) -> None:
    for path in ("/nope", "/get_weight_version", "/weight_version"):
        reply = httpx.get(server.url + path)
        assert reply.status_code == 404 and reply.json() == {"detail": "Not Found"}


# --------------------------------------------------------------------------------------------------
# Aborts, pause, seeds
# --------------------------------------------------------------------------------------------------

SLOW = {"text": [f"{i}+{i}=" for i in range(8)], "sampling_params": {"max_new_tokens": 32, "temperature": 1.0}}


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(value=fn()), daemon=True)
    thread.start()
    return thread, box


def _generate_while_aborting(server: Server, rid: str) -> list[dict]:
    """POST the slow batch as ``rid`` and abort its first prompt (``rid_0``, an exact rid: sglang drops
    the batch's prefix rid) until the reply comes back; the reply's items."""
    thread, box = _in_thread(lambda: post(server, "/generate", SLOW | {"rid": rid}))
    while thread.is_alive():  # aborting an unknown rid is a no-op: repeat until the request is live
        assert post(server, "/abort_request", {"rid": f"{rid}_0"}).status_code == 200
        thread.join(0.05)
    assert box["value"].status_code == 200
    return box["value"].json()


def test_abort_request_answers_200_with_abort_finish_reasons(server: Server) -> None:
    """On a quiet machine the batch can finish (every row at EOS) before the first abort reaches it:
    that attempt proves nothing, so the test waits for the event it asserts (an abort that landed)."""
    for attempt in range(20):
        items = _generate_while_aborting(server, f"slow{attempt}")
        if items[0]["meta_info"]["finish_reason"]["type"] == "abort":
            break
    else:
        pytest.fail("20 slow batches all finished before an abort reached them")
    assert [i["meta_info"]["id"] for i in items] == [f"slow{attempt}_{i}" for i in range(8)]
    assert [i["meta_info"]["finish_reason"]["type"] == "abort" for i in items] == [True] + [False] * 7
    meta = items[0]["meta_info"]
    assert meta["finish_reason"]["status_code"] is None
    assert "prompt_tokens" not in meta and meta["weight_version"] == "0"


def test_abort_request_aborts_what_sglang_would(tiny_snapshot: Path) -> None:
    """sglang forwards only an exact live rid (tokenizer_manager.py abort_request), then aborts every live
    rid starting with it (scheduler.py abort_request): the batch prefix "job" and "jo" abort nothing,
    "job_1" aborts job_1, job_10 and job_11. Requests queued behind a held engine are live and waiting."""
    batch = {"text": [f"{i}+1=" for i in range(12)], "sampling_params": {"max_new_tokens": 2}, "rid": "job"}
    with in_process(tiny_snapshot) as (service, url):
        with service.lock:  # a long batch runs: ours waits in the queue, registered
            thread, box = _in_thread(lambda: httpx.post(url + "/generate", json=batch, timeout=60))
            while len(service.live) < 12 and thread.is_alive():
                time.sleep(0.01)
            for rid in ("job", "jo", "job_1", "nobody"):
                assert httpx.post(url + "/abort_request", json={"rid": rid}).status_code == 200
        thread.join(60)
    items = box["value"].json()
    aborted = {i["meta_info"]["id"]: i["meta_info"]["finish_reason"] for i in items
               if i["meta_info"]["finish_reason"]["type"] == "abort"}
    assert sorted(aborted) == ["job_1", "job_10", "job_11"]
    assert {f["message"] for f in aborted.values()} == {"Abort in waiting queue"}


def test_pause_in_abort_mode_aborts_in_flight_and_holds_new_requests(server: Server) -> None:
    thread, box = _in_thread(lambda: post(server, "/generate", SLOW | {"rid": "paused"}))
    time.sleep(0.3)
    paused = post(server, "/pause_generation", {"mode": "abort"})
    assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
    thread.join(120)
    first = box["value"].json()
    later_thread, later = _in_thread(
        lambda: post(server, "/generate", {"text": "1+1=", "sampling_params": {"max_new_tokens": 2}})
    )
    later_thread.join(1.0)
    assert later_thread.is_alive()  # held until /continue_generation
    assert post(server, "/continue_generation", {}).json()["status"] == "ok"
    later_thread.join(60)
    assert later["value"].json()["meta_info"]["finish_reason"]["type"] in {"stop", "length"}
    # The in-flight request was either aborted, or had finished before the pause reached it.
    kinds = {i["meta_info"]["finish_reason"]["type"] for i in first}
    assert kinds <= {"abort"} or "abort" not in kinds


def test_sampling_seed_applies_only_with_deterministic_inference(
    server: Server, deterministic_server: Server
) -> None:
    hot = {"max_new_tokens": 6, "temperature": 5.0, "sampling_seed": 7}
    body = {"text": ["3+4="] * 6, "sampling_params": hot}
    same = post(deterministic_server, "/generate", body).json()
    assert len({tuple(i["output_ids"]) for i in same}) == 1  # one seed, one prompt: one sample
    info = httpx.get(deterministic_server.url + "/server_info").json()
    assert info["enable_deterministic_inference"] is True
    per_sample = [hot | {"sampling_seed": s} for s in range(6)]
    drawn = post(deterministic_server, "/generate", {"text": ["3+4="] * 6, "sampling_params": per_sample}).json()
    alone = post(deterministic_server, "/generate", {"text": "3+4=", "sampling_params": per_sample[2]}).json()
    assert drawn[2]["output_ids"] == alone["output_ids"]  # independent of the batch it came in
    assert len({tuple(i["output_ids"]) for i in drawn}) > 1
    ignored = post(server, "/generate", body).json()  # no flag: seeds validated, then ignored
    assert len({tuple(i["output_ids"]) for i in ignored}) > 1


# --------------------------------------------------------------------------------------------------
# HTTPEngine against the server
# --------------------------------------------------------------------------------------------------


def test_http_engine_matches_in_process_engine_and_plain_transformers(
    server: Server, deterministic_server: Server, snapshot_factory: SnapshotFactory
) -> None:
    snapshot = snapshot_factory(seed=2)
    with HTTPEngine(server.url) as remote:
        remote.load(str(snapshot), "7")
        assert remote.weight_version() == "7"
        over_http = remote.generate(PROMPTS, GREEDY)
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=8, seed=5)
    with HTTPEngine(deterministic_server.url) as remote:
        remote.load(str(snapshot), "7")
        sampled_http = remote.generate(PROMPTS[:4], sampled)
    local = HFEngine()
    local.load(str(snapshot), "7")
    assert over_http == local.generate(PROMPTS, GREEDY)  # texts, versions and token counts
    # Deterministic mode: each sample depends on its prompt and seed only, as one prompt alone does here.
    assert sampled_http == [local.generate([p], sampled)[0] for p in PROMPTS[:4]]
    assert [g.text for g in over_http] == plain_transformers_greedy(snapshot, PROMPTS, GREEDY.max_new_tokens)


def test_concurrent_requests_never_mix_versions(server: Server, snapshot_factory: SnapshotFactory) -> None:
    snapshots = {"a": snapshot_factory(seed=0), "b": snapshot_factory(seed=1)}
    local = HFEngine()
    expected = {}
    for version, snapshot in snapshots.items():
        local.load(str(snapshot), version)
        expected[version] = [g.text for g in local.generate(PROMPTS, GREEDY)]
    assert expected["a"] != expected["b"]
    seen: list[list] = []

    def client() -> None:
        with HTTPEngine(server.url) as engine:
            seen.extend(engine.generate(PROMPTS, GREEDY) for _ in range(4))

    with HTTPEngine(server.url) as loader:
        loader.load(str(snapshots["a"]), "a")
        threads = [threading.Thread(target=client) for _ in range(3)]
        for t in threads:
            t.start()
        flips = 0
        while any(t.is_alive() for t in threads) and flips < 200:
            version = "b" if flips % 2 == 0 else "a"
            loader.load(str(snapshots[version]), version)
            flips += 1
        for t in threads:
            t.join(timeout=60)
    assert len(seen) == 12
    assert {g.weight_version for gens in seen for g in gens} == {"a", "b"}  # loads did interleave
    for gens in seen:
        versions = {g.weight_version for g in gens}
        assert len(versions) == 1
        assert [g.text for g in gens] == expected[versions.pop()]


def test_http_engine_health_restart_and_failures(server: Server) -> None:
    relaunched = []
    with HTTPEngine(server.url) as engine:
        assert engine.healthy() is True
        with pytest.raises(EngineError, match="did not launch"):
            engine.restart()
        engine.load(str(server.snapshot), "0")
        with pytest.raises(EngineError, match="update_weights_from_disk"):
            engine.load("/definitely/not/here", "9")
        assert engine.model_info()["weight_version"] == "0"  # the server keeps its label ...
        assert engine.weight_version() is None  # ... but after a failed load the weights are unknown
        engine.load(str(server.snapshot), "0")
        assert engine.weight_version() == "0"
    HTTPEngine(server.url, launcher=lambda: relaunched.append(True)).restart()
    assert relaunched == [True]

    dead = HTTPEngine(f"http://127.0.0.1:{free_port()}", timeout=2, health_timeout=2)
    assert dead.healthy() is False
    with pytest.raises(EngineError):
        dead.generate(["1"], GREEDY)
    with pytest.raises(EngineError):
        dead.weight_version()
    dead.close()
    dead.close()
    assert dead.healthy() is False


def test_serve_exits_cleanly_on_sigterm(tiny_snapshot: Path, tmp_path: Path) -> None:
    server = start_server(tiny_snapshot, "1", tmp_path / "stderr.log")
    assert httpx.get(server.url + "/health").status_code == 200
    assert stop_server(server) == 0


@contextlib.contextmanager
def in_process(snapshot: Path, api_keys: tuple[str | None, str | None] = (None, None),
               **service: Any) -> Iterator[tuple[EngineService, str]]:
    """The stand-in's HTTP server in this process (what ``ckpteval serve`` runs), so a test can reach its
    engine service: hold the engine as a long batch would."""
    engine = HFEngine(max_batch_size=8)
    engine.load(str(snapshot), "0")
    server = EngineHTTPServer(("127.0.0.1", 0), EngineService(engine, str(snapshot), **service))
    server.api_keys = api_keys
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.service, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        engine.close()


@pytest.fixture
def shedding(tiny_snapshot: Path) -> Iterator[tuple[EngineService, str]]:
    """The stand-in with ``--max-queued-requests 2`` (counted in prompts, as sglang's scheduler does)."""
    with in_process(tiny_snapshot, max_queued=2) as served:
        yield served


def test_a_full_queue_is_a_503_the_client_retries_without_a_restart(shedding: tuple[EngineService, str]) -> None:
    service, url = shedding
    restarts: list[bool] = []
    impatient = HTTPEngine(url, busy_retries=0, launcher=lambda: restarts.append(True))
    reply = httpx.post(url + "/generate", json={"text": PROMPTS[:3]}, timeout=30)  # 3 prompts > 2, even idle
    assert reply.status_code == 503 and reply.json() == {
        "object": "error", "message": "The request queue is full.", "type": "503", "param": None, "code": 503}
    with service.state:
        service.waiting += 2  # another client's two prompts wait for the engine
    with pytest.raises(ServerBusy, match="The request queue is full"):
        impatient.generate(["1+1="], GREEDY)  # one prompt, the smallest chunk: still no room
    with service.state:
        service.waiting -= 2
    assert impatient.generate(["1+1="], GREEDY)[0].weight_version == "0"  # room again: served

    patient = HTTPEngine(url, busy_retries=8, busy_retry_delay=0.05, launcher=lambda: restarts.append(True))
    out: list[Any] = []
    with service.state:
        service.waiting += 2
        shed = service.shed
    worker = threading.Thread(target=lambda: out.append(patient.generate(PROMPTS[:2], GREEDY)), daemon=True)
    worker.start()
    while service.shed < shed + 2 and worker.is_alive():  # shed twice, still retrying
        time.sleep(0.01)
    with service.state:
        service.waiting -= 2
    worker.join(timeout=60)
    assert len(out) == 1 and [g.weight_version for g in out[0]] == ["0", "0"]
    assert service.shed >= shed + 2 and restarts == []


@pytest.mark.parametrize("limit", [1, 8, 100])
def test_a_batch_larger_than_the_queue_limit_passes_chunked(tiny_snapshot: Path, limit: int) -> None:
    """sglang sheds every prompt past --max-queued-requests (scheduler.py _abort_on_queued_limit) and one
    shed prompt fails the batch: the client chunks to half the limit read from /server_info."""
    n = 2 * limit + 3
    prompts = (PROMPTS * (n // len(PROMPTS) + 1))[:n]
    with in_process(tiny_snapshot, max_queued=limit) as (service, url):
        info = httpx.get(url + "/server_info").json()
        assert info["max_queued_requests"] == limit and (info["tp_size"], info["dp_size"], info["pp_size"]) == (1, 1, 1)
        assert [s["effective_max_running_requests_per_dp"] for s in info["internal_states"]] == [256]
        assert httpx.post(url + "/generate", json={"text": prompts[: limit + 1]}, timeout=60).status_code == 503
        assert httpx.post(url + "/generate", json={"text": prompts[:limit]}, timeout=60).status_code == 200
        shed = service.shed
        out = HTTPEngine(url, busy_retries=0, max_batch_size=512).generate(prompts, GREEDY)
        assert len(out) == n and all(g.weight_version == "0" for g in out) and service.shed == shed


def test_retraction_shrinks_the_batch_and_a_running_timeout_is_not_retried(
    tiny_snapshot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The two other 503s of 0.5.23: a retraction without a KV backup (schedule_batch.py retract_decode;
    a smaller batch needs less KV) and SGLANG_REQ_RUNNING_TIMEOUT (scheduler.py _poll_timeout_aborts:
    the same generation runs as long again, so no retry, no restart)."""
    from ckpteval.jobs.eval.engines.http.limits import BatchTooLarge, RunningTimedOut

    with in_process(tiny_snapshot, max_total_tokens=40) as (service, url):
        reply = httpx.post(url + "/generate", json={"text": PROMPTS[:8], "sampling_params": {"max_new_tokens": 6}})
        assert reply.status_code == 503 and "Retracted under decode memory pressure" in reply.json()["message"]
        with pytest.raises(BatchTooLarge):  # what the client shrinks on
            HTTPEngine(url, busy_retries=0, max_batch_size=512)._generate_batch(PROMPTS[:8], GREEDY, None)
        out = HTTPEngine(url, busy_retries=0, max_batch_size=512).generate(PROMPTS[:8], GREEDY)
        assert len(out) == 8
    monkeypatch.setenv("SGLANG_REQ_RUNNING_TIMEOUT", "1e-9")
    with in_process(tiny_snapshot) as (service, url):
        restarts: list[bool] = []
        engine = HTTPEngine(url, busy_retries=4, busy_retry_delay=0.05, launcher=lambda: restarts.append(True))
        calls = []
        engine._client.event_hooks["request"].append(lambda r: calls.append(r.url.path))
        with pytest.raises(RunningTimedOut, match="SGLANG_REQ_RUNNING_TIMEOUT") as caught:
            engine.generate(["1+1="], GREEDY)
        assert caught.value.reason == "generate_timeout" and not caught.value.restart_helps
        assert calls.count("/generate") == 1 and restarts == []


def test_api_keys_come_from_the_environment_and_a_missing_one_is_a_401(
    tiny_snapshot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server started with --api-key and --admin-api-key (sglang's srt/utils/auth.py rules)."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(ADMIN_API_KEY_ENV, raising=False)
    with in_process(tiny_snapshot, api_keys=("user-secret", "admin-secret")) as (_, url):
        assert httpx.get(url + "/health_generate").status_code == 200  # probes need no key
        raw = httpx.post(url + "/generate", json={"text": "1+1="})
        assert raw.status_code == 401 and raw.json() == {"error": "Unauthorized"}
        with pytest.raises(Unauthorized, match=API_KEY_ENV) as caught:
            HTTPEngine(url).generate(["1+1="], GREEDY)
        assert not caught.value.restart_helps

        monkeypatch.setenv(API_KEY_ENV, "user-secret")
        user = HTTPEngine(url)
        assert user.healthy() and user.generate(["1+1="], GREEDY)[0].weight_version == "0"
        with pytest.raises(Unauthorized, match=ADMIN_API_KEY_ENV) as caught:  # a weight load is admin
            user.load(str(tiny_snapshot), "1")
        assert "secret" not in str(caught.value)  # messages (results, logs) never carry a key

        monkeypatch.setenv(ADMIN_API_KEY_ENV, "admin-secret")
        admin = HTTPEngine(url)
        admin.load(str(tiny_snapshot), "1")
        assert admin.weight_version() == "1" and "secret" not in repr(admin._keys)


def test_the_lm_eval_path_sends_the_sglang_key_not_openais(
    tiny_snapshot: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lm-eval's local-completions sends ``Bearer $OPENAI_API_KEY`` by default: a key-protected sglang
    answers 401. The harness passes the engine's own key (CKPTEVAL_SGLANG_API_KEY)."""
    pytest.importorskip("lm_eval", reason="the harness extra (lm-eval) is not installed")
    from ckpteval.coord.entries.lm_eval import LmEvalEntry
    from ckpteval.jobs.eval.kinds.lm_eval import completions_lm

    monkeypatch.setenv(API_KEY_ENV, "user-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "an-openai-key")
    with in_process(tiny_snapshot, api_keys=("user-secret", None)) as (_, url):
        lm = completions_lm(HTTPEngine(url), str(tiny_snapshot), LmEvalEntry(name="h", tasks=("t",)))
        body = {"model": str(tiny_snapshot), "prompt": "1+1=", "max_tokens": 2, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, headers=lm.header).status_code == 200
        monkeypatch.delenv(API_KEY_ENV)
        keyless = completions_lm(HTTPEngine(url), str(tiny_snapshot), LmEvalEntry(name="h", tasks=("t",)))
        assert "an-openai-key" not in str(keyless.header)  # never another service's key
        assert httpx.post(url + "/v1/completions", json=body, headers=keyless.header).status_code == 401
