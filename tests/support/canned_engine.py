"""A stand-in sglang server that replays canned completions: a real HTTP server (stdlib http.server) on a
free loopback port, speaking the subset of sglang 0.5.23's native API that ``HTTPEngine`` uses.

Tests whose expected scores must be known (code programs right, wrong and hostile) drive a real worker
with ``--engine http:URL`` against it: the worker's whole path (claim, load + pin, generate, score,
result) runs for real; only the text is canned instead of sampled. The replies have the shapes
``ckpteval serve`` (and sglang) send: ``/server_info`` with the version, ``/model_info`` with the label,
``/update_weights_from_disk`` (any path; the label becomes the requested version), ``/generate`` (a list
of texts in, one item per text with ``meta_info.finish_reason`` ``stop`` and the label as the sample's
version) and ``/health_generate``.

Completions: ``{prompt: [completion, ...]}``; the i-th request for a prompt gets the i-th completion
(cycling), so ``n_samples`` samples of one prompt can differ. A prompt not in the map gets ``""``. A
completion is a text (it stopped: ``finish_reason`` ``stop``) or a ``(text, "length")`` pair: cut at the
length limit, sglang's ``{"type": "length", "length": n}`` (``srt/managers/schedule_batch.py`` ``FINISH_LENGTH``).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class CannedEngine:
    """The server: ``with CannedEngine(completions) as url:`` serves at ``url`` until the block ends."""

    def __init__(self, completions: dict[str, list[str | tuple[str, str]]]) -> None:
        self.completions = completions
        self.label = "default"
        self.seen: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> str:
        self.thread.start()
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def generate(self, texts: list[str]) -> list[dict[str, Any]]:
        out = []
        with self.lock:
            for text in texts:
                options = self.completions.get(text) or [""]
                completion = options[self.seen[text] % len(options)]
                self.seen[text] += 1
                out.append(_item(completion, text, self.label, sum(self.seen.values())))
        return out


def _handler(engine: CannedEngine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 — http.server's naming
            if self.path in ("/server_info", "/get_server_info"):
                self._json({"version": "0.5.23", "weight_version": "default", "enable_deterministic_inference": True,
                            "model_path": "canned"})
            elif self.path in ("/model_info", "/get_model_info"):
                self._json({"model_path": "canned", "weight_version": engine.label, "is_generation": True})
            elif self.path in ("/health", "/health_generate"):
                self._json(None)
            else:
                self._json({"detail": "Not Found"}, HTTPStatus.NOT_FOUND)

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"null")
            if self.path == "/update_weights_from_disk":
                engine.label = str(body.get("weight_version", engine.label))
                self._json({"success": True, "message": "Succeeded to update model weights.",
                            "num_paused_requests": 0})
            elif self.path == "/generate":
                texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
                self._json(engine.generate(texts))
            else:
                self._json({"detail": "Not Found"}, HTTPStatus.NOT_FOUND)

        def _json(self, payload: Any, status: HTTPStatus = HTTPStatus.OK) -> None:
            data = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    return Handler


class ScriptedEngine(CannedEngine):
    """The same server, replying by a scripted policy: ``policy(prompt_text, engine) -> reply`` for every
    text of every ``/generate`` (multi-turn episodes: the policy reads the transcript it is sent). The
    policy may change ``engine.label`` (a reload between two turns) or block (a worker killed mid-episode);
    a reply is a text or, as a canned completion, a ``(text, "length")`` pair (cut at the length limit).
    ``texts`` records every text received, in order."""

    def __init__(self, policy: Callable[[str, ScriptedEngine], str | tuple[str, str]]) -> None:
        super().__init__({})
        self.policy = policy
        self.texts: list[str] = []

    def generate(self, texts: list[str]) -> list[dict[str, Any]]:
        replies = []
        for text in texts:
            with self.lock:
                self.texts.append(text)
            replies.append(self.policy(text, self))
        with self.lock:
            return [_item(reply, text, self.label, len(self.texts)) for reply, text in zip(replies, texts, strict=True)]


def _item(completion: str | tuple[str, str], text: str, label: str, serial: int) -> dict[str, Any]:
    completion, finish = completion if isinstance(completion, tuple) else (completion, "stop")
    n = max(1, len(completion.split()))
    reason = {"type": "stop", "matched": 0} if finish == "stop" else {"type": "length", "length": n}
    return {"text": completion, "output_ids": list(range(n)), "meta_info": {
        "id": f"canned-{serial}", "finish_reason": reason,
        "prompt_tokens": len(text.split()), "completion_tokens": n, "weight_version": label,
        "weight_versions": [{"version": label, "start": 0, "end": n}]}}
