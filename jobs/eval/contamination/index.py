"""The three tiers of the contamination gate over one index of eval rows (docs/USER_GUIDE.md "Contamination gate").

``exact``: the normalized text (:func:`~ckpteval.jobs.eval.contamination.text.tokens`) equal; ``ngram``: a shared
word n-gram (13, as lm-evaluation-harness's janitor; an eval row shorter than that must appear whole, from
``min_span`` words up); ``near``: word-shingle Jaccard similarity at least ``jaccard``, candidates from
MinHash LSH (rensa, Rust) and every candidate verified on the exact shingle sets, so a report is never a
sketch's false positive. An eval set's template (n-grams and words in half its rows: :func:`boilerplate`)
never matches by itself. Limits: eval rows shorter than ``min_span`` words are checked by the exact tier only.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
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
    boilerplate: float = 0.5
    """An n-gram or word in at least this share of one eval set's rows (and 3 of them) is its template, not
    its content: no n-gram match on it, left out of the near-duplicate sets (a catalog set's prompt template,
    shared with a trainer's own prompts, would otherwise match every row)."""

    def __post_init__(self) -> None:
        if self.ngram < 2 or not 2 <= self.min_span <= self.ngram:
            raise ValueError(f"contamination: ngram must be >= 2 and min_span in 2..ngram, got {self.ngram}, "
                             f"{self.min_span}")
        if not 0 < self.jaccard <= 1 or not 0 < self.boilerplate <= 1:
            raise ValueError(f"contamination: jaccard and boilerplate must be in (0, 1], got {self.jaccard}, "
                             f"{self.boilerplate}")
        if self.shingle < 1 or self.num_perm < 1 or self.bands < 1 or self.num_perm % self.bands:
            raise ValueError(f"contamination: shingle >= 1 and bands dividing num_perm, got {self.shingle}, "
                             f"{self.bands}, {self.num_perm}")


@dataclass(frozen=True)
class Hit:
    """One eval row found in one training row."""

    eval_id: int  # the eval row's position in the texts the index was built from
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


def boilerplate(rows: Sequence[list[bytes]], groups: Sequence[str], s: Settings) -> tuple[set[tuple[bytes, ...]], set[bytes]]:
    """The n-grams and shingles in at least ``s.boilerplate`` of one group's rows (and 3 of them)."""
    by_group: dict[str, list[list[bytes]]] = defaultdict(list)
    for words, group in zip(rows, groups, strict=True):
        by_group[group].append(words)
    common_grams: set[tuple[bytes, ...]] = set()
    common_words: set[bytes] = set()
    for members in by_group.values():
        least = max(3.0, s.boilerplate * len(members))
        grams_df = Counter(g for words in members for g in set(grams(words, s.ngram)))
        words_df = Counter(w for words in members for w in shingles(words, s.shingle))
        common_grams |= {g for g, n in grams_df.items() if n >= least}
        common_words |= {w for w, n in words_df.items() if n >= least}
    return common_grams, common_words


def content_grams(words: list[bytes], n: int, common: set[tuple[bytes, ...]]) -> Iterator[tuple[bytes, ...]]:
    """The ``n``-grams of ``words`` of which at most half are template words (words under a ``common``
    n-gram): one that straddles the template's edge would match any training row under the same template
    whose question starts with the same word."""
    all_grams = list(grams(words, n))
    if not common:
        yield from all_grams
        return
    template = [0] * (len(words) + 1)
    for start, g in enumerate(all_grams):
        if g in common:
            template[start] += 1
            template[start + n] -= 1
    covered = list(itertools.accumulate(int(c > 0) for c in itertools.accumulate(template[:-1])))
    for start, g in enumerate(all_grams):
        inside = covered[start + n - 1] - (covered[start - 1] if start else 0)
        if inside <= n // 2:
            yield g


class EvalIndex:
    """Every eval row's exact key, n-grams and MinHash; :meth:`scan` checks a batch of training rows.
    ``groups``: each row's eval set (its template is found per set: :func:`boilerplate`)."""

    def __init__(self, texts: Sequence[str], settings: Settings | None = None,
                 groups: Sequence[str] | None = None) -> None:
        import rensa

        self.settings = s = settings or Settings()
        self._rensa = rensa
        self.exact: dict[bytes, list[int]] = defaultdict(list)
        self.spans: dict[int, dict[tuple[bytes, ...], list[int]]] = defaultdict(lambda: defaultdict(list))
        self.sets: list[set[bytes]] = []
        self.lsh = rensa.RMinHashLSH(threshold=s.jaccard, num_perm=s.num_perm, num_bands=s.bands)
        self.set_sizes = (0, 0)  # the smallest and largest shingle set of an eval row in the LSH
        rows = [tokens(t) for t in texts]
        self.common_grams, self.common_words = boilerplate(rows, groups or [""] * len(rows), s)
        for eval_id, words in enumerate(rows):
            self._add(eval_id, words)

    def _add(self, eval_id: int, words: list[bytes]) -> None:
        s = self.settings
        self.exact[b" ".join(words)].append(eval_id)
        span = s.ngram if len(words) >= s.ngram else len(words)
        if span >= s.min_span:
            for g in set(content_grams(words, span, self.common_grams)):
                self.spans[span][g].append(eval_id)
        self.sets.append(shingles(words, s.shingle) - self.common_words)
        if len(words) >= s.min_span and self.sets[-1]:
            m = self._rensa.RMinHash(num_perm=s.num_perm, seed=s.seed)
            m.update(self.sets[-1])
            self.lsh.insert(eval_id, m)
            n, (lo, hi) = len(self.sets[-1]), self.set_sizes
            self.set_sizes = (min(lo, n) if hi else n, max(hi, n))

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
            if len(words) < s.min_span:
                continue
            mine = shingles(words, s.shingle) - self.common_words if self.common_words else shingles(words, s.shingle)
            if least <= len(mine) <= most and mine:
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
