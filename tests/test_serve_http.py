"""``ckpteval serve`` as a real subprocess, spoken to over HTTP directly and through ``HTTPEngine``."""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from jobs.eval.engines.base import EngineError, SamplingParams
from jobs.eval.engines.hf import HFEngine
from jobs.eval.engines.http import HTTPEngine, WeightVersionMismatch
from jobs.eval.engines.sglang import free_port
from jobs.reference.model import make_addition_examples

REPO = Path(__file__).resolve().parents[1]
SnapshotFactory = Callable[..., Path]
PROMPTS = [ex["prompt"] for ex in make_addition_examples(10, seed=1)] + ["5", "12+"]
GREEDY = SamplingParams(max_new_tokens=6)


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[str]
    snapshot: Path


def start_server(snapshot: Path, version: str, log: Path, timeout: float = 60.0) -> Server:
    """Launch ``python -m jobs.cli serve`` on a free port; return once it prints its URL."""
    cmd = [sys.executable, "-m", "jobs.cli", "serve", "--model", str(snapshot), "--port", "0"]
    cmd += ["--weight-version", version]
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


def post(server: Server, path: str, body: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60
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

    batch = post(server, "/generate", {"text": ["1+1=", "22+"], "sampling_params": {"temperature": 0}}).json()
    assert isinstance(batch, list) and len(batch) == 2
    by_ids = post(
        server,
        "/generate",
        {"input_ids": [1, 4, 11, 14, 7, 9, 15], "sampling_params": {"temperature": 0, "max_new_tokens": 4}},
    )
    assert by_ids.json()["output_ids"] == item["output_ids"]  # the same prompt, tokenized by hand
    per_item = [{"max_new_tokens": 1}, {"max_new_tokens": 3, "temperature": 0}]
    mixed = post(server, "/generate", {"input_ids": [[1, 5], [1, 6, 7]], "sampling_params": per_item}).json()
    assert len(mixed[0]["output_ids"]) == 1 and 1 <= len(mixed[1]["output_ids"]) <= 3


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
    assert httpx.get(server.url + "/weight_version").json() == {"weight_version": "11"}
    gen = post(server, "/generate", {"text": "1", "sampling_params": {"max_new_tokens": 1}}).json()
    assert gen["meta_info"]["weight_version"] == "11"

    failed = load(server, other / "missing", "12")
    assert failed.status_code == 400 and failed.json()["success"] is False and failed.json()["message"]
    assert httpx.get(server.url + "/model_info").json()["weight_version"] == "11"

    # Without a weight_version the version is left as it was (sglang's behaviour).
    assert load(server, server.snapshot, None).status_code == 200
    info = httpx.get(server.url + "/model_info").json()
    assert info["weight_version"] == "11" and info["model_path"] == str(server.snapshot)


def test_health_endpoints_answer_200_with_empty_bodies(server: Server) -> None:
    for path in ("/health", "/health_generate"):
        reply = httpx.get(server.url + path, timeout=30)
        assert reply.status_code == 200 and reply.content == b""


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", b"{not json"),
        ("/generate", {}),
        ("/generate", {"text": "1", "input_ids": [1]}),
        ("/generate", {"text": []}),
        ("/generate", {"input_ids": [[1, 999]]}),
        ("/generate", {"text": "1", "stream": True}),
        ("/generate", {"text": "1", "sampling_params": {"stop": "x"}}),
        ("/generate", {"text": "1", "sampling_params": {"max_new_tokens": "5"}}),
        ("/generate", {"text": "1", "sampling_params": {"max_new_tokens": 0}}),
        ("/generate", {"text": ["1", "2"], "sampling_params": [{}]}),
        ("/update_weights_from_disk", {}),
        ("/update_weights_from_disk", {"model_path": 5}),
        ("/update_weights_from_disk", {"model_path": "/x", "weight_version": 3}),
    ],
)
def test_bad_requests_get_400_with_a_message(server: Server, path: str, body: object) -> None:
    reply = post(server, path, body)
    assert reply.status_code == 400
    payload = reply.json()
    message = payload.get("message") or payload.get("error", {}).get("message")
    assert isinstance(message, str) and message


def test_unknown_route_is_404(server: Server) -> None:
    assert httpx.get(server.url + "/nope").status_code == 404


# --------------------------------------------------------------------------------------------------
# HTTPEngine against the server
# --------------------------------------------------------------------------------------------------


def test_http_engine_matches_in_process_engine_and_plain_transformers(
    server: Server, snapshot_factory: SnapshotFactory
) -> None:
    snapshot = snapshot_factory(seed=2)
    with HTTPEngine(server.url) as remote:
        remote.load(str(snapshot), "7")
        assert remote.weight_version() == "7"
        over_http = remote.generate(PROMPTS, GREEDY)
        sampled = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=8, seed=5)
        sampled_http = remote.generate(PROMPTS, sampled)
    local = HFEngine()
    local.load(str(snapshot), "7")
    assert over_http == local.generate(PROMPTS, GREEDY)  # texts, versions and token counts
    assert sampled_http == local.generate(PROMPTS, sampled)
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
        with pytest.raises(EngineError, match="update_weights_from_disk"):
            engine.load("/definitely/not/here", "9")
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


class _LyingServer(BaseHTTPRequestHandler):
    """Accepts every update but reports another version, and only on the older route."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(200, {"success": True, "message": "ok", "num_paused_requests": 0})

    def do_GET(self) -> None:
        if self.path == "/get_model_info":
            self._send(200, {"model_path": "/x", "weight_version": "someone-else"})
        else:
            self._send(404, {"object": "error", "message": "not found", "code": 404})

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def test_http_engine_raises_on_version_mismatch_and_falls_back_to_get_model_info() -> None:
    stub = HTTPServer(("127.0.0.1", 0), _LyingServer)
    thread = threading.Thread(target=stub.serve_forever, daemon=True)
    thread.start()
    try:
        with HTTPEngine(f"http://127.0.0.1:{stub.server_address[1]}") as engine:
            with pytest.raises(WeightVersionMismatch, match="someone-else"):
                engine.load("/snap", "3")
            assert engine.model_info()["weight_version"] == "someone-else"
    finally:
        stub.shutdown()
        stub.server_close()


def test_serve_exits_cleanly_on_sigterm(tiny_snapshot: Path, tmp_path: Path) -> None:
    server = start_server(tiny_snapshot, "1", tmp_path / "stderr.log")
    assert httpx.get(server.url + "/health").status_code == 200
    assert stop_server(server) == 0
