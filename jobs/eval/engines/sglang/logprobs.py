"""The canary over sglang's ``/generate``: teacher-forced input-token log-probs, tokenized by the server.

Owns the request (:func:`teacher_forced_request`), its split into requests that fit the server's queue, and
the reading of the replies into per-probe records. Limits: a reply that lacks or garbles a field raises
:class:`~ckpteval.jobs.eval.engines.base.EngineError`. See docs/PROTOCOL.md §4 "Canary".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from ckpteval.jobs.eval.engines.base import EngineError, RequestRejected, SamplesAborted
from ckpteval.jobs.eval.engines.http.limits import BatchTooLarge, error_message
from ckpteval.jobs.eval.proof.logprobs import probe_result

Post = Callable[[dict[str, Any]], httpx.Response]


def server_teacher_forced(post: Post, pairs: list[tuple[str, str]], chunk: int,
                          abort_retries: int = 2, abort_retry_delay: float = 1.0) -> list[dict[str, Any]]:
    """The canary's records from the server: the texts of :func:`teacher_forced_request` sent ``chunk`` at a
    time (the server's :func:`~ckpteval.jobs.eval.engines.http.limits.queue_chunk`) with ``post`` (a ``POST
    /generate`` of a JSON body, which retries busy 503s), halved when a request is still refused as too
    large (:class:`BatchTooLarge`: a full queue, a waiting timeout; finished chunks are kept), read by
    :func:`parse_teacher_forced`. Aborted items are resent (:func:`_scored_chunk`). :class:`RequestRejected`
    when the server refuses to score (a 4xx: the canary is then absent), else :class:`EngineError`."""
    texts = teacher_forced_request(pairs)["text"]
    reply: list[Any] = []
    size = max(1, chunk)
    while len(reply) < len(texts):
        part = texts[len(reply) : len(reply) + size]
        try:
            reply += _scored_chunk(post, part, abort_retries, abort_retry_delay)
        except BatchTooLarge:
            if len(part) == 1:
                raise
            size = len(part) // 2
    return parse_teacher_forced(pairs, reply)


def _scored_chunk(post: Post, texts: list[str], abort_retries: int, abort_retry_delay: float) -> list[Any]:
    """The reply items for ``texts``; a reply with an aborted item (``finish_reason.type == "abort"``:
    ``/abort_request``, a pause, a weight update) is sent again, ``abort_retries`` times, then
    :class:`SamplesAborted` (not a restart, as for a generate)."""
    body = {**teacher_forced_request([]), "text": texts}
    message = ""
    for attempt in range(abort_retries + 1):
        if attempt:
            time.sleep(abort_retry_delay * attempt)
        response = post(body)
        if response.status_code != 200:
            message = f"POST /generate (canary log-probs): {error_message(response)}"
            raise (RequestRejected if 400 <= response.status_code < 500 else EngineError)(message)
        try:
            reply = response.json()
        except ValueError as e:
            raise EngineError(f"POST /generate (canary log-probs): reply is not JSON: {response.text[:200]}") from e
        message = _abort_message(reply)
        if message is None:
            if not isinstance(reply, list) or len(reply) != len(texts):
                raise EngineError(f"/generate returned {str(reply)[:200]} for {len(texts)} canary texts")
            return reply
    raise SamplesAborted(f"the canary's /generate came back aborted {abort_retries + 1} times (last: {message!r}); "
                         "not compared")


def _abort_message(reply: Any) -> str | None:
    """The message of the first aborted item of a ``/generate`` list reply, else None."""
    for item in reply if isinstance(reply, list) else []:
        finish = item.get("meta_info", {}).get("finish_reason") if isinstance(item, dict) else None
        if isinstance(finish, dict) and finish.get("type") == "abort":
            return str(finish.get("message") or "Aborted")
    return None


def teacher_forced_request(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """The ``/generate`` body scoring every ``prompt + continuation``, then every prompt alone."""
    return {
        "text": [p + c for p, c in pairs] + [p for p, _ in pairs],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 1,
    }


def parse_teacher_forced(pairs: list[tuple[str, str]], reply: Any) -> list[dict[str, Any]]:
    """The canary's records (``ids``, ``start``, ``logprobs``, ``argmax`` per probe) from the reply to
    :func:`teacher_forced_request`; :class:`EngineError` when it is not what sglang sends."""
    if not isinstance(reply, list) or len(reply) != 2 * len(pairs):
        raise EngineError(f"/generate returned {str(reply)[:200]} for {2 * len(pairs)} canary texts")
    out = []
    for i, pair in enumerate(pairs):
        ids, logprobs, argmax = _scored(reply[i])
        prompt_ids = _scored(reply[len(pairs) + i])[0]
        out.append(probe_result(pair, ids, len(prompt_ids), logprobs, argmax))
    return out


def _scored(item: Any) -> tuple[list[int], list[float | None], list[int | None]]:
    """Token ids, log-probs and argmax per position of one scored text."""
    try:
        meta = item["meta_info"]
        tokens, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
        ids = [int(t[1]) for t in tokens]
        logprobs = [None if t[0] is None else float(t[0]) for t in tokens]
        argmax = [None if not top else int(top[0][1]) for top in tops]
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise EngineError(f"/generate: no input logprobs in {str(item)[:200]} ({type(e).__name__}: {e})") from e
    if len(argmax) != len(ids) or not ids or any(v is None for v in logprobs[1:] + argmax[1:]):
        raise EngineError(f"/generate: input logprobs of unequal or missing lengths in {str(item)[:200]}")
    return ids, logprobs, argmax
