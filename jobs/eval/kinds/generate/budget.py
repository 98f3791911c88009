"""Kept completions cut at a smaller token budget: what the samples would have been under a lower
``max_new_tokens`` (``ckpteval rescore --budget N``; docs/USER_GUIDE.md "Length-budget curves").

A sample whose engine count (``n_tokens``) is at most ``N`` is unchanged. A longer one is cut: its text ends
where the snapshot tokenizer's ``N+1``-th token of the text begins (character offsets, so nothing is decoded
again), its ``finish_reason`` becomes ``"length"`` and its ``n_tokens`` ``N``. The scoring path then applies
the set's reasoning strip to the cut text as to any completion: a trace cut before its end delimiter has no
answer. Limits: the engine's count decides whether a sample is cut, the re-encoded text where; re-encoding
decoded text can differ from the sampled ids by a token or two.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ckpteval.coord.results.completions import Completions


def cut_text(text: str, budget: int, tokenizer: Any) -> str:
    """``text`` up to the start of its ``budget + 1``-th token (``text`` whole when it has no more)."""
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return text if len(offsets) <= budget else text[: offsets[budget][0]]


def cut_at_budget(kept: Completions, budget: int, tokenizer: Any) -> Completions:
    """``kept`` as if generated with ``max_new_tokens = budget`` (module docstring)."""
    if budget < 1:
        raise ValueError(f"a token budget must be at least 1, got {budget}")
    text, finish, n_tokens = list(kept.text), list(kept.finish_reason), list(kept.n_tokens)
    for i, n in enumerate(kept.n_tokens):
        if n > budget:
            text[i], finish[i], n_tokens[i] = cut_text(text[i], budget, tokenizer), "length", budget
    return dataclasses.replace(kept, text=tuple(text), finish_reason=tuple(finish), n_tokens=tuple(n_tokens))


def parse_budgets(text: str) -> list[int]:
    """``--budget N[,N...]``: positive token counts, ascending and distinct; ValueError naming the flag."""
    try:
        budgets = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise ValueError(f"--budget {text!r}: expected token counts, e.g. 256 or 128,256,512") from None
    if not budgets or budgets[0] < 1:
        raise ValueError(f"--budget {text!r}: a budget must be at least 1 token")
    return budgets
