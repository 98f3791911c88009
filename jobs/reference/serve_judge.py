"""``ckpteval serve --judge MODE``: a judge stand-in answering like an OpenAI-compatible server, for tests.

A real judge is an LLM on a GPU (sglang, vLLM, a hosted API); this answers the same routes, with a
verdict a test can compute, and fails in each way a real one does:

- ``GET /v1/models``: ``{"object": "list", "data": [{"id": NAME, "object": "model", "root": NAME,
  "owned_by": "ckpteval", ...}]}`` (``--served-model-name``, sglang's flag).
- ``POST /v1/chat/completions``: OpenAI's ``chat.completion`` object. Mode ``exact``: the last user
  message's ``<response>…</response>`` and ``<reference>…</reference>`` (the default judge template's
  tags) are compared whitespace-stripped: ``VERDICT: 1`` when equal, else ``VERDICT: 0``. Mode
  ``garbage``: a reply no verdict rule reads. Mode ``error``: 500 with an OpenAI error body. Mode
  ``slow``: ``exact``, after ``--judge-delay`` seconds (a client timeout shorter than that fails).
  A judge that refuses connections is no server at all (kill it, or use a closed port).
- ``POST /classify`` (sglang's reward-model route): ``{"text": str | list[str]}`` -> per text
  ``{"embedding": [len(text) / 1000], "meta_info": {...}}`` (a list for list input); ``error``: 500.
- ``GET /judge_stats`` (stand-in only): ``{"chat_completions": n, "classify": m}`` answered so far
  (texts, not requests, for ``/classify``), so tests can count what the judge was paid.

Limits: one model; no streaming, tools, logprobs or ``n`` > 1 (ignored); sampling settings are
accepted and ignored (the verdict is deterministic).
"""

from __future__ import annotations

import re
import socket
import threading
import time
from http import HTTPStatus
from http.server import ThreadingHTTPServer

from ckpteval.jobs.reference.serve import Handler
from ckpteval.jobs.reference.serve_requests import BadRequest

JUDGE_MODES = ("exact", "garbage", "error", "slow")
_TAG = {name: re.compile(rf"<{name}>(.*?)</{name}>", re.S) for name in ("response", "reference")}


def exact_verdict(prompt: str) -> str:
    """``VERDICT: 1`` when the prompt's <response> equals its <reference> (stripped), else ``VERDICT: 0``."""
    found = {name: rx.findall(prompt) for name, rx in _TAG.items()}
    same = all(found.values()) and found["response"][-1].strip() == found["reference"][-1].strip()
    return f"VERDICT: {int(same)}"


class JudgeHTTPServer(ThreadingHTTPServer):
    """The stand-in's state: mode, delay, served name, and what it has answered."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], mode: str, name: str, delay_s: float, verbose: bool) -> None:
        if mode not in JUDGE_MODES:
            raise ValueError(f"--judge {mode!r} must be one of {', '.join(JUDGE_MODES)}")
        self.mode, self.name, self.delay_s, self.verbose = mode, name, delay_s, verbose
        self.lock = threading.Lock()
        self.stats = {"chat_completions": 0, "classify": 0}
        super().__init__(address, JudgeHandler)

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.stats[what] += n


class JudgeHandler(Handler):
    server: JudgeHTTPServer  # type: ignore[assignment]

    def setup(self) -> None:
        super().setup()
        # headers and body go out as two writes: without NODELAY a keep-alive client (the openai client)
        # waits out the peer's delayed ACK (~40 ms) on every request
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self) -> None:
        self._route({"/v1/models": self._models, "/judge_stats": self._stats})

    def do_POST(self) -> None:
        self._route({"/v1/chat/completions": self._chat, "/classify": self._classify})

    def _fail_if_error_mode(self) -> bool:
        if self.server.mode != "error":
            return False
        self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"object": "error", "message": "stand-in judge: mode error",
                                                      "type": "InternalServerError", "param": None, "code": 500})
        return True

    def _models(self) -> None:
        card = {"id": self.server.name, "object": "model", "created": int(time.time()), "owned_by": "ckpteval",
                "root": self.server.name, "parent": None, "max_model_len": None}
        self._json(HTTPStatus.OK, {"object": "list", "data": [card]})

    def _stats(self) -> None:
        with self.server.lock:
            self._json(HTTPStatus.OK, dict(self.server.stats))

    def _chat(self) -> None:
        body = self._body()
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("'messages' must be a list of {'role', 'content'} objects")
        if self._fail_if_error_mode():
            return
        if self.server.mode == "slow":
            time.sleep(self.server.delay_s)
        users = [str(m.get("content", "")) for m in messages if m.get("role") == "user"]
        text = "I cannot decide." if self.server.mode == "garbage" else exact_verdict(users[-1] if users else "")
        self.server.count("chat_completions")
        self._json(HTTPStatus.OK, {
            "id": f"chatcmpl-{time.monotonic_ns()}", "object": "chat.completion", "created": int(time.time()),
            "model": self.server.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
                         "logprobs": None}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        })

    def _classify(self) -> None:
        body = self._body()
        text = body.get("text") if isinstance(body, dict) else None
        texts = [text] if isinstance(text, str) else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("'text' must be a string or a non-empty list of strings")
        if self._fail_if_error_mode():
            return
        self.server.count("classify", len(texts))
        items = [{"embedding": [len(t) / 1000], "meta_info": {"id": str(i), "prompt_tokens": len(t)}}
                 for i, t in enumerate(texts)]
        self._json(HTTPStatus.OK, items if isinstance(text, list) else items[0])
