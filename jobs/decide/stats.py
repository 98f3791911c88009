"""The statistics of decisions, in one place: paired intervals over prompts, and the best step.

Same prompts and the same per-sample seeds at every step make two steps' scores *paired*: the
per-prompt difference ``d_i = b_i - a_i`` removes the prompt-difficulty variance that dominates an
unpaired comparison. :func:`paired_interval` is the paired t interval ``mean(d) ± t_{1-α/2, n-1} ·
sd(d)/sqrt(n)`` over prompts (two-sided); a difference is *distinguishable from noise* when the
interval excludes 0. :func:`best_step` picks the step with the best mean and calls every other step
*not distinguishable from it* when the paired interval of its difference to the best, at the
Bonferroni-corrected level ``1 - α/(m-1)`` for ``m`` steps compared, contains 0 (so with probability
at least ``1 - α`` no step whose true mean equals the best's is wrongly excluded).

Guarantee: numpy and scipy's t distribution (exact quantiles); deterministic. Limits: the interval treats prompts
as drawn from a population (a t interval, accurate when the mean of per-prompt differences is near
normal — tens of prompts or more); the best step's own interval is not corrected for having been
selected as the best; ties in the mean go to the earlier step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import t as student_t

DEFAULT_LEVEL = 0.95


def t_quantile(p: float, df: float) -> float:
    """Student-t quantile at ``df`` degrees of freedom (scipy's, exact; ``df`` may be fractional: a
    Welch-Satterthwaite df is never rounded)."""
    if not 0.0 < p < 1.0 or not df > 0.0:
        raise ValueError(f"t quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    return float(student_t.ppf(p, df))


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
    t = t_quantile(0.5 + level / 2, x.size - 1)
    return bounded_interval(float(x.mean()), t, t * float(x.std(ddof=1)) / math.sqrt(x.size), int(x.size), level,
                            bounds)


def bounded_interval(mean: float, t: float, half: float, n: int, level: float,
                     bounds: tuple[float, float] | None) -> Interval:
    """``mean ± half`` (``half`` from the quantile ``t``), clipped to ``bounds``; with bounds a zero ``half`` is
    not certainty (:func:`mean_interval`)."""
    if bounds is None:
        return Interval(mean, mean - half, mean + half, n, level)
    lo, hi = bounds
    if half == 0.0:
        half = (hi - lo) * t * t / (n + t * t)
    return Interval(mean, max(lo, mean - half), min(hi, mean + half), n, level)


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
