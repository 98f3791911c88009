"""Talking to a judge server: an OpenAI-compatible chat endpoint, or a reward model served by sglang or vLLM.

Owns the HTTP side of :mod:`ckpteval.jobs.eval.scorers.judge.scorer` through the ``openai`` client (timeouts,
retries) and which failures are the judge's infrastructure (a skip) rather than a
verdict. Limits: ``api_key`` comes from an environment variable named in the settings, never from run.json.
See docs/USER_GUIDE.md "Judges and reward models".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import httpx

# vLLM's 400 for sglang's /classify body names the field it lacks ('loc': 'body.input', 'msg': 'Field required')
VLLM_INPUT = "body.input"


class JudgeUnavailable(RuntimeError):
    """The judge did not answer usably after the client's retries (the message is the judge's)."""


def _import_openai() -> Any:
    try:
        import openai
    except ImportError:
        raise JudgeUnavailable("judged datasets need the openai package: pip install 'ckpteval[judge]'") from None
    return openai


def _describe(e: Exception) -> str:
    """The judge's own message: status code and body for an HTTP answer, the cause for no answer."""
    openai = _import_openai()
    if isinstance(e, openai.APIStatusError):
        return f"HTTP {e.status_code}: {e.message}"
    if isinstance(e, openai.APITimeoutError):
        return "request timed out"
    cause = e.__cause__ or e.__context__
    return f"{e}" + (f" ({type(cause).__name__}: {cause})" if cause is not None else "")


def server_root(url: str) -> str:
    """The server root of an OpenAI base URL: ``http://h:p/v1`` -> ``http://h:p`` (sglang's ``/classify``)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass(frozen=True)
class ChatReply:
    """One chat completion: the reply text (``""`` for a null content) and the ``model`` it says answered."""

    content: str
    model: str | None


def _json_of(what: str, raw: Any) -> Any:
    """The JSON body of a 200 answer; JudgeUnavailable when it is not JSON (empty, HTML, cut short)."""
    text = raw.text
    try:
        return json.loads(text)
    except ValueError:
        raise JudgeUnavailable(f"{what} answered HTTP {raw.status_code} with a body that is not JSON: "
                               f"{text[:200]!r}") from None


def _shape_error(what: str, body: Any, expected: str) -> JudgeUnavailable:
    return JudgeUnavailable(f"{what} answered {json.dumps(body, default=str)[:200]}; expected {expected}")


class JudgeEndpoint:
    """One judge server at ``base_url`` (its OpenAI base, ``http://host:port/v1``)."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float, retries: int) -> None:
        openai = _import_openai()
        self.base_url = base_url.rstrip("/")
        kwargs = {"api_key": api_key or "EMPTY", "timeout": timeout_s, "max_retries": retries}
        self.client = openai.OpenAI(base_url=self.base_url, **kwargs)
        self.root = openai.OpenAI(base_url=server_root(self.base_url), **kwargs)
        self._vllm_classify = False  # /classify answered as vLLM's (classify)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn``'s raw answer as parsed JSON; every failure (no answer, an error status, a body that is
        not JSON) is JudgeUnavailable naming the route — the caller checks the shape."""
        openai = _import_openai()
        what = f"judge at {self.base_url}: {what}"
        try:
            raw = fn(*args, **kwargs)
        except openai.OpenAIError as e:
            raise JudgeUnavailable(f"{what}: {_describe(e)}") from None
        return _json_of(what, getattr(raw, "http_response", raw))

    def model_ids(self) -> list[str]:
        """What ``GET /v1/models`` lists (the judge's identity)."""
        what = "GET /models"
        body = self._call(what, self.client.models.with_raw_response.list)
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            raise _shape_error(f"judge at {self.base_url}: {what}", body, '{"data": [{"id": ...}, ...]}')
        return [m["id"] for m in data]

    def chat(self, model: str, messages: list[dict[str, str]], sampling: dict[str, Any],
             response_format: dict[str, Any] | None = None) -> ChatReply:
        """One chat completion: ``choices[0].message.content`` (null: ``""``) and the reply's ``model``.
        ``response_format``: OpenAI's structured output (``{"type": "json_schema", ...}``)."""
        what = "POST /chat/completions"
        extra = {"response_format": response_format} if response_format is not None else {}
        body = self._call(what, self.client.chat.completions.with_raw_response.create,
                          model=model, messages=messages, **sampling, **extra)
        choices = body.get("choices") if isinstance(body, dict) else None
        first = choices[0] if isinstance(choices, list) and choices else None
        message = first.get("message") if isinstance(first, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(message, dict) or not isinstance(content, str | None):
            raise _shape_error(f"judge at {self.base_url}: {what}", body,
                               '{"choices": [{"message": {"content": "..."}}], "model": ...}')
        answered = body.get("model")
        return ChatReply(content or "", answered if isinstance(answered, str) else None)

    def classify(self, model: str, texts: list[str]) -> list[float]:
        """One reward per rendered text from ``POST /classify``: sglang's body (``{"text": [...]}`` ->
        ``[{"embedding": [reward]}]``); a server that refuses it for lacking ``input`` is vLLM's
        (``entrypoints/pooling/classify/protocol.py``, a ``--runner pooling`` server): ``{"input": [...],
        "use_activation": false}`` -> ``{"data": [{"probs": [reward]}]}``, the raw score as sglang's, then used for
        this endpoint from the start."""
        if not self._vllm_classify:
            try:
                return self._classify("text", {"text": texts}, model, len(texts))
            except JudgeUnavailable as e:
                if not (str(e).startswith(f"judge at {self.base_url}: POST /classify: HTTP 400") and VLLM_INPUT in str(e)):
                    raise
                self._vllm_classify = True
        return self._classify("input", {"input": texts, "use_activation": False}, model, len(texts))

    def _classify(self, field: str, body: dict[str, Any], model: str, n: int) -> list[float]:
        what = f"judge at {self.base_url}: POST /classify"
        answer = self._call("POST /classify", self.root.post, "/classify", cast_to=httpx.Response,
                            body={"model": model, **body})
        vllm = field == "input"
        items = (answer.get("data") if isinstance(answer, dict) else None) if vllm else answer
        items = items if isinstance(items, list) else [items]
        rewards = []
        for item in items:
            values = item.get("probs" if vllm else "embedding") if isinstance(item, dict) else None
            value = values[0] if isinstance(values, list) and values else None
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                shape = "{'data': [{'probs': [reward]}]}" if vllm else "{'embedding': [reward, ...]}"
                raise _shape_error(what, item, f"{shape} with a finite reward")
            rewards.append(float(value))
        if len(rewards) != n:
            raise JudgeUnavailable(f"{what} answered {len(rewards)} rewards for {n} texts")
        return rewards
