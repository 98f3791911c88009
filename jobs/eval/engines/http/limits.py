"""How long one ``/generate`` may take, and when a busy sglang server is retried instead of restarted.

Owns, as sglang 0.5.23 answers: a 503 with a message is busy, retried with backoff, then :class:`ServerBusy`
(skip ``overloaded``); the derived timeout per wave of new tokens (:func:`generate_timeout`), or a dataset's
``generate_timeout_s`` (:class:`GenerateTimedOut`); a batch sized to the server's queue and halved on a
persistent queue-full or waiting timeout (:func:`queue_chunk`, :class:`BatchTooLarge`); a running timeout is not retried
(:class:`RunningTimedOut`). Limits: backoff sleeps in the calling thread. See docs/USER_GUIDE.md "sglang: what the
worker relies on" and "Skip reasons and what to do".
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from ckpteval.jobs.eval.engines.base import EngineError, MissingRoute

BUSY_STATUS = 503
BUSY_MESSAGES = (
    "The request queue is full.",  # scheduler.py _abort_on_queued_limit
    "Request waiting timeout reached.",  # scheduler.py _poll_timeout_aborts
    "Request running timeout reached.",  # scheduler.py _poll_timeout_aborts
    "Retracted under decode memory pressure without a KV backup. Retry later.",  # schedule_batch.py
)
QUEUE_FULL = BUSY_MESSAGES[0]
WAITING_TIMEOUT = BUSY_MESSAGES[1]
RUNNING_TIMEOUT = BUSY_MESSAGES[2]
RETRACTED = BUSY_MESSAGES[3]
QUEUE_MARGIN = 0.5  # of --max-queued-requests a client fills with one /generate (others share the queue)
DEFAULT_TOKEN_TIMEOUT_S = 0.1  # per new token per wave: 10 tokens/s, slower than any healthy decode


class ServerBusy(EngineError):
    """sglang kept answering 503 with a message (it shed the request) after the bounded retries: the
    server is overloaded, not dead. No restart; the unit is skipped ``overloaded``."""

    reason = "overloaded"
    restart_helps = False


class BatchTooLarge(ServerBusy):
    """The busy answer was sglang's full waiting queue, its waiting timeout (``SGLANG_REQ_WAITING_TIMEOUT``:
    the batch's last prompts waited behind its first) or a retraction under KV pressure: a smaller batch
    may pass (the caller halves it)."""


class GenerateTimedOut(EngineError):
    """A ``/generate`` outlived its dataset's ``generate_timeout_s``: the dataset's bound, not a dead server.
    No restart; the unit is skipped ``generate_timeout``."""

    reason = "generate_timeout"
    restart_helps = False


class RunningTimedOut(GenerateTimedOut):
    """sglang aborted a running generation at ``SGLANG_REQ_RUNNING_TIMEOUT`` (503): the same generation
    runs as long again, so it is neither retried nor restarted; the unit is skipped ``generate_timeout``."""


@contextlib.contextmanager
def dataset_timeout(timeout_s: float | None, prompts: int) -> Iterator[None]:
    """Within it, a request timing out under a dataset's own ``timeout_s`` raises :class:`GenerateTimedOut`
    (None: the derived timeout, whose expiry stays a plain EngineError)."""
    try:
        yield
    except EngineError as e:
        if timeout_s is None or not isinstance(e.__cause__, httpx.TimeoutException):
            raise
        raise GenerateTimedOut(f"POST /generate of {prompts} prompts took longer than the dataset's "
                               f"generate_timeout_s ({timeout_s:g} s); sglang aborts a request whose client "
                               "left (not restarted)") from e


def error_message(response: httpx.Response) -> str:
    """The server's explanation of a failed request, in the three shapes sglang uses: ``{"error": "<str>"}`` (the
    0.5.22+ schema gate), ``{"error": {"message"}}`` (``_create_error_response``) and ``{"object": "error",
    "message"}`` (``ErrorResponse``); any other body as it is."""
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:500]}"
    if isinstance(body, dict):
        nested = body.get("error")
        if isinstance(nested, str):
            return f"HTTP {response.status_code}: {nested}"
        if isinstance(nested, dict) and "message" in nested:
            return f"HTTP {response.status_code}: {nested['message']}"
        if "message" in body:
            return f"HTTP {response.status_code}: {body['message']}"
    return f"HTTP {response.status_code}: {body!r}"[:600]


def check_route(method: str, path: str, response: httpx.Response, base_url: str, lacks: str) -> None:
    """:class:`MissingRoute` when ``response`` is a 404 for the route itself: the server at ``base_url`` lacks
    ``lacks`` (what the engine needs the route for, and where to get it)."""
    if response.status_code == 404:
        raise MissingRoute(f"{method} {path}: {error_message(response)}: the server at {base_url} has no such "
                           f"route, so {lacks}")


def reply_object(response: httpx.Response) -> dict[str, Any] | None:
    """A reply's JSON object; None when its body is not JSON or not an object."""
    try:
        body = response.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def busy_message(response: httpx.Response) -> str | None:
    """The message of a 503 that says why (sglang's ``ErrorResponse`` ``message``, or ``detail``), else None."""
    body = reply_object(response) if response.status_code == BUSY_STATUS else None
    if body is None:
        return None
    message = body.get("message", body.get("detail"))
    if isinstance(body.get("error"), dict):
        message = body["error"].get("message", message)
    return message if isinstance(message, str) and message.strip() else None


def send_retrying_busy(
    send: Callable[[], httpx.Response], retries: int, delay: float, what: str
) -> httpx.Response:
    """``send()`` until it is not a 503 with a message, at most ``retries`` more times with exponential
    backoff from ``delay`` seconds; :class:`BatchTooLarge` (a full queue) or :class:`ServerBusy` if the last
    answer is still one; :class:`RunningTimedOut` at once for sglang's running timeout (it recurs)."""
    for attempt in range(retries + 1):
        response = send()
        message = busy_message(response)
        if message is None:
            return response
        if message == RUNNING_TIMEOUT:
            raise RunningTimedOut(f"{what}: HTTP 503 {message!r}: a generation ran past the server's "
                                  "SGLANG_REQ_RUNNING_TIMEOUT; it would again (not retried, not restarted)")
        if attempt < retries:
            time.sleep(delay * 2**attempt)
    error = BatchTooLarge if message in (QUEUE_FULL, WAITING_TIMEOUT, RETRACTED) else ServerBusy
    raise error(f"{what}: HTTP 503 {message!r} on {retries + 1} tries: the server is overloaded (not restarted)")


def queue_chunk(max_batch_size: int, server_info: dict[str, Any]) -> int:
    """Prompts per ``/generate``: ``max_batch_size``, capped at :data:`QUEUE_MARGIN` of the server's
    ``max_queued_requests`` (at least one prompt) when it has one (module doc)."""
    limit = server_info.get("max_queued_requests")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        return max(1, min(max_batch_size, math.floor(limit * QUEUE_MARGIN)))
    return max_batch_size


def generate_timeout(
    base_s: float, token_timeout_s: float, max_new_tokens: int, prompts: int, server_info: dict[str, Any]
) -> float:
    """Seconds one ``/generate`` of ``prompts`` prompts of up to ``max_new_tokens`` may take (module doc)."""
    running = running_at_once(server_info)
    waves = math.ceil(prompts / running) if running else 1
    return base_s + token_timeout_s * max(0, max_new_tokens) * waves


def running_at_once(server_info: dict[str, Any]) -> int | None:
    """How many requests the server decodes at once (module doc), or None when it does not say."""
    states = server_info.get("internal_states")
    per_dp = [s.get("effective_max_running_requests_per_dp") for s in states if isinstance(s, dict)] \
        if isinstance(states, list) else []
    if per_dp and all(isinstance(n, int) and n > 0 for n in per_dp):
        return sum(per_dp)
    arg = server_info.get("max_running_requests")
    return arg if isinstance(arg, int) and arg > 0 else None
