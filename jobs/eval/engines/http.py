"""``HTTPEngine``: the :class:`~jobs.eval.engines.base.Engine` protocol over sglang's native HTTP API.

Works against any server speaking the subset ``ckpteval serve`` implements (sglang itself, or
``ckpteval serve``): ``/update_weights_from_disk``, ``/model_info`` (falling back to the older
``/get_model_info``), ``/generate`` and ``/health_generate``.

Promises:

- :meth:`HTTPEngine.load` asks the server to load the snapshot and stamp ``weight_version``, then
  reads the version back; a failed update raises :class:`EngineError`, a read-back that differs
  raises :class:`WeightVersionMismatch` (an ``EngineError``: another client reloaded the server).
- :meth:`HTTPEngine.generate` sends each batch (up to ``max_batch_size`` prompts) as one request
  with a list of texts, and returns every sample with the ``meta_info.weight_version`` the server
  stamped on it, so mixed versions are visible per sample.
- Every network failure, timeout, non-2xx reply or malformed reply becomes :class:`EngineError`;
  :meth:`HTTPEngine.healthy` returns False instead, catching only httpx transport errors.

Limits: an attached server cannot be restarted (:meth:`HTTPEngine.restart` raises) unless a
``launcher`` callback is given; sampling settings are validated by the server, so a bad one comes
back as :class:`EngineError` carrying the server's message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from jobs.eval.engines.base import EngineError, Generation, SamplingParams


class WeightVersionMismatch(EngineError):
    """The server reports a different ``weight_version`` than the one just loaded."""


def sampling_json(params: SamplingParams) -> dict[str, Any]:
    """sglang ``sampling_params`` for :class:`SamplingParams` (``sampling_seed`` only when set)."""
    body: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
    }
    if params.seed is not None:
        body["sampling_seed"] = params.seed
    return body


def error_message(response: httpx.Response) -> str:
    """The server's explanation of a failed request, whatever shape its body has."""
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:500]}"
    if isinstance(body, dict):
        nested = body.get("error")
        if isinstance(nested, dict) and "message" in nested:
            return f"HTTP {response.status_code}: {nested['message']}"
        if "message" in body:
            return f"HTTP {response.status_code}: {body['message']}"
    return f"HTTP {response.status_code}: {body!r}"[:600]


def parse_generation(item: Any) -> Generation:
    """One ``/generate`` result -> :class:`Generation`; :class:`EngineError` if malformed."""
    try:
        meta = item["meta_info"]
        text, version, n_tokens = item["text"], meta.get("weight_version"), meta["completion_tokens"]
    except (KeyError, TypeError) as e:
        raise EngineError(f"malformed /generate result {str(item)[:200]}: missing {e}") from e
    if not isinstance(text, str) or not isinstance(n_tokens, int):
        raise EngineError(f"malformed /generate result {str(item)[:200]}")
    return Generation(text=text, weight_version=None if version is None else str(version), n_tokens=n_tokens)


class HTTPEngine:
    """An engine behind a URL; see the module docstring."""

    def __init__(
        self,
        base_url: str,
        timeout: float = 300.0,
        *,
        load_timeout: float = 600.0,
        health_timeout: float = 20.0,
        max_batch_size: int = 512,
        launcher: Callable[[], None] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._base_url = base_url.rstrip("/")
        self._load_timeout = load_timeout
        self._health_timeout = health_timeout
        self._max_batch_size = max_batch_size
        self._launcher = launcher
        self._client = httpx.Client(base_url=self._base_url, timeout=timeout)
        self._model_info_path = "/model_info"
        self._closed = False

    @property
    def base_url(self) -> str:
        return self._base_url

    # ------------------------------------------------------------------ requests
    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        if self._closed:
            raise EngineError(f"engine for {self._base_url} is closed")
        try:
            return self._client.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise EngineError(f"{method} {self._base_url}{path} failed: {type(e).__name__}: {e}") from e

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._request(method, path, **kwargs)
        if response.status_code != 200:
            raise EngineError(f"{method} {path}: {error_message(response)}")
        try:
            return response.json()
        except ValueError as e:
            raise EngineError(f"{method} {path}: reply is not JSON: {response.text[:200]}") from e

    # ------------------------------------------------------------------ Engine protocol
    def load(self, snapshot_dir: str, weight_version: str) -> None:
        body = {"model_path": str(snapshot_dir), "weight_version": weight_version}
        response = self._request("POST", "/update_weights_from_disk", json=body, timeout=self._load_timeout)
        try:
            reply = response.json()
        except ValueError:
            reply = None
        if response.status_code != 200 or not isinstance(reply, dict) or reply.get("success") is not True:
            raise EngineError(f"update_weights_from_disk({snapshot_dir}) failed: {error_message(response)}")
        reported = self.weight_version()
        if reported != weight_version:
            raise WeightVersionMismatch(
                f"loaded {snapshot_dir} as version {weight_version!r} but the server reports {reported!r}"
            )

    def model_info(self) -> dict[str, Any]:
        """The server's model info (``/model_info``, or ``/get_model_info`` on older servers)."""
        response = self._request("GET", self._model_info_path)
        if response.status_code == 404 and self._model_info_path == "/model_info":
            self._model_info_path = "/get_model_info"
            response = self._request("GET", self._model_info_path)
        if response.status_code != 200:
            raise EngineError(f"GET {self._model_info_path}: {error_message(response)}")
        try:
            info = response.json()
        except ValueError as e:
            raise EngineError(f"GET {self._model_info_path}: reply is not JSON") from e
        if not isinstance(info, dict):
            raise EngineError(f"GET {self._model_info_path}: expected an object, got {info!r}")
        return info

    def weight_version(self) -> str | None:
        version = self.model_info().get("weight_version")
        return None if version is None else str(version)

    def generate(self, prompts: list[str], params: SamplingParams) -> list[Generation]:
        results: list[Generation] = []
        for start in range(0, len(prompts), self._max_batch_size):
            chunk = prompts[start : start + self._max_batch_size]
            body = {"text": chunk, "sampling_params": sampling_json(params)}
            reply = self._json("POST", "/generate", json=body)
            if not isinstance(reply, list) or len(reply) != len(chunk):
                raise EngineError(f"/generate returned {str(reply)[:200]} for {len(chunk)} prompts")
            results.extend(parse_generation(item) for item in reply)
        return results

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
