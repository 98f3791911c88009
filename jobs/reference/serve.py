"""``ckpteval serve``: an HTTP engine speaking sglang 0.5.23's native API, on CPU or CUDA.

It lets every eval path that talks to sglang (``HTTPEngine``, version pinning through
``update_weights_from_disk`` + ``model_info``) run on machines without a GPU or sglang, against the
contract real sglang has. Each behaviour below was read from the sglang 0.5.23 wheel (paths inside
it); the server reports ``"version": "0.5.23"`` on ``/server_info``.

Routes (``srt/entrypoints/http_server.py``; nothing that release lacks, e.g. no
``/get_weight_version``, removed in 0.5.21):

- ``POST|PUT /generate``: ``text`` (str or list) or ``input_ids`` (list[int] or list[list[int]]),
  ``sampling_params`` (one dict, or one per prompt), ``rid``. Reply per prompt ``{"text",
  "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "weight_version",
  "weight_versions", "num_retractions", "completion_tokens", "cached_tokens", "e2e_latency"}}``, a
  list for list input. ``finish_reason`` is ``{"type": "stop", "matched": id}``, ``{"type":
  "length", "length": n}`` or ``{"type": "abort", "message", "status_code": null, "err_type": null}``
  (``srt/managers/schedule_batch.py`` FINISH_*). ``weight_versions`` spans the output tokens
  (``srt/utils/weight_versions.py``); ``weight_version`` is the label when the output is produced.
- ``POST /update_weights_from_disk`` ``{"model_path", "weight_version"?, "abort_all_requests"?:
  false, "load_format"?}``: 200/400 ``{"success", "message", "num_paused_requests"}``; the label and
  ``model_path`` change only on success (``srt/managers/tokenizer_manager.py``).
- ``POST /update_weight_version`` ``{"new_version", "abort_all_requests"?: true}``: relabels without
  touching weights, aborting in-flight requests by default (``srt/managers/io_struct.py``).
- ``POST /abort_request`` ``{"rid", "abort_all"?}`` (rid prefix match, as the scheduler does),
  ``POST /pause_generation`` ``{"mode": "abort"|"retract"|"in_place"}`` (abort: aborts everything in
  flight, waits for it to end; new requests wait until ``POST /continue_generation``).
- ``GET /model_info`` (and the deprecated ``/get_model_info``), ``GET /server_info`` (and
  ``/get_server_info``) with ``"version"`` and ``enable_deterministic_inference``.
- ``GET /health`` and ``/health_generate`` (the same handler in sglang): a one-token generate, 200
  with an empty body, 503 when it gets no answer within ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s),
  while paused, or before a model is loaded; 200 at once while a generation is running.

Status codes and bodies for bad requests, as sglang answers them:

- a body FastAPI cannot parse: 400 ``{"object": "error", "message", "type": "Bad Request", "param":
  null, "code": 400}`` (``validation_exception_handler``);
- ``sampling_params`` violating the schema (an unknown key, a float where an int belongs, a bool for a
  number): 400 ``{"error": "<text>"}`` (``srt/entrypoints/api_contract.py``, ``sglang/api/v1/api_types.py``);
- what the tokenizer manager refuses (``SamplingParams.verify`` ranges: ``top_k`` 0, ``top_p`` 0,
  negative temperature or ``max_new_tokens``; a prompt at or over the context length; an explicit
  ``max_new_tokens`` that overflows it; a LoRA request; no prompt): 400 ``{"error": {"message"}}``;
- ``max_new_tokens: 0`` is valid (empty output, ``{"type": "length", "length": 0}``); an absent one
  defaults to 128, capped at the context length as the scheduler does; temperature below 1e-6 is greedy;
- an unknown route: 404 ``{"detail": "Not Found"}``; an engine failure: 500.

Seeds: ``sampling_seed`` is validated always and applied only with ``--enable-deterministic-inference``
(``srt/sampling/sampling_batch_info.py``; unseeded requests then use 42), where a sample depends on its
prompt, settings and seed only: identical (prompt, seed) pairs give identical samples.

Limits (stand-in, not sglang): one engine lock serializes generation and loads, so weights never
change under a running generation and a relabel during one is attributed to its last token; an abort
of a running request takes effect when its batch finishes (the output is kept, marked aborted);
sglang fields the stand-in cannot honour (streaming, logprobs, ``n`` > 1, stop strings, grammars,
multimodal input, ...) are refused with 400 ``{"error": {"message"}}`` naming them; out-of-vocabulary
``input_ids`` are refused (sglang leaves them undefined).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.eval.engines.base import EngineError, SamplingParams
from jobs.eval.options import DEVICE_RE
from jobs.flags import Parser, bounded, check_file_readable, fail, positive_int

if TYPE_CHECKING:
    from jobs.eval.engines.hf import Completion, HFEngine

EMULATED_SGLANG_VERSION = "0.5.23"
DEFAULT_WEIGHT_VERSION = "default"  # sglang's ServerArgs.weight_version default
DEFAULT_MAX_NEW_TOKENS = 128  # sampling_params.py SamplingParams.max_new_tokens
DETERMINISTIC_DEFAULT_SEED = 42  # sampling_batch_info.py: the seed of unseeded requests in deterministic mode
GREEDY_EPS = 1e-6  # sampling_params.py _SAMPLING_EPS: a lower temperature means greedy
MAX_BODY_BYTES = 64 * 1024 * 1024
PAUSE_MODES = ("abort", "retract", "in_place")
# sglang/api/v1/api_types.py SamplingParams: every field the schema knows, in its order (others are a 400).
SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
)  # fmt: skip
INT_FIELDS = ("max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval", "sampling_seed", "beam_width")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")
IMPLEMENTED = ("max_new_tokens", "temperature", "top_p", "top_k", "sampling_seed")
# The values of unimplemented fields that change nothing (sglang's defaults): accepted.
NEUTRAL = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
    "n": 1, "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "no_stop_trim": False,
}  # fmt: skip
# GenerateReqInput fields the stand-in cannot serve when set (io_struct.py); lora_path has sglang's own error.
UNSUPPORTED_REQUEST_KEYS = (
    "stream", "return_logprob", "return_hidden_states", "input_embeds", "image_data", "video_data",
    "audio_data", "session_params", "custom_logit_processor",
)  # fmt: skip


class BadRequest(ValueError):
    """A body FastAPI would not parse: 400 with sglang's ``ErrorResponse`` body."""


class ContractError(ValueError):
    """A ``sampling_params`` schema violation: 400 ``{"error": "<text>"}``."""


class Refused(ValueError):
    """What sglang's tokenizer manager raises ValueError for: 400 ``{"error": {"message"}}``."""


def health_check_timeout() -> float:
    """sglang's ``HEALTH_CHECK_TIMEOUT`` (``SGLANG_HEALTH_CHECK_TIMEOUT``, default 20 s)."""
    return float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))


# --------------------------------------------------------------------------------------------------
# Request parsing (pure functions)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """One prompt's sampling: our :class:`SamplingParams` plus sglang's view of it."""

    params: SamplingParams  # temperature 0 = greedy; top_k -1 = off; seed = sampling_seed (may be ignored)
    max_new_tokens: int | None  # as sent (None: the default, capped at the context)


@dataclass(frozen=True)
class GenerateRequest:
    """A parsed ``/generate`` body: one prompt per item, as text or ids, with its sampling and rid."""

    batched: bool
    texts: list[str] | None
    input_ids: list[list[int]] | None
    sampling: list[Sampling]
    rids: list[str]


def _json_kind(value: Any) -> str:
    """How a JSON value is named in the schema's type errors (serde's wording, as sglang prints it)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map"


def check_sampling_schema(raw: dict[str, Any]) -> None:
    """The 0.5.22+ schema gate on one ``sampling_params`` object (ContractError)."""
    for key, value in raw.items():
        if key not in SAMPLING_FIELDS:
            listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")
        if value is None:
            continue
        if key in INT_FIELDS and (isinstance(value, bool) or not isinstance(value, int)):
            raise ContractError(f"invalid type: {_json_kind(value)}, expected i64")
        if key in FLOAT_FIELDS and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ContractError(f"invalid type: {_json_kind(value)}, expected f64")
        if key in BOOL_FIELDS and not isinstance(value, bool):
            raise ContractError(f"invalid type: {_json_kind(value)}, expected a boolean")


def parse_sampling(raw: Any) -> Sampling:
    """One sglang ``sampling_params`` object -> :class:`Sampling`, with sglang's defaults and checks."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ContractError(f"invalid type: {_json_kind(raw)}, expected struct SamplingParams")
    check_sampling_schema(raw)
    unserved = sorted(k for k, v in raw.items() if k not in IMPLEMENTED and v is not None and NEUTRAL.get(k) != v)
    if unserved:
        raise Refused(f"ckpteval serve does not implement sampling_params {unserved} (sglang does)")
    value = {k: v for k, v in raw.items() if v is not None}
    temperature = float(value.get("temperature", 1.0))
    top_p = float(value.get("top_p", 1.0))
    top_k = int(value.get("top_k", -1))
    max_new = value.get("max_new_tokens")
    seed = value.get("sampling_seed")
    # SamplingParams.verify (sampling_params.py), after __post_init__ maps temperature < 1e-6 to greedy.
    if not math.isfinite(temperature) or temperature < 0.0:
        raise Refused(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise Refused(f"top_p must be in (0, 1], got {top_p}.")
    if top_k != -1 and top_k < 1:
        raise Refused(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if max_new is not None and max_new < 0:
        raise Refused(f"max_new_tokens must be at least 0, got {max_new}.")
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
        raise Refused(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    greedy = temperature < GREEDY_EPS
    params = SamplingParams(
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new,
        temperature=0.0 if greedy else temperature,
        top_p=top_p,
        top_k=-1 if greedy or top_k == -1 else top_k,
        seed=seed,
    )
    return Sampling(params, max_new)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_prompts(body: dict[str, Any]) -> tuple[bool, list[str] | None, list[list[int]] | None]:
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and not (isinstance(text, str) or (isinstance(text, list) and all(isinstance(t, str) for t in text))):
        raise BadRequest("'text' must be a string or a list of strings")
    if ids is not None:
        flat = isinstance(ids, list) and all(_is_int(t) for t in ids)
        nested = isinstance(ids, list) and all(isinstance(r, list) and all(_is_int(t) for t in r) for r in ids)
        if not (flat or nested):
            raise BadRequest("'input_ids' must be a list of ints or a list of lists of ints")
        if not ids:
            raise Refused("input_ids cannot be empty.")  # io_struct.py _determine_batch_size
        if flat:  # the ids are what sglang generates from when both are given (_tokenize_one_request)
            return False, None, [list(ids)]
        if any(not row for row in ids):
            raise Refused("input_ids cannot be empty.")
        return True, None, [list(r) for r in ids]
    if text is None:
        raise Refused("Either text, input_ids or input_embeds should be provided.")  # io_struct.py _validate_inputs
    if isinstance(text, str):
        return False, [text], None
    if not text:
        raise Refused("ckpteval serve: an empty batch (text: [])")
    return True, list(text), None


def _parse_rids(rid: Any, batched: bool, n: int) -> list[str]:
    """io_struct.py ``_normalize_rid``: a str prefix becomes ``{rid}_{i}`` in a batch; a list must match."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, str):
        return [rid] if not batched else [f"{rid}_{i}" for i in range(n)]
    if isinstance(rid, list) and all(isinstance(r, str) for r in rid) and batched:
        if len(rid) != n:
            raise Refused("The specified rids length mismatch with the batch_size for batch processing.")
        if len(set(rid)) != n:
            raise Refused(f"Duplicate request IDs detected within the request: {sorted(rid)}")
        return list(rid)
    raise BadRequest("'rid' must be a string or, for a batch, a list of strings")


def parse_generate(body: Any) -> GenerateRequest:
    """Validate a ``/generate`` body as sglang does; the exception type says which 400 body answers it."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    raw = body.get("sampling_params")
    if raw is not None and not isinstance(raw, dict | list):
        raise BadRequest("'sampling_params' must be an object or a list of objects")
    for item in raw if isinstance(raw, list) else [raw]:  # the schema gate comes before everything else
        if item is not None and not isinstance(item, dict):
            raise ContractError(f"invalid type: {_json_kind(item)}, expected struct SamplingParams")
        check_sampling_schema(item or {})
    batched, texts, input_ids = _parse_prompts(body)
    if body.get("lora_path") is not None:  # tokenizer_manager.py, with LoRA disabled
        name = body["lora_path"] if isinstance(body["lora_path"], str) else next(iter(body["lora_path"]), None)
        raise Refused(
            f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server with "
            "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
        )
    unserved = [k for k in UNSUPPORTED_REQUEST_KEYS if body.get(k)]
    if unserved:
        raise Refused(f"ckpteval serve does not implement {unserved} (sglang does)")
    n = len(texts if texts is not None else input_ids)
    if isinstance(raw, list):
        if not batched or len(raw) != n:
            raise Refused(f"ckpteval serve: a list of sampling_params needs a batch of the same length ({n})")
        sampling = [parse_sampling(p) for p in raw]
    else:
        sampling = [parse_sampling(raw)] * n
    return GenerateRequest(batched, texts, input_ids, sampling, _parse_rids(body.get("rid"), batched, n))


def parse_update(body: Any) -> tuple[str, str | None, bool]:
    """``(model_path, weight_version, abort_all_requests)`` from an ``/update_weights_from_disk`` body."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    path, version = body.get("model_path"), body.get("weight_version")
    if not isinstance(path, str):
        raise BadRequest("'model_path' (a string) is required")
    if version is not None and not isinstance(version, str):
        raise BadRequest(f"'weight_version' must be a string, got {version!r}")
    abort_all = body.get("abort_all_requests", False)
    if not isinstance(abort_all, bool):
        raise BadRequest("'abort_all_requests' must be a boolean")
    return path, version, abort_all


def error_body(message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> dict[str, Any]:
    """sglang's ``ErrorResponse`` shape (``srt/entrypoints/openai/protocol.py``)."""
    return {"object": "error", "message": message, "type": status.phrase, "param": None, "code": status.value}


# --------------------------------------------------------------------------------------------------
# The service: live requests, pause, labels; engine calls behind one lock
# --------------------------------------------------------------------------------------------------


@dataclass
class Live:
    """A request the server holds (registered after the pause gate, as sglang's ``rid_to_state``)."""

    aborted: bool = False


@dataclass
class Row:
    """One prompt of a request on its way through the engine."""

    index: int
    rid: str
    ids: list[int]
    params: SamplingParams
    completion: Completion | None = None
    label_before: str = ""
    aborted: str | None = None  # the abort message


class EngineService:
    """What the HTTP handlers call; owns the engine, the served label and path, live requests, pause."""

    def __init__(
        self, engine: HFEngine, model_path: str, deterministic: bool = False, label: str | None = None
    ) -> None:
        self.engine = engine
        self.model_path = self.launch_model_path = model_path
        self.deterministic = deterministic
        self.label = label if label is not None else engine.weight_version() or DEFAULT_WEIGHT_VERSION
        self.launch_label = self.label
        self.lock = threading.Lock()  # the engine: generation and loads
        self.tokenizer_lock = threading.Lock()  # HF fast tokenizers refuse concurrent use ("Already borrowed")
        self.state = threading.Condition()  # live requests, pause, generation count
        self.live: dict[str, Live] = {}
        self.paused = False
        self.generating = 0

    # ---------------------------------------------------------------- generation
    def context_length(self) -> int:
        model = self.engine.model
        return int(getattr(model.config, "max_position_embeddings", 1 << 30)) if model is not None else 1 << 30

    def tokenize(self, req: GenerateRequest) -> list[list[int]]:
        if req.input_ids is not None:
            return req.input_ids
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise EngineError("no model loaded")
        with self.tokenizer_lock:
            return tokenizer(req.texts)["input_ids"]

    def check_lengths(self, rows: list[list[int]], req: GenerateRequest) -> None:
        """tokenizer_manager.py ``_validate_one_request`` (no auto-truncation)."""
        context = self.context_length()
        for ids, sampling in zip(rows, req.sampling, strict=True):
            if len(ids) >= context:
                raise Refused(
                    f"The input ({len(ids)} tokens) is longer than the model's context length ({context} tokens)."
                )
            if sampling.max_new_tokens is not None and sampling.max_new_tokens + len(ids) > context:
                total = sampling.max_new_tokens + len(ids)
                raise Refused(
                    f"Requested token count exceeds the model's maximum context length of {context} tokens. "
                    f"You requested a total of {total} tokens: {len(ids)} tokens from the input messages and "
                    f"{sampling.max_new_tokens} tokens for the completion. Please reduce the number of tokens "
                    "in the input messages or the completion to fit within the limit."
                )
        vocab = getattr(getattr(self.engine.model, "config", None), "vocab_size", None)
        if vocab is not None and any(not 0 <= t < vocab for ids in rows for t in ids):
            raise Refused(f"ckpteval serve: input_ids must be in [0, {vocab})")

    def generate(self, req: GenerateRequest) -> list[dict[str, Any]]:
        start = time.perf_counter()
        ids = self.tokenize(req)
        self.check_lengths(ids, req)
        context = self.context_length()
        rows = [
            Row(i, rid, row, self._effective(s.params, len(row), context))
            for i, (rid, row, s) in enumerate(zip(req.rids, ids, req.sampling, strict=True))
        ]
        with self.state:
            while self.paused:  # tokenizer_manager.py: new requests wait on is_pause before registering
                self.state.wait()
            for row in rows:
                self.live[row.rid] = Live()
        try:
            with self.lock:
                with self.state:
                    self.generating += 1
                try:
                    for group in self._groups(rows):
                        self._run(group)
                finally:
                    with self.state:
                        self.generating -= 1
        finally:
            with self.state:
                for row in rows:
                    self.live.pop(row.rid, None)
                self.state.notify_all()
        latency = time.perf_counter() - start
        return [self._item(row, latency) for row in rows]

    def _effective(self, params: SamplingParams, prompt_len: int, context: int) -> SamplingParams:
        """scheduler.py ``init_req_max_new_tokens``: at most context - 1 - prompt - 1 new tokens; seeds
        apply in deterministic mode only (sampling_batch_info.py), unseeded ones then use 42."""
        budget = max(0, min(params.max_new_tokens, context - prompt_len - 2))
        seed = None
        if self.deterministic and params.temperature > 0:
            seed = params.seed if params.seed is not None else DETERMINISTIC_DEFAULT_SEED
        return replace(params, max_new_tokens=budget, seed=seed)

    def _groups(self, rows: list[Row]) -> list[list[Row]]:
        """Rows that can share one engine call. A seeded (deterministic) row runs alone, once per distinct
        prompt, so its sample depends on prompt, settings and seed only, never on its batch-mates."""
        groups: dict[Any, list[Row]] = {}
        for row in rows:
            key = (row.params, tuple(row.ids)) if row.params.seed is not None else (row.params,)
            groups.setdefault(key, []).append(row)
        return list(groups.values())

    def _run(self, group: list[Row]) -> None:
        with self.state:
            for row in group:
                if self.live[row.rid].aborted:  # aborted before it ran: tokenizer_manager _handle_abort_req
                    row.aborted = "Abort in waiting queue"
            todo = [r for r in group if r.aborted is None]
            label = self.label
        if not todo:
            return
        params = todo[0].params
        if params.max_new_tokens == 0:  # prefill only: nothing generated (schedule_batch.py FINISH_LENGTH)
            done = [Completion("", [], {"type": "length", "length": 0}, len(r.ids), label) for r in todo]
        elif params.seed is not None:
            once = self.engine.generate_ids([todo[0].ids], params)[0]
            done = [once] * len(todo)
        else:
            done = self.engine.generate_ids([r.ids for r in todo], params)
        with self.state:
            for row, completion in zip(todo, done, strict=True):
                row.completion, row.label_before = completion, label
                if self.live[row.rid].aborted:  # aborted while running: FINISH_ABORT with the output so far
                    row.aborted = "Aborted"

    def _item(self, row: Row, latency: float) -> dict[str, Any]:
        c = row.completion
        output_ids = [] if c is None else c.output_ids
        label = self.label
        spans = self._spans(row.label_before or label, label, len(output_ids))
        meta: dict[str, Any] = {"id": row.rid}
        if row.aborted is not None:
            meta |= {
                "finish_reason": {"type": "abort", "message": row.aborted, "status_code": None, "err_type": None},
                "weight_version": spans[-1]["version"],
                "e2e_latency": latency,
                "completion_tokens": len(output_ids),
                "weight_versions": spans,
            }
        else:
            meta |= {
                "finish_reason": c.finish_reason,
                "prompt_tokens": c.prompt_tokens,
                "weight_version": spans[-1]["version"],
                "num_retractions": 0,
                "completion_tokens": len(output_ids),
                "cached_tokens": 0,
                "e2e_latency": latency,
                "weight_versions": spans,
            }
        return {"text": "" if c is None else c.text, "output_ids": output_ids, "meta_info": meta}

    @staticmethod
    def _spans(before: str, after: str, n: int) -> list[dict[str, Any]]:
        """weight_versions.py spans; a relabel during the run is attributed to the last token."""
        if before == after or n < 2:
            return [{"version": after, "start": 0, "end": n}]
        return [{"version": before, "start": 0, "end": n - 1}, {"version": after, "start": n - 1, "end": n}]

    # ---------------------------------------------------------------- control
    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """tokenizer_manager.py ``abort_request``; the scheduler matches rids by prefix."""
        if not abort_all and not rid:
            return
        with self.state:
            for live_rid, live in self.live.items():
                if abort_all or live_rid.startswith(rid):
                    live.aborted = True

    def pause(self, mode: str) -> None:
        """tokenizer_manager.py ``pause_generation``: abort mode aborts everything in flight until none is."""
        with self.state:
            self.paused = True
            if mode != "abort":
                return
            while self.live:
                for live in self.live.values():
                    live.aborted = True
                self.state.wait(1.0)

    def resume(self) -> None:
        with self.state:
            self.paused = False
            self.state.notify_all()

    def relabel(self, version: str, abort_all: bool) -> None:
        if abort_all:
            self.abort(abort_all=True)
        with self.state:
            self.label = version

    def update(self, path: str, version: str | None, abort_all: bool) -> tuple[bool, str]:
        if abort_all:
            self.abort(abort_all=True)
        with self.lock:
            try:
                self.engine.load(path, version if version is not None else self.label)
            except (EngineError, ValueError, OSError) as e:
                return False, f"Failed to update weights: {e}."  # label and model_path stay (sglang)
            with self.state:
                self.model_path = path
                if version is not None:
                    self.label = version
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return True, message

    # ---------------------------------------------------------------- info and health
    def model_info(self) -> dict[str, Any]:
        model = self.engine.model
        config = model.config if model is not None else None
        return {
            "model_path": self.model_path,
            "served_model_name": self.model_path,
            "tokenizer_path": self.launch_model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.label,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }

    def server_info(self) -> dict[str, Any]:
        return {
            "model_path": self.launch_model_path,
            "served_model_name": self.launch_model_path,
            "weight_version": self.launch_label,
            "enable_deterministic_inference": self.deterministic,
            "enable_lora": False,
            "load_format": "auto",
            "context_length": None,
            "internal_states": [{}],
            "version": EMULATED_SGLANG_VERSION,
            "frontend": "python",
        }

    def healthy(self) -> bool:
        """http_server.py ``health_generate``: 200 once any output arrives within the health budget."""
        deadline = time.monotonic() + health_check_timeout()
        with self.state:
            if self.generating:  # busy: its output is the answer
                return True
            while self.paused:
                if not self.state.wait(max(0.0, deadline - time.monotonic())):
                    return False
        if not self.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        try:
            return self.engine.healthy()
        finally:
            self.lock.release()


# --------------------------------------------------------------------------------------------------
# HTTP layer
# --------------------------------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    """Routes requests to the :class:`EngineService` of its server."""

    server: EngineHTTPServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._route(
            {
                "/health": self._health,
                "/health_generate": self._health,
                "/model_info": self._model_info,
                "/get_model_info": self._model_info,
                "/server_info": self._server_info,
                "/get_server_info": self._server_info,
            }
        )

    def do_POST(self) -> None:
        self._route(
            {
                "/generate": self._generate,
                "/update_weights_from_disk": self._update,
                "/update_weight_version": self._relabel,
                "/abort_request": self._abort,
                "/pause_generation": self._pause,
                "/continue_generation": self._continue,
                "/v1/completions": lambda: self._json(*openai_completions(self.server.service, self._body())),
            }
        )

    def do_PUT(self) -> None:
        self._route({"/generate": self._generate})

    def _route(self, routes: dict[str, Callable[[], None]]) -> None:
        handler = routes.get(self.path.split("?", 1)[0])
        if handler is None:
            self.close_connection = True
            self._json(HTTPStatus.NOT_FOUND, {"detail": "Not Found"})  # FastAPI's 404
            return
        try:
            handler()
        except BadRequest as e:
            self.close_connection = True  # the body may be unread: do not reuse this connection
            self._json(HTTPStatus.BAD_REQUEST, error_body(str(e)))
        except ContractError as e:
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(e)})
        except Refused as e:
            self._json(HTTPStatus.BAD_REQUEST, {"error": {"message": str(e)}})

    # ---------------------------------------------------------------- endpoints
    def _generate(self) -> None:
        req = parse_generate(self._body())
        try:
            items = self.server.service.generate(req)
        except EngineError:
            self._text(HTTPStatus.INTERNAL_SERVER_ERROR, "Internal Server Error")  # Starlette's 500
            return
        self._json(HTTPStatus.OK, items if req.batched else items[0])

    def _update(self) -> None:
        path, version, abort_all = parse_update(self._body())
        success, message = self.server.service.update(path, version, abort_all)
        status = HTTPStatus.OK if success else HTTPStatus.BAD_REQUEST
        self._json(status, {"success": success, "message": message, "num_paused_requests": 0})

    def _relabel(self) -> None:
        body = self._body()
        version = body.get("new_version") if isinstance(body, dict) else None
        abort_all = body.get("abort_all_requests", True) if isinstance(body, dict) else True
        if not isinstance(version, str) or not isinstance(abort_all, bool):
            raise BadRequest("'new_version' (a string) is required; 'abort_all_requests' is a boolean")
        self.server.service.relabel(version, abort_all)
        self._json(
            HTTPStatus.OK, {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
        )

    def _abort(self) -> None:
        body = self._body()
        if not isinstance(body, dict) or not isinstance(body.get("rid", ""), str | None):
            raise BadRequest("'rid' must be a string")
        self.server.service.abort(body.get("rid") or "", bool(body.get("abort_all", False)))
        self._empty(HTTPStatus.OK)

    def _pause(self) -> None:
        body = self._body(default={})
        mode = body.get("mode", "abort") if isinstance(body, dict) else None
        if mode not in PAUSE_MODES:
            raise BadRequest(f"'mode' must be one of {list(PAUSE_MODES)}")
        self.server.service.pause(mode)
        self._json(HTTPStatus.OK, {"message": "Generation paused successfully.", "status": "ok"})

    def _continue(self) -> None:
        self._body(default={})
        self.server.service.resume()
        self._json(HTTPStatus.OK, {"message": "Generation continued successfully.", "status": "ok"})

    def _model_info(self) -> None:
        self._json(HTTPStatus.OK, self.server.service.model_info())

    def _server_info(self) -> None:
        self._json(HTTPStatus.OK, self.server.service.server_info())

    def _health(self) -> None:
        service = self.server.service
        ok = service.engine.model is not None and service.healthy()
        self._empty(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE)

    # ---------------------------------------------------------------- plumbing
    def _body(self, default: Any = None) -> Any:
        length = self.headers.get("Content-Length")
        if (length is None or length == "0") and default is not None:
            return default
        if length is None or not length.isdigit():
            raise BadRequest("a Content-Length header is required")
        if int(length) > MAX_BODY_BYTES:
            raise BadRequest(f"request body over {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except ValueError as e:
            raise BadRequest(f"JSON decode error: {e}") from e

    def _json(self, status: HTTPStatus, payload: Any) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _text(self, status: HTTPStatus, text: str) -> None:
        self._send(status, text.encode(), "text/plain; charset=utf-8")

    def _send(self, status: HTTPStatus, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _empty(self, status: HTTPStatus) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)


class EngineHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server holding the :class:`EngineService`."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], service: EngineService, verbose: bool = False) -> None:
        self.service = service
        self.verbose = verbose
        super().__init__(address, Handler)


# --------------------------------------------------------------------------------------------------
# OpenAI-compatible POST /v1/completions, generation only (sglang serves it; lm-eval's local-completions
# backend speaks it). Self-contained: it reuses parse_generate and EngineService.generate.
# --------------------------------------------------------------------------------------------------

COMPLETIONS_KEYS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
                    "echo", "logprobs", "stream", "user")


def _stop_list(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        return [x for x in stop if x]
    raise BadRequest(f"'stop' must be a string or a list of strings, got {stop!r}")


def _cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    cut = min((i for i in (text.find(x) for x in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def openai_completions(service: EngineService, body: Any) -> tuple[HTTPStatus, dict[str, Any]]:
    """``POST /v1/completions``: ``prompt`` (str or list of str), ``max_tokens`` (default 16),
    ``temperature`` (1.0), ``top_p``, ``top_k``, ``seed``, ``stop`` (the text is cut before the first
    stop string). Log-likelihood requests (``echo`` / ``logprobs``), ``n > 1`` and streaming are refused
    (400); the reply is OpenAI's ``text_completion`` object, one choice per prompt, with ``index``."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    unknown = sorted(set(body) - set(COMPLETIONS_KEYS))
    if unknown:
        raise BadRequest(f"unsupported /v1/completions fields {unknown}; supported: {list(COMPLETIONS_KEYS)}")
    if body.get("echo") or body.get("logprobs") is not None or body.get("stream") or body.get("n", 1) != 1:
        raise BadRequest("ckpteval serve's /v1/completions generates only: no echo, logprobs, stream or n > 1")
    prompt = body.get("prompt")
    sampling = {"max_new_tokens": body.get("max_tokens", 16), "temperature": body.get("temperature", 1.0),
                **{k: body[k] for k in ("top_p", "top_k") if k in body},
                **({"sampling_seed": body["seed"]} if body.get("seed") is not None else {})}
    req = parse_generate({"text": prompt, "sampling_params": sampling})
    stops = _stop_list(body.get("stop"))
    try:
        items = service.generate(req)
    except ValueError as e:
        return HTTPStatus.BAD_REQUEST, {"error": {"message": str(e)}}
    except EngineError as e:
        return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": str(e)}}
    choices = []
    for i, item in enumerate(items):
        text, stopped = _cut_at_stop(item["text"], stops)
        finish = "stop" if stopped or item["meta_info"]["finish_reason"]["type"] == "stop" else "length"
        choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": finish})
    used = (sum(it["meta_info"].get("prompt_tokens", 0) for it in items),
            sum(it["meta_info"].get("completion_tokens", 0) for it in items))
    return HTTPStatus.OK, {
        "id": f"cmpl-{req.rids[0]}", "object": "text_completion", "created": int(time.time()),
        "model": service.model_path, "choices": choices,
        "usage": {"prompt_tokens": used[0], "completion_tokens": used[1], "total_tokens": sum(used)},
    }


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def _port(text: str) -> int:
    port = bounded(int, min=0)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"must be <= 65535, got {port}")
    return port


def _device(text: str) -> str:
    if not DEVICE_RE.match(text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ckpteval serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["hf"], default="hf", help="inference backend (default: hf)")
    parser.add_argument("--model", required=True, metavar="DIR", help="HF snapshot dir to load at start")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=30000,
                        help="port to listen on; 0 picks a free port (printed) (default: 30000)")
    parser.add_argument("--weight-version", default=DEFAULT_WEIGHT_VERSION, metavar="V",
                        help=f"version string the loaded model reports (default: {DEFAULT_WEIGHT_VERSION})")
    parser.add_argument("--device", type=_device, default="cpu", help="cpu, cuda, cuda:N (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights dtype (default: float32)")
    parser.add_argument("--max-batch-size", type=positive_int, default=256, metavar="N",
                        help="most prompts generated in one batch (default: 256)")
    parser.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="apply each request's sampling_params.sampling_seed (unseeded: 42), as sglang does with this flag",
    )
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    return parser


def _check_start(args: argparse.Namespace) -> str | None:
    """What is wrong with the model dir or device, checked before anything loads (None if nothing)."""
    try:
        check_file_readable("--model", Path(args.model) / "config.json")
    except (FileNotFoundError, ValueError) as e:
        return f"{e} (--model must be an HF snapshot dir)"
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return f"--device {args.device}: CUDA is not available on this machine"
    return None


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if (problem := _check_start(args)) is not None:
        return fail("ckpteval serve", problem)
    try:  # bind first: a port in use is a usage error, found before a long model load
        server = EngineHTTPServer((args.host, args.port), None, args.verbose)  # type: ignore[arg-type]
    except OSError as e:
        return fail("ckpteval serve", f"--host {args.host} --port {args.port}: cannot listen ({e.strerror or e})")
    from jobs.eval.engines.hf import HFEngine

    engine = HFEngine(device=args.device, dtype=args.dtype, max_batch_size=args.max_batch_size)
    try:
        engine.load(args.model, args.weight_version)
    except EngineError as e:
        server.server_close()
        return fail("ckpteval serve", f"cannot load {args.model}: {e}", 1)
    server.service = EngineService(engine, args.model, args.enable_deterministic_inference)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, name="ckpteval-serve", daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    print(f"serving on http://{host}:{port}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
        engine.close()
    return 0
