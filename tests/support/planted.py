"""Training and eval prompts with known overlaps, for the contamination gate's tests and bench.

Text: English words drawn by their frequency in Python's own documentation (``pydoc_data.topics``, in the
standard library: nothing downloaded), so rows share function words as real prompts do but never a long
span. Planted: an eval row copied (case and punctuation changed: the exact tier), a 15-word span of one
inside another text (the n-gram tier), and one paraphrased: every fifth word replaced and two pairs of
words swapped (the near-duplicate tier: no 13-gram is left).
"""

from __future__ import annotations

import functools
import itertools
import random
import re
from collections import Counter


@functools.cache
def vocabulary() -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The 6,000 commonest words and their cumulative counts (``random.choices``' ``cum_weights``)."""
    import pydoc_data.topics

    words = Counter(w for text in pydoc_data.topics.topics.values() for w in re.findall(r"[a-z]{2,}", text.lower()))
    common = words.most_common(6000)
    return tuple(w for w, _ in common), tuple(itertools.accumulate(c for _, c in common))


def prompts(n: int, seed: int, low: int = 25, high: int = 60) -> list[str]:
    """``n`` prompts of ``low``..``high`` words, each ending in a question."""
    rng = random.Random(seed)
    words, cumulative = vocabulary()
    out = []
    for _ in range(n):
        body = rng.choices(words, cum_weights=cumulative, k=rng.randint(low, high))
        out.append(f"{' '.join(body).capitalize()}. What is {rng.randint(2, 999)} times {rng.choice(words)}?")
    return out


def exact_copy(text: str) -> str:
    return text.upper().replace(".", " .").replace("?", "!")


def ngram_copy(text: str, filler: str, span: int = 15) -> str:
    words = text.split()
    return f"{filler} {' '.join(words[5:5 + span])} {filler}"


def paraphrase(text: str, seed: int) -> str:
    rng = random.Random(seed)
    words = text.split()
    for i in range(2, len(words), 5):  # every fifth word: no 13-gram survives
        words[i] = rng.choice(["quantity", "amount", "several", "given", "each", "compute"])
    for _ in range(2):
        i = rng.randrange(len(words) - 1)
        words[i], words[i + 1] = words[i + 1], words[i]
    return " ".join(words)
