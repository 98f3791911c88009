"""The statistics of decisions, in one place: paired intervals over prompts, and the best step.

Same prompts and the same per-sample seeds at every step make two steps' scores *paired*: the
per-prompt difference ``d_i = b_i - a_i`` removes the prompt-difficulty variance that dominates an
unpaired comparison. :func:`paired_interval` is the paired t interval ``mean(d) ± t_{1-α/2, n-1} ·
sd(d)/sqrt(n)`` over prompts (two-sided); a difference is *distinguishable from noise* when the
interval excludes 0. :func:`best_step` picks the step with the best mean and calls every other step
*not distinguishable from it* when the paired interval of its difference to the best, at the
Bonferroni-corrected level ``1 - α/(m-1)`` for ``m`` steps compared, contains 0 (so with probability
at least ``1 - α`` no step whose true mean equals the best's is wrongly excluded).

Guarantee: numpy and the standard library only; deterministic. Limits: the interval treats prompts
as drawn from a population (a t interval, accurate when the mean of per-prompt differences is near
normal — tens of prompts or more); the best step's own interval is not corrected for having been
selected as the best; ties in the mean go to the earlier step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

DEFAULT_LEVEL = 0.95


def t_quantile(p: float, df: int) -> float:
    """Student-t quantile (Cornish-Fisher expansion around the normal one; < 1e-3 off for df >= 5)."""
    if not 0.0 < p < 1.0 or df < 1:
        raise ValueError(f"t quantile needs 0 < p < 1 and df >= 1, got p={p}, df={df}")
    z = NormalDist().inv_cdf(p)
    v = float(df)
    return (z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * v**3)
            + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * v**4))


@dataclass(frozen=True)
class Interval:
    """A mean (or a mean difference) over prompts with its two-sided interval."""

    estimate: float  # mean of the per-prompt values (differences)
    low: float
    high: float
    n: int  # prompts
    level: float  # confidence level of [low, high]

    @property
    def distinguishable(self) -> bool:
        """The interval excludes 0 (for a difference: not explained by sampling noise at this level)."""
        return self.low > 0.0 or self.high < 0.0

    def to_json(self) -> dict[str, float]:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "n": self.n, "level": self.level}


def mean_interval(values: np.ndarray, level: float = DEFAULT_LEVEL,
                  bounds: tuple[float, float] | None = None) -> Interval:
    """The t interval of the mean of ``values`` (one per prompt). With ``bounds`` (what a value can be:
    ``(0, 1)`` for scores, ``(-1, 1)`` for their differences) the interval is clipped to them, and a
    zero-spread sample is not certainty: its half-width is the Wilson score interval's for an extreme
    proportion, ``z²/(n+z²)`` of the range (``n`` identical prompts leave room for a prompt that
    differs). Without bounds a zero-spread sample has width 0."""
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or x.size < 2:
        raise ValueError(f"an interval needs at least 2 prompts, got {x.size}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    mean = float(x.mean())
    t = t_quantile(0.5 + level / 2, x.size - 1)
    half = t * float(x.std(ddof=1)) / math.sqrt(x.size)
    if bounds is None:
        return Interval(mean, mean - half, mean + half, int(x.size), level)
    lo, hi = bounds
    if half == 0.0:
        half = (hi - lo) * t * t / (x.size + t * t)
    return Interval(mean, max(lo, mean - half), min(hi, mean + half), int(x.size), level)


def score_bounds(*arrays: np.ndarray) -> tuple[float, float] | None:
    """``(0, 1)`` when every value is a score in [0, 1] (exact, pass@k, judged verdicts), else None (a
    reward model's unbounded scores)."""
    return (0.0, 1.0) if all(a.size and float(a.min()) >= 0.0 and float(a.max()) <= 1.0 for a in arrays) else None


def paired_interval(a: np.ndarray, b: np.ndarray, level: float = DEFAULT_LEVEL) -> Interval:
    """Interval of ``mean(b - a)`` from per-prompt pairs (``a[i]``, ``b[i]`` are the same prompt); for
    scores in [0, 1] clipped to [-1, 1] (see :func:`mean_interval`)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired values need the same prompts: {a.shape} vs {b.shape}")
    return mean_interval(b - a, level, (-1.0, 1.0) if score_bounds(a, b) else None)


@dataclass(frozen=True)
class Best:
    """The best step, its interval, and every step not distinguishable from it."""

    step: int
    interval: Interval  # of the best step's own mean (not corrected for selection)
    tied: tuple[int, ...]  # steps whose difference to the best is not distinguishable (best included)
    differences: dict[int, Interval]  # step -> interval of (step - best) at the corrected level
    correction: str  # how the family of m-1 comparisons was corrected


def best_step(values: dict[int, np.ndarray], *, higher_is_better: bool = True,
              level: float = DEFAULT_LEVEL) -> Best:
    """The best of ``values`` (step -> per-prompt values, same prompts in the same order at every step)."""
    if not values:
        raise ValueError("no step has values to choose from")
    steps = sorted(values)
    sign = 1.0 if higher_is_better else -1.0
    best = max(steps, key=lambda s: (sign * float(np.mean(values[s])), -s))
    others = [s for s in steps if s != best]
    family = level if not others else 1.0 - (1.0 - level) / len(others)  # Bonferroni over m-1 comparisons
    diffs = {s: paired_interval(values[best], values[s], family) for s in others}
    tied = tuple(sorted([best, *(s for s, d in diffs.items() if not d.distinguishable)]))
    own = np.asarray(values[best], dtype=float)
    return Best(best, mean_interval(own, level, score_bounds(own)), tied, diffs,
                f"Bonferroni over {len(others)} paired comparisons (each at level {family:.4g})")
