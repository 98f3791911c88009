"""The three tiers of the contamination gate over one index of eval rows (docs/USER_GUIDE.md "Contamination gate").

``exact``: the normalized text (:func:`~ckpteval.jobs.eval.contamination.text.tokens`) equal; ``ngram``: a shared
word n-gram (13, as lm-evaluation-harness's janitor; an eval row shorter than that must appear whole, from
``min_span`` words up); ``near``: word-shingle Jaccard similarity at least ``jaccard``, candidates from
MinHash LSH (rensa, Rust) and every candidate verified on the exact shingle sets, so a report is never a
sketch's false positive. Limits: eval rows shorter than ``min_span`` words are checked by the exact tier only.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ckpteval.jobs.eval.contamination.text import tokens

TIERS = ("exact", "ngram", "near")


@dataclass(frozen=True)
class Settings:
    """What the gate matches with (recorded in the matches file; a change re-runs the check)."""

    ngram: int = 13
    """Words per n-gram (lm-evaluation-harness's decontamination: 13)."""
    min_span: int = 8
    """An eval row shorter than ``ngram`` words matches when it appears whole in a training row, from this many words."""
    shingle: int = 1
    """Words per shingle of the near-duplicate tier (1: word sets, which survive reordering and rewording)."""
    jaccard: float = 0.6
    """Near-duplicate threshold: the exact Jaccard similarity of the two rows' shingle sets."""
    num_perm: int = 128
    """MinHash permutations (the LSH's candidates only: every report is verified exactly)."""
    bands: int = 32
    """LSH bands (``num_perm / bands`` rows each: 4 finds a pair at Jaccard 0.6 with probability 0.99)."""
    seed: int = 1
    """The MinHash seed."""

    def __post_init__(self) -> None:
        if self.ngram < 2 or not 2 <= self.min_span <= self.ngram:
            raise ValueError(f"contamination: ngram must be >= 2 and min_span in 2..ngram, got {self.ngram}, "
                             f"{self.min_span}")
        if not 0 < self.jaccard <= 1:
            raise ValueError(f"contamination: jaccard must be in (0, 1], got {self.jaccard}")
        if self.shingle < 1 or self.num_perm < 1 or self.bands < 1 or self.num_perm % self.bands:
            raise ValueError(f"contamination: shingle >= 1 and bands dividing num_perm, got {self.shingle}, "
                             f"{self.bands}, {self.num_perm}")


@dataclass(frozen=True)
class Hit:
    """One eval row found in one training row."""

    eval_id: int  # the index's own row number (EvalIndex.add's order)
    tier: str  # exact | ngram | near
    train: int  # the training row's number in the batch scanned
    similarity: float  # near: the Jaccard similarity; exact and ngram: 1.0
    evidence: str = ""  # ngram: the shared n-gram


def shingles(words: Sequence[bytes], k: int) -> set[bytes]:
    """The set of ``k``-word shingles of ``words`` (``k`` = 1: the words)."""
    if k == 1:
        return set(words)
    return {b" ".join(g) for g in zip(*(words[i:] for i in range(k)), strict=False)}


def grams(words: Sequence[bytes], n: int) -> Iterable[tuple[bytes, ...]]:
    """The word ``n``-grams of ``words``, as tuples (hashed in C: no joined strings)."""
    return zip(*(words[i:] for i in range(n)), strict=False)


class EvalIndex:
    """Every eval row's exact key, n-grams and MinHash; :meth:`scan` checks a batch of training rows."""

    def __init__(self, settings: Settings | None = None) -> None:
        import rensa

        self.settings = s = settings or Settings()
        self._rensa = rensa
        self.exact: dict[bytes, list[int]] = defaultdict(list)
        self.spans: dict[int, dict[tuple[bytes, ...], list[int]]] = defaultdict(lambda: defaultdict(list))
        self.sets: list[set[bytes]] = []
        self.lsh = rensa.RMinHashLSH(threshold=s.jaccard, num_perm=s.num_perm, num_bands=s.bands)
        self.size = 0
        self.set_sizes = (0, 0)  # the smallest and largest shingle set of an eval row in the LSH

    def add(self, text: str) -> int:
        """Index one eval row; its id (0, 1, ...)."""
        s, words, eval_id = self.settings, tokens(text), self.size
        self.size += 1
        self.exact[b" ".join(words)].append(eval_id)
        span = s.ngram if len(words) >= s.ngram else len(words)
        if span >= s.min_span:
            for g in set(grams(words, span)):
                self.spans[span][g].append(eval_id)
        self.sets.append(shingles(words, s.shingle))
        if len(words) >= s.min_span:
            m = self._rensa.RMinHash(num_perm=s.num_perm, seed=s.seed)
            m.update(self.sets[-1])
            self.lsh.insert(eval_id, m)
            n, (lo, hi) = len(self.sets[-1]), self.set_sizes
            self.set_sizes = (min(lo, n) if hi else n, max(hi, n))
        return eval_id

    def scan(self, texts: Sequence[str], tiers: Sequence[str] = TIERS) -> list[Hit]:
        """Every hit of the eval rows in ``texts`` (a batch of training rows) by the tiers asked; an eval row
        found by a stricter tier in a training row is not reported again by a looser one for that row."""
        hits: list[Hit] = []
        batch = [tokens(t) for t in texts]
        for i, words in enumerate(batch):
            if "exact" in tiers and (found := self.exact.get(b" ".join(words))):
                hits += [Hit(e, "exact", i, 1.0) for e in found]
            if "ngram" in tiers:
                hits += self._ngram_hits(i, words, {h.eval_id for h in hits if h.train == i})
        if "near" in tiers:
            hits += self._near_hits(batch, {(h.train, h.eval_id) for h in hits})
        return hits

    def _ngram_hits(self, i: int, words: list[bytes], seen: set[int]) -> list[Hit]:
        out: dict[int, Hit] = {}
        for span, table in self.spans.items():
            if len(words) < span or table.keys().isdisjoint(grams(words, span)):
                continue  # the common case, decided in C
            for g in grams(words, span):
                for e in table.get(g, ()):
                    if e not in seen and e not in out:
                        out[e] = Hit(e, "ngram", i, 1.0, b" ".join(g).decode("utf-8", "replace"))
        return list(out.values())

    def _near_hits(self, batch: list[list[bytes]], seen: set[tuple[int, int]]) -> list[Hit]:
        """Jaccard needs ``t |B| <= |A| <= |B| / t``: a row whose set is outside the eval rows' sizes so
        widened is not sketched at all (long training prompts against short questions)."""
        s = self.settings
        lo, hi = self.set_sizes
        if not hi:
            return []
        least, most = s.jaccard * lo, hi / s.jaccard
        rows, sets = [], []
        for i, words in enumerate(batch):
            if len(words) >= max(s.min_span, least) and least <= len(mine := shingles(words, s.shingle)) <= most:
                rows.append(i)
                sets.append(mine)
        sketches = self._rensa.RMinHash.from_token_sets(sets, s.num_perm, s.seed)
        hits = []
        for i, mine, sketch in zip(rows, sets, sketches, strict=True):
            for e in self.lsh.query(sketch):
                theirs = self.sets[e]
                shared = len(mine & theirs)
                similarity = shared / (len(mine) + len(theirs) - shared)
                if similarity >= s.jaccard and (i, e) not in seen:
                    hits.append(Hit(e, "near", i, similarity))
        return hits
