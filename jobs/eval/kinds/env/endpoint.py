"""The pinned engine's OpenAI-compatible endpoint: ``POST /v1/chat/completions`` on loopback, stamped and checked
turn by turn, for environments that drive the model themselves (``verifiers``).

Limits: non-streaming, one choice; one ``generate`` at a time; no ``logprobs``. See docs/USER_GUIDE.md
"The pinned engine's OpenAI endpoint, and ``verifiers`` environments".
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ckpteval.coord.entries.env import EnvEntry
from ckpteval.jobs.eval.engines.base import Engine, EngineError
from ckpteval.jobs.eval.engines.http.generate import sample_version
from ckpteval.jobs.eval.kinds.env import Tool
from ckpteval.jobs.eval.kinds.env.tools import MalformedCall
from ckpteval.jobs.eval.kinds.env.turns import Turns
from ckpteval.jobs.eval.kinds.generate.scoring import sample_seed, sampling_params
from ckpteval.jobs.eval.proof.pinning import check_pinned

PATH_RE = re.compile(r"^/e/(\d+)/(\d+)/v1/chat/completions$")


class Refused(ValueError):
    """A request this endpoint does not serve (HTTP 400 with the message)."""


def reply_version(body: dict[str, Any]) -> str | None:
    """The version that produced a chat/completions reply: its ``metadata`` as sglang stamps it (spans
    when present, see the module docstring); None when the reply carries none."""
    meta = body.get("metadata")
    return sample_version(meta) if isinstance(meta, dict) else None


def _text(content: Any) -> str:
    """A message's content as text (OpenAI's list-of-parts form joined; None is empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return "".join(str(p.get("text", "")) for p in content if p.get("type", "text") == "text")
    raise Refused(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def _call_text(call: dict[str, Any]) -> str:
    """An assistant's OpenAI tool call in the default format (how the model wrote it)."""
    fn = call.get("function") or {}
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return "<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": arguments}) + "</tool_call>"


def conversation(body: dict[str, Any]) -> tuple[list[dict[str, str]], list[Tool]]:
    """The request's messages in the runner's form (tool calls folded into the assistant's text, as the
    model wrote them) and its tools (schemas only: the environment runs them, not this endpoint)."""
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
        raise Refused("'messages' must be a non-empty list of message objects")
    out = []
    for m in messages:
        role = m.get("role")
        if not isinstance(role, str):
            raise Refused(f"a message without a string 'role': {str(m)[:200]}")
        content = _text(m.get("content")) + "".join(_call_text(c) for c in m.get("tool_calls") or [])
        kept = {k: m[k] for k in ("name", "reasoning_content") if isinstance(m.get(k), str)}
        out.append({"role": role, "content": content, **kept})
    tools = []
    for t in body.get("tools") or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise Refused(f"a tool must be {{'type': 'function', 'function': {{'name': ...}}}}, got {str(t)[:200]}")
        tools.append(Tool(fn["name"], str(fn.get("description", "")), dict(fn.get("parameters") or {}), source=""))
    if body.get("stream") or body.get("n", 1) != 1:
        raise Refused("this endpoint answers non-streaming requests with one choice (no stream, n 1)")
    return out, tools


class Endpoint:
    """The loopback ``/v1/chat/completions`` of ``engine`` pinned at ``want``, for entry ``spec``'s episodes
    (``render``: the entry's :class:`~ckpteval.jobs.eval.kinds.env.runner.Renderer`). A context manager: the server
    runs from ``__enter__`` to ``__exit__``."""

    def __init__(self, engine: Engine, want: str, spec: EnvEntry, render: Any) -> None:
        self.engine, self.want, self.spec, self.render = engine, want, spec, render
        self.params = sampling_params(spec)
        self.episodes: dict[tuple[int, int], Turns] = {}
        self.engine_error: EngineError | None = None  # the first: the unit's engine failure, not the episode's
        self.lock = threading.Lock()  # one generate at a time; the episodes' records
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="ckpteval-openai", daemon=True)

    def __enter__(self) -> Endpoint:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def base_url(self, row: int, sample: int) -> str:
        """The OpenAI ``base_url`` of episode ``sample`` of row ``row``."""
        return f"http://127.0.0.1:{self.server.server_address[1]}/e/{row}/{sample}/v1"

    def turns(self, row: int, sample: int) -> Turns:
        with self.lock:
            return self.episodes.setdefault((row, sample), Turns())

    def raise_engine_error(self) -> None:
        """Re-raise the engine's own failure during a turn: the unit's (unhealthy), never an episode's."""
        if self.engine_error is not None:
            raise self.engine_error

    def check(self) -> None:
        """After the episodes: :meth:`raise_engine_error`, then the pin check over every turn served
        (:func:`ckpteval.jobs.eval.proof.pinning.check_pinned`)."""
        self.raise_engine_error()
        check_pinned(self.engine, self.want, [v for t in self.episodes.values() for v in t.versions])

    def complete(self, row: int, sample: int, body: Any) -> tuple[HTTPStatus, dict[str, Any]]:
        """One turn of episode (``row``, ``sample``): the reply, or an error status and body."""
        if not isinstance(body, dict):
            raise Refused("request body must be a JSON object")
        messages, tools = conversation(body)
        prompt = self.render.render(messages, tools)
        with self.lock:
            turns = self.episodes.setdefault((row, sample), Turns())
            seeds = None if self.spec.temperature == 0 else [sample_seed(self.spec.seed, row, sample, len(turns.versions))]
            (g,) = self.engine.generate([prompt], self.params, seeds=seeds)
            split = self.render.reply(g.text, prompt)
            turns.add(g, split, self.render.reasoning)
        if g.weight_version != self.want:
            return HTTPStatus.CONFLICT, {"error": {"message": f"weight version changed mid-episode: pinned {self.want}, "
                                                              f"this turn was produced by {g.weight_version!r}",
                                                   "type": "pin_violation"}}
        message: dict[str, Any] = {"role": "assistant", "content": split.answer or ""}
        if self.render.reasoning.setting is not None:
            message["reasoning_content"] = split.reasoning or None
        try:
            calls = self.render.calls(split.answer, prompt, tools) if split.answer else []
        except MalformedCall:
            calls = []  # the text goes back as it is: the environment judges the model's malformed call
        if calls:  # the markup leaves content: else every later prompt would show each call twice
            message["content"] = self.render.text_beside_calls(split.answer or "", prompt)
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                                      "function": {"name": c.tool.name, "arguments": json.dumps(c.arguments)}}
                                     for c in calls]
        cut = g.finish_reason == "length" if g.finish_reason is not None else g.n_tokens >= self.params.max_new_tokens
        finish = "tool_calls" if calls else "length" if cut else "stop"  # the engine's word, where it says
        used = (g.prompt_tokens or 0, g.n_tokens)
        return HTTPStatus.OK, {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": str(body.get("model", "")),
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": used[0], "completion_tokens": used[1], "total_tokens": sum(used)},
            "metadata": {"weight_version": g.weight_version},
        }


def _handler(endpoint: Endpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            if self.path.rstrip("/").endswith("/v1/models"):
                self._json(HTTPStatus.OK, {"object": "list", "data": [{"id": endpoint.want, "object": "model"}]})
            else:
                self._json(HTTPStatus.NOT_FOUND, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            m = PATH_RE.match(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if m is None:
                self._json(HTTPStatus.NOT_FOUND, {"error": {"message": f"no route {self.path} (want /e/<row>/<sample>/v1/chat/completions)"}})
                return
            try:
                status, payload = endpoint.complete(int(m.group(1)), int(m.group(2)), json.loads(raw or b"null"))
            except (Refused, json.JSONDecodeError) as e:
                status, payload = HTTPStatus.BAD_REQUEST, {"error": {"message": str(e), "type": "invalid_request_error"}}
            except EngineError as e:
                endpoint.engine_error = endpoint.engine_error or e
                status, payload = HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": str(e), "type": "engine_error"}}
            self._json(status, payload)

        def _json(self, status: HTTPStatus, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler
