"""Sampling for :class:`ckpteval.jobs.eval.engines.hf.engine.HFEngine`: settings checks, seeded RNG, per-row samplers.

Owns what decides *which* tokens a generation draws, apart from the model: :func:`validate_sampling`
and :func:`validate_seeds` (``ValueError`` for settings no engine can honour), :func:`seeded_rng` (a
call-wide ``seed`` fixes a forked RNG, leaving the caller's global RNG untouched), :class:`SeededSampler`
(per-prompt ``seeds``: each row draws its token from the temperature/top-k/top-p distribution with its
own ``torch.Generator``, so its sample depends on its prompt and seed only, not on its batch-mates, up
to the float noise of padding) and :func:`left_pad` (the batch layout the decoder expects); and which requests it takes at all:
:func:`check_ids` (token ids inside the vocabulary) and :func:`check_context` (a prompt that does not fit
the model's context is :class:`~ckpteval.jobs.eval.engines.base.RequestRejected`, sglang's rule).

Limits: reproducibility holds for the same torch build and device; the sampler returns ``-inf`` scores
everywhere but the drawn token, so it must run last, before a greedy decoder.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    PretrainedConfig,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ckpteval.jobs.eval.engines.base import RequestRejected, SamplingParams, context_problem


def validate_sampling(params: SamplingParams) -> None:
    """Raise ``ValueError`` for settings no engine can honour."""
    if not isinstance(params.max_new_tokens, int) or params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {params.max_new_tokens!r}")
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if not isinstance(params.top_k, int) or params.top_k < -1:
        raise ValueError(f"top_k must be an int >= -1 (-1 or 0: off), got {params.top_k!r}")
    if params.seed is not None and not isinstance(params.seed, int):
        raise ValueError(f"seed must be an int or None, got {params.seed!r}")


def validate_seeds(seeds: list[int] | None, n: int) -> None:
    """Raise ``ValueError`` unless ``seeds`` is None or one non-negative int per prompt."""
    if seeds is None:
        return
    if not isinstance(seeds, list) or len(seeds) != n:
        raise ValueError(f"seeds must be a list of one int per prompt ({n}), got {seeds!r}"[:300])
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds):
        raise ValueError("seeds must be non-negative ints")


class SeededSampler(LogitsProcessor):
    """Samples each row's next token with that row's own generator (see the module docstring).

    Returns scores that are ``-inf`` everywhere but the drawn token, so a greedy decoder emits it.
    """

    def __init__(self, seeds: Sequence[int], params: SamplingParams, device: torch.device) -> None:
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        warpers: list[LogitsProcessor] = [TemperatureLogitsWarper(params.temperature)]
        if params.top_k > 0:
            warpers.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1:
            warpers.append(TopPLogitsWarper(params.top_p))
        self.warpers = LogitsProcessorList(warpers)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        probs = torch.softmax(self.warpers(input_ids, scores.float()), dim=-1)
        picks = torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(self.generators)])
        out = torch.full_like(scores, -float("inf"))
        return out.scatter_(1, picks.unsqueeze(1), 0.0)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` with every row right-aligned (padding on the left)."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, width - len(row) :] = 1
    return input_ids, attention_mask


@contextlib.contextmanager
def seeded_rng(seed: int | None, device: torch.device) -> Iterator[None]:
    """Fix the RNG for the block when ``seed`` is set, restoring the caller's RNG state afterwards."""
    if seed is None:
        yield
        return
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def check_context(input_ids: list[list[int]], max_new_tokens: int, config: PretrainedConfig) -> None:
    """A prompt that does not fit the model's context is refused as ``ckpteval serve`` and sglang refuse it
    (:func:`~ckpteval.jobs.eval.engines.base.context_problem`), never truncated or run past the position table."""
    context = getattr(config, "max_position_embeddings", None)
    for row in input_ids:
        if (problem := context_problem(len(row), max_new_tokens, context)) is not None:
            raise RequestRejected(f"{problem} (the hf engine refused the request; no restart)")


def check_ids(input_ids: list[list[int]], vocab_size: int) -> None:
    """Token ids a request may carry: non-empty rows of ints inside the vocabulary (ValueError else)."""
    if not isinstance(input_ids, list):
        raise ValueError("input_ids must be a list of lists of int")
    for row in input_ids:
        if not isinstance(row, list) or not row:
            raise ValueError("every prompt needs at least one token id")
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in row):
            raise ValueError(f"token ids must be ints in [0, {vocab_size})")
