"""``ckpteval serve --judge MODE``: a judge stand-in answering like an OpenAI-compatible server, for tests.

Answers the routes a real judge does with a verdict a test can compute, and fails in each way a real one does
(per MODE). Limits: one model; no streaming, tools, logprobs or ``n`` > 1; sampling settings ignored. See
docs/USER_GUIDE.md "Judges and reward models".
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from typing import Any

from ckpteval.jobs.eval.scorers.judge.rule import QUOTED_RESPONSE
from ckpteval.jobs.reference.serve.http import Handler
from ckpteval.jobs.reference.serve.requests import BadRequest

JUDGE_MODES = ("exact", "garbage", "error", "slow", "quote-after", "quote-before")
FAULT_MODES = (*JUDGE_MODES, "fixed", "body")
NO_FAULT: dict[str, Any] = {"reply": "", "reward": 0.0, "body": "", "answer_model": None}
"""The fault settings ``POST /judge_fault`` may set, at their defaults (a field it leaves out is reset)."""
_TAG = {name: re.compile(rf"<{name}>(.*?)</{name}>", re.S) for name in ("response", "reference")}


def _response_of(prompt: str) -> tuple[str | None, str]:
    """The graded response in ``prompt`` (None: none found), and the prompt without it."""
    if (m := QUOTED_RESPONSE.search(prompt)) is not None:
        return m.group(2), prompt[: m.start()] + prompt[m.end():]
    found = _TAG["response"].findall(prompt)
    return (found[-1] if found else None), _TAG["response"].sub("", prompt)


def exact_verdict(prompt: str) -> int:
    """1 when the prompt's response equals its last <reference> (stripped), else 0."""
    response, rest = _response_of(prompt)
    references = _TAG["reference"].findall(rest)
    return int(response is not None and bool(references) and response.strip() == references[-1].strip())


def _schema_path(schema: Any) -> list[str]:
    """The path of required object fields a JSON schema asks for (``verdict`` when it names none)."""
    path = []
    while isinstance(schema, dict) and schema.get("type") == "object":
        required = schema.get("required") or list(schema.get("properties") or {})
        if not required:
            break
        path.append(str(required[0]))
        schema = (schema.get("properties") or {}).get(required[0])
    return path or ["verdict"]


def _nested(path: list[str], value: Any) -> Any:
    for key in reversed(path):
        value = {key: value}
    return value


def written_verdict(verdict: int, prompt: str, response_format: Any) -> tuple[str, bool]:
    """The verdict as the request asks for it, and whether a schema constrained it (nothing else fits)."""
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise BadRequest("schema_ is required for json_schema response format request.")  # sglang's words
        return json.dumps(_nested(_schema_path(schema), verdict)), True
    if '{"verdict"' in _response_of(prompt)[1]:
        return json.dumps({"verdict": verdict}), False
    return f"VERDICT: {verdict}", False


class JudgeHTTPServer(ThreadingHTTPServer):
    """The stand-in's state: mode, delay, served name, fault settings, and what it has answered."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], mode: str, name: str, delay_s: float, verbose: bool) -> None:
        if mode not in JUDGE_MODES:
            raise ValueError(f"--judge {mode!r} must be one of {', '.join(JUDGE_MODES)}")
        self.mode, self.name, self.delay_s, self.verbose = mode, name, delay_s, verbose
        self.fault: dict[str, Any] = dict(NO_FAULT)
        self.lock = threading.Lock()
        self.stats = {"chat_completions": 0, "classify": 0}
        super().__init__(address, JudgeHandler)

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.stats[what] += n

    def set_fault(self, body: Any) -> dict[str, Any]:
        """Replace the fault state from a ``POST /judge_fault`` body; BadRequest names a bad field."""
        if not isinstance(body, dict) or set(body) - {"mode", *NO_FAULT}:
            raise BadRequest(f"judge_fault takes an object with mode, {', '.join(NO_FAULT)}")
        mode = body.get("mode", self.mode)
        if mode not in FAULT_MODES:
            raise BadRequest(f"mode {mode!r} must be one of {', '.join(FAULT_MODES)}")
        checks = {"reply": str, "reward": (int, float), "body": str, "answer_model": (str, type(None))}
        for key, kind in checks.items():
            if key in body and not isinstance(body[key], kind):
                raise BadRequest(f"judge_fault: {key} must be {kind}")
        with self.lock:
            self.mode = mode
            self.fault = {**NO_FAULT, **{k: v for k, v in body.items() if k != "mode"}}
            return {"mode": self.mode, **self.fault}


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
        self._route({"/v1/chat/completions": self._chat, "/classify": self._classify, "/judge_fault": self._fault})

    def _fail_if_faulty(self) -> bool:
        """Answer the ``error`` and ``body`` modes' failures (True: answered)."""
        if self.server.mode == "body":
            self._send(HTTPStatus.OK, self.server.fault["body"].encode(), "application/json")
            return True
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

    def _fault(self) -> None:
        self._json(HTTPStatus.OK, self.server.set_fault(self._body()))

    def _reply_text(self, prompt: str, response_format: Any) -> str:
        mode = self.server.mode
        if mode == "garbage":
            return "I cannot decide."
        if mode == "fixed":
            return str(self.server.fault["reply"])
        verdict, constrained = written_verdict(exact_verdict(prompt), prompt, response_format)
        quoted = _response_of(prompt)[0] or ""
        if constrained or mode not in ("quote-after", "quote-before"):
            return verdict
        if mode == "quote-after":
            return f"{verdict}\nThe response I graded was:\n{quoted}"
        return f"The response I am grading is:\n{quoted}\nMy grade:\n{verdict}"

    def _chat(self) -> None:
        body = self._body()
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("'messages' must be a list of {'role', 'content'} objects")
        if self._fail_if_faulty():
            return
        if self.server.mode == "slow":
            time.sleep(self.server.delay_s)
        users = [str(m.get("content", "")) for m in messages if m.get("role") == "user"]
        text = self._reply_text(users[-1] if users else "", body.get("response_format"))
        self.server.count("chat_completions")
        self._json(HTTPStatus.OK, {
            "id": f"chatcmpl-{time.monotonic_ns()}", "object": "chat.completion", "created": int(time.time()),
            "model": self.server.fault["answer_model"] or str(body.get("model") or self.server.name),
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
        if self._fail_if_faulty():
            return
        self.server.count("classify", len(texts))
        fixed = self.server.mode == "fixed"
        items = [{"embedding": [self.server.fault["reward"] if fixed else len(t) / 1000],
                  "meta_info": {"id": str(i), "prompt_tokens": len(t)}} for i, t in enumerate(texts)]
        self._json(HTTPStatus.OK, items if isinstance(text, list) else items[0])
