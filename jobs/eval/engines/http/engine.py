"""``HTTPEngine``: the :class:`~ckpteval.jobs.eval.engines.base.Engine` protocol over sglang's native HTTP API.

Owns loads with read-back (a failed load leaves the version unknown, ``None``, so the next unit reloads),
generation with per-sample versions from ``weight_versions`` spans, aborted samples resent and never scored
(:class:`~ckpteval.jobs.eval.engines.base.SamplesAborted`), a 4xx as the request's fault
(:class:`~ckpteval.jobs.eval.engines.base.RequestRejected`), the canary's teacher forcing, and the sglang
version floor (:class:`UnsupportedServer`). Busy servers and timeouts: :mod:`~ckpteval.jobs.eval.engines.http.limits`.
Limits: an attached server is restarted only through a ``launcher``; another client reloading it is detected,
not prevented. See docs/USER_GUIDE.md "sglang: what the worker relies on".
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from ckpteval.coord.results.engine_identity import EngineIdentity
from ckpteval.jobs.eval.engines.base import (
    EngineChecksum,
    EngineError,
    Generation,
    RequestRejected,
    SamplesAborted,
    SamplingParams,
    WeightVersionMismatch,
)
from ckpteval.jobs.eval.engines.http.auth import auth_headers, keys_from_env, unauthorized
from ckpteval.jobs.eval.engines.http.generate import Sample, check_seeds, parse_generation, request_sampling
from ckpteval.jobs.eval.engines.http.limits import (
    DEFAULT_TOKEN_TIMEOUT_S,
    BatchTooLarge,
    check_route,
    dataset_timeout,
    error_message,
    generate_timeout,
    queue_chunk,
    reply_object,
    send_retrying_busy,
)
from ckpteval.jobs.eval.engines.http.server_info import checksum_layout, server_gpus, server_identity
from ckpteval.jobs.eval.engines.sglang.logprobs import server_teacher_forced
from ckpteval.jobs.eval.engines.sglang.version import check_sglang_version

# sglang's health_generate gives up after HEALTH_CHECK_TIMEOUT = 20 s (SGLANG_HEALTH_CHECK_TIMEOUT),
# polling once a second (srt/entrypoints/http_server.py): wait past that before calling it dead.
HEALTH_TIMEOUT_S = 30.0
TRANSIENT_4XX = (408, 429)  # timeouts and rate limits: the server's state, not the request's fault


class HTTPEngine:
    """An engine behind a URL; see the module docstring."""

    canary_kind = "sglang"  # the canary's bound table (ckpteval.jobs.eval.proof.canary.measured_bounds): unmeasured

    def __init__(
        self,
        base_url: str,
        timeout: float = 300.0,
        *,
        load_timeout: float = 600.0,
        health_timeout: float = HEALTH_TIMEOUT_S,
        max_batch_size: int = 512,
        abort_retries: int = 2,
        abort_retry_delay: float = 1.0,
        launcher: Callable[[], None] | None = None,
        token_timeout_s: float = DEFAULT_TOKEN_TIMEOUT_S,
        busy_retries: int = 4,
        busy_retry_delay: float = 2.0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if abort_retries < 0:
            raise ValueError(f"abort_retries must be >= 0, got {abort_retries}")
        self._base_url = base_url.rstrip("/")
        self._load_timeout = load_timeout
        self._health_timeout = health_timeout
        self._max_batch_size = max_batch_size
        self._abort_retries, self._abort_retry_delay = abort_retries, abort_retry_delay
        self._launcher = launcher
        self._timeout, self._token_timeout_s = timeout, token_timeout_s  # /generate: http_limits.generate_timeout
        self._busy_retries, self._busy_retry_delay = busy_retries, busy_retry_delay
        self._client = httpx.Client(base_url=self._base_url, timeout=timeout)
        self._keys = keys_from_env()  # --api-key servers: the environment's keys (http_auth)
        self._model_info_path = "/model_info"
        self._server_info: dict[str, Any] | None = None  # read once, by the version check
        self._weights_unknown = False  # a load failed: weights may be partly replaced
        self._warned_nondeterministic = False
        self._closed = False

    @property
    def base_url(self) -> str:
        return self._base_url

    # ------------------------------------------------------------------ requests
    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        if self._closed:
            raise EngineError(f"engine for {self._base_url} is closed")
        try:
            response = self._client.request(method, path, headers=auth_headers(path, self._keys), **kwargs)
        except httpx.TransportError as e:
            raise EngineError(f"{method} {self._base_url}{path} failed: {type(e).__name__}: {e}") from e
        if response.status_code == 401:
            raise unauthorized(method, f"{self._base_url}{path}", self._keys)
        return response

    def _get_json(self, paths: tuple[str, ...], lacks: str | None = None) -> tuple[str, dict[str, Any]]:
        """GET the first of ``paths`` the server does not 404 (newer route first); its JSON object. ``lacks``:
        a 404 on every path is :class:`MissingRoute` saying so (a route the engine needs), else EngineError."""
        for path in paths:
            response = self._request("GET", path)
            if response.status_code == 404 and path != paths[-1]:
                continue
            if lacks is not None:
                check_route("GET", path, response, self._base_url, lacks)
            if response.status_code != 200:
                raise EngineError(f"GET {path}: {error_message(response)}")
            body = reply_object(response)
            if body is None:
                raise EngineError(f"GET {path}: reply is not a JSON object: {response.text[:200]}")
            return path, body
        raise EngineError(f"none of {paths} answered")  # unreachable: the last path returns or raises

    def server_info(self) -> dict[str, Any]:
        """``/server_info`` (``/get_server_info`` on servers that 404 it), checked against the version
        floor once (:class:`UnsupportedServer`)."""
        if self._server_info is None:
            _, info = self._get_json(("/server_info", "/get_server_info"))
            check_sglang_version(info.get("version"), f"the server at {self._base_url}")
            self._server_info = info
        return self._server_info

    # ------------------------------------------------------------------ Engine protocol
    def load(self, snapshot_dir: str, weight_version: str) -> None:
        self.server_info()
        body = {"model_path": str(snapshot_dir), "weight_version": weight_version, "abort_all_requests": False}
        self._weights_unknown = True  # until the server confirms the load
        response = self._request("POST", "/update_weights_from_disk", json=body, timeout=self._load_timeout)
        check_route("POST", "/update_weights_from_disk", response, self._base_url,
                    "it cannot load snapshots: attach an sglang server or ckpteval serve")
        reply = reply_object(response)
        if response.status_code != 200 or reply is None or reply.get("success") is not True:
            raise EngineError(f"update_weights_from_disk({snapshot_dir}) failed: {error_message(response)}; the "
                              "server's weights are now unknown (a failed sglang load can leave them partly replaced)")
        self._weights_unknown = False
        reported = self.weight_version()
        if reported != weight_version:
            raise WeightVersionMismatch(f"loaded {snapshot_dir} as version {weight_version!r} but the server "
                                        f"reports {reported!r}")

    def model_info(self) -> dict[str, Any]:
        """The server's model info (``/model_info``, or ``/get_model_info`` on older servers)."""
        self.server_info()
        paths = ("/model_info", "/get_model_info") if self._model_info_path == "/model_info" else ("/get_model_info",)
        self._model_info_path, info = self._get_json(paths)
        return info

    @property
    def gpus(self) -> int:
        """GPUs behind the server (:func:`server_gpus` of ``/server_info``); 0 when it does not say (the
        CPU stand-in)."""
        try:
            return server_gpus(self.server_info())
        except (EngineError, ValueError):
            return 0

    def engine_identity(self) -> EngineIdentity:
        """:func:`server_identity` of a fresh ``/server_info`` (a server relaunched by someone else with
        other flags is another identity)."""
        self.server_info()  # the version floor
        _, info = self._get_json(("/server_info", "/get_server_info"))
        return server_identity(info, self._max_batch_size)

    def weights_checksum(self) -> EngineChecksum:
        """sglang's ``POST /weights_checker {"action": "checksum"}`` (0.5.23:
        ``srt/entrypoints/http_server.py`` ``check_weights``, ``srt/utils/weight_checker.py``): the
        ``per_engine_checksum``, its checksum layout (:func:`checksum_layout`, with ``/server_info`` read
        afresh) and the instance (``startup_time`` of ``/server_info``, in 0.5.19 and 0.5.23). :class:`EngineError` when the
        server cannot answer (an older sglang 404s the route; ``success: false``)."""
        response = self._request("POST", "/weights_checker", json={"action": "checksum"}, timeout=self._load_timeout)
        body = reply_object(response)
        if response.status_code != 200 or body is None or body.get("success") is not True:
            raise EngineError(f"POST /weights_checker: {error_message(response)}")
        ranks, checksum = body.get("ranks"), body.get("per_engine_checksum")
        if not isinstance(ranks, list) or not ranks or not isinstance(checksum, str):
            raise EngineError(f"POST /weights_checker: no ranks or per_engine_checksum in {str(body)[:200]}")
        _, info = self._get_json(("/server_info", "/get_server_info"))  # read afresh: a relaunch is another instance
        tensors = sum(len(r.get("checksums") or {}) for r in ranks if isinstance(r, dict))
        instance = f"{self._base_url}@{info.get('startup_time', '?')}"
        return EngineChecksum(checksum, checksum_layout(ranks, info), tensors, instance)

    def weight_version(self) -> str | None:
        """The server's label; ``None`` after a failed load (weights unknown until the next good load)."""
        if self._weights_unknown:
            return None
        version = self.model_info().get("weight_version")
        return None if version is None else str(version)

    def generate(
        self, prompts: list[str], params: SamplingParams, seeds: list[int] | None = None
    ) -> list[Generation]:
        check_seeds(seeds, len(prompts))
        self._warn_if_seeds_ignored(params, seeds)
        out: list[Generation | None] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        last_abort = ""
        for attempt in range(self._abort_retries + 1):
            if attempt:
                time.sleep(self._abort_retry_delay * attempt)
            aborted = []
            for i, sample in self._generate_chunked(pending, prompts, params, seeds):
                if sample.abort_message is None:
                    out[i] = sample.generation
                else:
                    aborted.append(i)
                    last_abort = sample.abort_message
            if not aborted:
                return [g for g in out if g is not None]
            pending = aborted
        raise SamplesAborted(
            f"{len(pending)} of {len(prompts)} samples came back aborted from {self._base_url} "
            f"{self._abort_retries + 1} times (last: {last_abort!r}); aborted samples are never scored"
        )

    def _generate_chunked(
        self, pending: list[int], prompts: list[str], params: SamplingParams, seeds: list[int] | None
    ) -> Iterator[tuple[int, Sample]]:
        """``pending`` prompts in chunks that fit the server's queue (:func:`queue_chunk`); a chunk refused
        with a full queue is resent halved (finished chunks are kept: only the missing prompts go again)."""
        size = queue_chunk(self._max_batch_size, self.server_info())
        start = 0
        while start < len(pending):
            chunk = pending[start : start + size]
            chunk_seeds = None if seeds is None else [seeds[i] for i in chunk]
            try:
                samples = self._generate_batch([prompts[i] for i in chunk], params, chunk_seeds)
            except BatchTooLarge:
                if len(chunk) == 1:
                    raise
                size = len(chunk) // 2
                continue
            yield from zip(chunk, samples, strict=True)
            start += len(chunk)

    def _generate_batch(
        self, prompts: list[str], params: SamplingParams, seeds: list[int] | None
    ) -> list[Sample]:
        info = self.server_info()  # the version floor, before the first /generate
        timeout = params.timeout_s or generate_timeout(self._timeout, self._token_timeout_s, params.max_new_tokens,
                                                       len(prompts), info)
        body = {"text": prompts, "sampling_params": request_sampling(params, seeds)}
        with dataset_timeout(params.timeout_s, len(prompts)):
            response = send_retrying_busy(lambda: self._request("POST", "/generate", json=body, timeout=timeout),
                                          self._busy_retries, self._busy_retry_delay, "POST /generate")
        if response.status_code != 200:
            message = f"POST /generate: {error_message(response)}"
            if 400 <= response.status_code < 500 and response.status_code not in TRANSIENT_4XX:
                raise RequestRejected(f"{message} (the server refused the request; no restart)")
            raise EngineError(message)
        try:
            reply = response.json()
        except ValueError as e:
            raise EngineError(f"POST /generate: reply is not JSON: {response.text[:200]}") from e
        if not isinstance(reply, list) or len(reply) != len(prompts):
            raise EngineError(f"/generate returned {str(reply)[:200]} for {len(prompts)} prompts")
        return [parse_generation(item) for item in reply]

    def teacher_forced(self, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """The canary's recomputation (:mod:`ckpteval.jobs.eval.proof.canary`) by the server, with the tokenizer it
        generates with: one ``/generate`` of input-token log-probs (:mod:`~ckpteval.jobs.eval.engines.sglang.logprobs`),
        handled like a generate: a busy 503 is retried (:func:`send_retrying_busy`, never a restart), aborted
        items are resent (``abort_retries``, then :class:`SamplesAborted`); the texts go in requests that fit
        the server's queue (:func:`queue_chunk`), halved on a persistent queue-full or waiting timeout."""
        chunk = queue_chunk(self._max_batch_size, self.server_info())

        def post(body: dict[str, Any]) -> httpx.Response:
            return send_retrying_busy(lambda: self._request("POST", "/generate", json=body), self._busy_retries,
                                      self._busy_retry_delay, "POST /generate (canary log-probs)")

        return server_teacher_forced(post, pairs, chunk, self._abort_retries, self._abort_retry_delay)

    def lm_eval_model(self, snapshot_dir: str) -> tuple[str, str]:
        """``(model, tokenizer)`` lm-eval's ``local-completions`` names: the snapshot (loaded in place) for
        both; LoRA engines name ``<base>:<adapter>`` and the base's tokenizer."""
        return snapshot_dir, snapshot_dir

    def auth_header(self, path: str) -> dict[str, str]:
        """The ``Authorization`` header this engine sends to ``path`` (:mod:`~ckpteval.jobs.eval.engines.http.auth`)."""
        return auth_headers(path, self._keys)

    def _warn_if_seeds_ignored(self, params: SamplingParams, seeds: list[int] | None) -> None:
        if seeds is None or params.temperature == 0 or self._warned_nondeterministic:
            return
        if self.server_info().get("enable_deterministic_inference") is False:
            self._warned_nondeterministic = True
            print(f"ckpteval: sglang at {self._base_url} runs without --enable-deterministic-inference: it ignores "
                  "per-sample seeds (samples are independent but not reproducible)", file=sys.stderr, flush=True)

    def healthy(self) -> bool:
        if self._closed:
            return False
        try:
            response = self._client.get("/health_generate", timeout=self._health_timeout)
        except httpx.TransportError:
            return False
        return response.status_code == 200

    def restart(self) -> None:
        if self._launcher is None:
            raise EngineError(
                f"cannot restart {self._base_url}: attached to a server this engine did not launch"
            )
        self._launcher()

    def close(self) -> None:
        self._closed = True
        self._client.close()

    def __enter__(self) -> HTTPEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
