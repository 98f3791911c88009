"""``POST /v1/completions`` of ``ckpteval serve``: OpenAI's text-completion API over the engine service.

Owns the translation both ways: an OpenAI ``completions`` body becomes the same ``/generate`` request
sglang's native route takes (so one set of checks, :mod:`ckpteval.jobs.reference.serve.requests`), and the
service's items become OpenAI's ``text_completion`` object. What lm-eval's ``local-completions`` model
sends for generation works; what the stand-in cannot honour (log-likelihoods, ``n > 1``, streaming) is a
400, never a silently different answer.
"""

from __future__ import annotations

import time
from http import HTTPStatus
from typing import Any

from ckpteval.jobs.eval.engines.base import EngineError
from ckpteval.jobs.reference.serve.engine import EngineService, Overloaded
from ckpteval.jobs.reference.serve.requests import BadRequest, parse_generate

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
    (400); the reply is OpenAI's ``text_completion`` object, one choice per prompt, with ``index``, and
    sglang's ``metadata`` (``weight_version`` and ``weight_versions`` spans of the first item: sglang 0.5.23
    ``serving_completions.py`` ``build_endpoint_weight_version_metadata(ret[0]["meta_info"])``), read back by
    :func:`ckpteval.jobs.eval.kinds.env.endpoint.reply_version`."""
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
    except Overloaded as e:  # serving_base.py renders the abort's 503 as an ErrorResponse
        return HTTPStatus.SERVICE_UNAVAILABLE, {"object": "error", "message": str(e), "type": "503", "param": None,
                                                "code": 503}
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
        "metadata": {k: items[0]["meta_info"][k] for k in ("weight_version", "weight_versions") if k in items[0]["meta_info"]},
    }
