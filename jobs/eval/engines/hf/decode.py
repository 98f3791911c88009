"""Decoding for :class:`ckpteval.jobs.eval.engines.hf.engine.HFEngine`: what transformers' ``generate`` is told, and what its output means.

Owns the decoder's settings for one :class:`~ckpteval.jobs.eval.engines.base.SamplingParams`
(:func:`generation_config`: greedy when ``temperature == 0``, else sampled with ``top_p``/``top_k``, a
``top_k`` of 0 meaning off; KV cache on), the stop and pad ids (:func:`eos_ids`: the model config's eos
ids and the tokenizer's; :func:`pad_id`: the tokenizer's pad, else the smallest eos) and the reading of
one row's new tokens as a :class:`Completion` (:func:`completion`): cut after the first eos, which
``output_ids`` keeps and the text drops; finish reason ``stop`` (with the matched id) or ``length``.

Limits: stop strings are not supported (only eos ids stop a row); the text is decoded with
``skip_special_tokens``, so special tokens inside a completion do not appear in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig, PretrainedConfig

from ckpteval.jobs.eval.engines.base import Generation, SamplingParams


@dataclass(frozen=True)
class Completion:
    """One completion with what a server reports about it (sglang's ``meta_info`` fields)."""

    text: str
    output_ids: list[int]  # generated ids, including the eos that stopped it, if any
    finish_reason: dict[str, Any]  # {"type": "stop", "matched": id} | {"type": "length", "length": n}
    prompt_tokens: int
    weight_version: str | None

    def generation(self) -> Generation:
        return Generation(text=self.text, weight_version=self.weight_version, n_tokens=len(self.output_ids),
                          prompt_tokens=self.prompt_tokens, finish_reason=self.finish_reason["type"])


def eos_ids(config: PretrainedConfig, tokenizer: Any) -> set[int]:
    """The ids that end a row: the model config's ``eos_token_id`` (one or a list) and the tokenizer's."""
    ids = config.eos_token_id
    found = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        found.add(tokenizer.eos_token_id)
    return found


def pad_id(config: PretrainedConfig, tokenizer: Any) -> int:
    """The tokenizer's pad id, else the smallest eos id (0 when there is none)."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return min(eos_ids(config, tokenizer), default=0)


def generation_config(params: SamplingParams, config: PretrainedConfig, tokenizer: Any) -> GenerationConfig:
    """transformers' settings for ``params``: greedy at temperature 0, else sampled."""
    common = dict(
        max_new_tokens=params.max_new_tokens,
        pad_token_id=pad_id(config, tokenizer),
        eos_token_id=sorted(eos_ids(config, tokenizer)),
        use_cache=True,
    )
    if params.temperature == 0:
        return GenerationConfig(do_sample=False, **common)
    return GenerationConfig(
        do_sample=True,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else 0,  # 0 disables transformers' top-k filter
        **common,
    )


def completion(tokenizer: Any, prompt: list[int], new: list[int], eos: set[int], version: str | None) -> Completion:
    """One row's ``new`` tokens as a :class:`Completion` of ``prompt`` (see the module docstring)."""
    stop = next((i for i, t in enumerate(new) if t in eos), None)
    if stop is None:
        output_ids, finish = new, {"type": "length", "length": len(new)}
    else:
        output_ids, finish = new[: stop + 1], {"type": "stop", "matched": new[stop]}
    text_ids = output_ids if stop is None else output_ids[:-1]
    return Completion(
        text=tokenizer.decode(text_ids, skip_special_tokens=True),
        output_ids=output_ids,
        finish_reason=finish,
        prompt_tokens=len(prompt),
        weight_version=version,
    )
