"""Parsing and validating ``ckpteval serve`` request bodies the way sglang 0.5.23 does.

Owns the request side of the contract ``ckpteval.jobs.reference.serve.main`` emulates: the ``sampling_params``
schema gate (``sglang/api/v1/api_types.py``), ``SamplingParams.verify`` ranges and defaults, the
``/generate`` and ``/update_weights_from_disk`` bodies, and which 400 body answers each mistake. The
exception type is the promise: :class:`BadRequest` -> sglang's ``ErrorResponse`` (:func:`error_body`),
:class:`ContractError` -> ``{"error": "<text>"}``, :class:`Refused` -> ``{"error": {"message"}}``.

Pure functions: nothing here touches the engine, the network or the context length (the engine
service checks lengths against the loaded model); fields the stand-in cannot honour are refused here.
"""

from __future__ import annotations

import hmac
import math
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from ckpteval.jobs.eval.engines.base import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 128  # sampling_params.py SamplingParams.max_new_tokens
GREEDY_EPS = 1e-6  # sampling_params.py _SAMPLING_EPS: a lower temperature means greedy
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
    "stream", "return_hidden_states", "input_embeds", "image_data", "video_data", "audio_data", "session_params",
    "custom_logit_processor", "token_ids_logprob", "return_text_in_logprobs",
)  # fmt: skip


# http_server.py routes marked @auth_level(AuthLevel.ADMIN_OPTIONAL) that the stand-in serves
ADMIN_OPTIONAL_ROUTES = frozenset({
    "/update_weights_from_disk", "/update_weight_version", "/weights_checker", "/abort_request",
    "/pause_generation", "/continue_generation",
})  # fmt: skip


def auth_status(path: str, authorization: str | None, api_key: str | None, admin_api_key: str | None) -> int | None:
    """sglang's ``--api-key``/``--admin-api-key`` check (``srt/utils/auth.py`` ``decide_request_auth``):
    401 when the request lacks the ``Bearer`` key its route needs, else None. ``/health*`` is always
    open; admin-optional routes need the admin key if the server has one, else the api key; every
    other route needs the api key if the server has one."""
    if path.startswith(("/health", "/ready", "/metrics")):
        return None
    if path in ADMIN_OPTIONAL_ROUTES:
        needed = admin_api_key or api_key
    else:
        needed = api_key
    if not needed:
        return None
    scheme, _, token = (authorization or "").partition(" ")
    return None if scheme.lower() == "bearer" and hmac.compare_digest(token, needed) else 401


class BadRequest(ValueError):
    """A body FastAPI would not parse: 400 with sglang's ``ErrorResponse`` body."""


class ContractError(ValueError):
    """A ``sampling_params`` schema violation: 400 ``{"error": "<text>"}``."""


class Refused(ValueError):
    """What sglang's tokenizer manager raises ValueError for: 400 ``{"error": {"message"}}``."""


@dataclass(frozen=True)
class Sampling:
    """One prompt's sampling: our :class:`SamplingParams` plus sglang's view of it."""

    params: SamplingParams  # temperature 0 = greedy; top_k -1 = off; seed = sampling_seed (may be ignored)
    max_new_tokens: int | None  # as sent (None: the default, capped at the context)


@dataclass(frozen=True)
class Logprobs:
    """``return_logprob``'s settings (io_struct.py ``GenerateReqInput``, one value or one per prompt)."""

    start: list[int]  # logprob_start_len per prompt; -1 (the default): from the end of the prompt (none)
    top_k: int  # top_logprobs_num: the best ``[logprob, id, text]`` per position (0: none)


@dataclass(frozen=True)
class GenerateRequest:
    """A parsed ``/generate`` body: one prompt per item, as text or ids, with its sampling and rid."""

    batched: bool
    texts: list[str] | None
    input_ids: list[list[int]] | None
    sampling: list[Sampling]
    rids: list[str]
    logprobs: Logprobs | None = None  # None: return_logprob false


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
    logprobs = _parse_logprobs(body, n, sampling)
    return GenerateRequest(batched, texts, input_ids, sampling, _parse_rids(body.get("rid"), batched, n), logprobs)


def _parse_logprobs(body: dict[str, Any], n: int, sampling: list[Sampling]) -> Logprobs | None:
    """``return_logprob``, ``logprob_start_len`` (-1 default) and ``top_logprobs_num`` (0 default), each
    one value or one per prompt (io_struct.py ``normalize_param``). The stand-in scores prompts only:
    with ``return_logprob`` every prompt must be prefill-only (``max_new_tokens`` 0)."""
    flag, start, top = body.get("return_logprob"), body.get("logprob_start_len", -1), body.get("top_logprobs_num", 0)
    if flag is not None and not isinstance(flag, bool):
        raise BadRequest("'return_logprob' must be a boolean (the stand-in takes no per-prompt list)")
    starts = start if isinstance(start, list) else [start] * n
    if len(starts) != n or not all(_is_int(s) and s >= -1 for s in starts):
        raise BadRequest(f"'logprob_start_len' must be an int >= -1 or a list of {n} of them")
    if not _is_int(top) or top < 0:
        raise BadRequest("'top_logprobs_num' must be an int >= 0 (the stand-in takes no per-prompt list)")
    if not flag:
        return None
    if any(s.params.max_new_tokens != 0 for s in sampling):
        raise Refused("ckpteval serve implements return_logprob for prefill-only requests (max_new_tokens 0) only "
                      "(sglang also returns output logprobs)")
    return Logprobs(starts, top)


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
