"""The engine's noise floor and the minimum detectable effect (MDE): what a decision can and cannot see.

Owns the model ``y[s,i,r] = mu[s] + a[s,i] + g[s,r] + e[s,i,r]``, the estimates of the engine's per-prompt
(``s2e``) and per-evaluation (``tau2``) noise from replay pairs (:func:`engine_noise`), the MDE
(:func:`mde`, Student t with :func:`effective_df` ``min(n - 1, pairs)``: the conservative bound) and the
clustered bootstrap (:func:`bootstrap_interval`). Guarantee: scipy, deterministic; no MDE where it is undefined
(:func:`mde_undefined`). Limits: ``tau2`` clipped at 0 and the same at every step. See docs/USER_GUIDE.md
"Engine noise, replays and the minimum detectable effect".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckpteval.jobs.decide.stats import Interval, bounded_interval, score_bounds, t_quantile

DEFAULT_POWER = 0.8
BOOTSTRAP_REPS = 2000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class EngineNoise:
    """What replays measured of one dataset's metric (see the module docstring for the model)."""

    pairs: int  # replay pairs: (replayed step, copy) with both evaluations complete
    prompts: int  # prompts per evaluation
    prompt_var: float  # s2e_hat: the engine's per-prompt variance
    shared_var: float  # tau2_hat: the variance of a shift shared by every prompt of an evaluation
    changed: float  # mean fraction of prompts whose value moved between the two evaluations of a pair
    max_abs_diff: float  # the largest |mean replay difference| of a pair
    rms_diff: float  # root mean square of the pairs' mean replay differences

    @property
    def df_pairs(self) -> int:
        """The replay pairs the engine term's degrees of freedom count (:func:`effective_df`): 0 when every
        replay equalled its point prompt for prompt (a deterministic engine shows no shift to allow for)."""
        return self.pairs if self.changed > 0 else 0

    def to_json(self) -> dict[str, float | int]:
        return {"pairs": self.pairs, "prompts": self.prompts, "prompt_var": self.prompt_var,
                "shared_var": self.shared_var, "changed": self.changed, "max_abs_diff": self.max_abs_diff,
                "rms_diff": self.rms_diff}


def engine_noise(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> EngineNoise | None:
    """The estimates from replay pairs (each: the point's per-prompt values, a replay's); None without any.
    ValueError when a pair's two evaluations have different prompts."""
    diffs = []
    for own, again in pairs:
        own, again = np.asarray(own, dtype=float), np.asarray(again, dtype=float)
        if own.shape != again.shape or own.ndim != 1 or own.size < 2:
            raise ValueError(f"a replay pair needs the same >= 2 prompts: {own.shape} vs {again.shape}")
        diffs.append(again - own)
    if not diffs:
        return None
    n = min(d.size for d in diffs)
    means = np.array([d.mean() for d in diffs])
    within = float(np.mean([d.var(ddof=1) for d in diffs]))  # pooled (equal sizes): 2 s2e
    prompt_var = within / 2
    shared = max(0.0, float(np.mean(means**2)) / 2 - prompt_var / n)
    return EngineNoise(len(diffs), n, prompt_var, shared, float(np.mean([np.mean(d != 0) for d in diffs])),
                       float(np.max(np.abs(means))), float(math.sqrt(np.mean(means**2))))


def effective_df(n: int, pairs: int = 0) -> float:
    """The degrees of freedom of ``s2_d/n + 2 tau2_hat``: ``n - 1`` without replays; with ``pairs`` replay pairs
    ``min(n - 1, pairs)``, the worst case over the unknown share of the engine's part (module docstring,
    *Few replays*), never a Welch-Satterthwaite estimate from the same data."""
    own = float(max(n - 1, 1))
    return own if pairs < 1 else min(own, float(pairs))


def quantile(p: float, df: float) -> float:
    """Student-t quantile at ``df`` (scipy's, fractional df as is)."""
    return t_quantile(p, df)


def mde_undefined(diff_var: float, n: int, shared_var: float = 0.0) -> str | None:
    """Why no MDE can be given for this comparison (None: it can): one prompt has no spread to measure, and
    a zero spread with no measured engine variance (identical steps, every score 1.0) says nothing about how
    large a difference the next evaluation would show — an MDE of 0 would claim any difference is seen."""
    if n < 2:
        return f"{n} prompt{'s' if n != 1 else ''}: no spread to size an effect against (2 or more needed)"
    if diff_var <= 0.0 and shared_var <= 0.0:
        return ("every prompt's value is the same on both sides' differences (identical steps, or every score at "
                "its bound): the data show no spread to size an effect against")
    return None


def mde(diff_var: float, n: int, shared_var: float = 0.0, level: float = 0.95, power: float = DEFAULT_POWER,
        pairs: int = 0, bounded: bool = False) -> float:
    """``(t_{1-alpha/2} + t_{power}) * sqrt(diff_var / n + 2 shared_var)`` (module docstring; t at
    :func:`effective_df`, which is ``n - 1`` without replays), ``alpha = 1 - level``; ``diff_var`` is the
    per-prompt variance of the differences compared, ``pairs`` the replay pairs ``shared_var`` is from.

    ``bounded`` (scores in [0, 1]) is for a ``diff_var`` measured *without* the effect (from a pair of the same
    true score, or from replays): an effect ``delta`` made of prompts that moved adds up to ``delta (1 - delta)``
    to the per-prompt variance under the alternative, so the MDE is the fixed point
    ``delta = (t + t') sqrt((diff_var + delta (1 - delta)) / n + 2 shared_var)`` (found by iteration; without
    it the power at such an MDE falls short: 0.61 instead of 0.80 in tests/test_noise.py's simulation).
    ``compare`` and ``best`` do not use it: their ``diff_var`` is the compared pair's own, effect included.
    """
    if not 0 < level < 1 or not 0 < power < 1:
        raise ValueError(f"an MDE needs level and power in (0, 1), got level={level} power={power}")
    diff_var, shared_var = max(diff_var, 0.0), max(shared_var, 0.0)
    if (why := mde_undefined(diff_var, n, shared_var)) is not None:
        raise ValueError(f"no MDE: {why}")
    df = effective_df(n, pairs)
    delta, extra = 0.0, 0.0
    for _ in range(50 if bounded else 1):
        var = diff_var + extra
        new = (quantile(0.5 + level / 2, df) + quantile(power, df)) * math.sqrt(var / n + 2 * shared_var)
        if abs(new - delta) < 1e-9:
            break
        delta = new
        extra = min(delta, 1.0) * (1 - min(delta, 1.0))
    return delta


def noise_interval(d: np.ndarray, level: float, noise: EngineNoise, bounds: tuple[float, float] | None) -> Interval:
    """The paired t interval of ``mean(d)`` widened by the engine's shared variance:
    ``mean(d) ± t_{1-alpha/2, df} sqrt(s2_d/n + 2 tau2)``, ``df`` by :func:`effective_df` (clipped to ``bounds``)."""
    d = np.asarray(d, dtype=float)
    if d.size < 2:
        raise ValueError(f"an interval needs at least 2 prompts, got {d.size}")
    t = quantile(0.5 + level / 2, effective_df(d.size, noise.df_pairs))
    half = t * math.sqrt(float(d.var(ddof=1)) / d.size + 2 * noise.shared_var)
    return bounded_interval(float(d.mean()), t, half, int(d.size), level, bounds)


def bootstrap_interval(d: np.ndarray, level: float, reps: int = BOOTSTRAP_REPS, seed: int = BOOTSTRAP_SEED) -> Interval:
    """Percentile bootstrap interval of ``mean(d)``, prompts resampled (clustered over their samples)."""
    d = np.asarray(d, dtype=float)
    if d.size < 2:
        raise ValueError(f"a bootstrap interval needs at least 2 prompts, got {d.size}")
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(reps, d.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 0.5 + level / 2])
    return Interval(float(d.mean()), float(lo), float(hi), int(d.size), level)


@dataclass(frozen=True)
class MdeVerdict:
    """A paired difference against its MDE."""

    mde: float | None  # None: no MDE can be given (``undefined`` says why)
    below: bool  # |mean difference| < MDE: too small for this many prompts and this engine to tell
    engine_measured: bool  # replays measured the shared engine variance (else it was taken as 0)
    power: float
    undefined: str | None = None  # why there is no MDE (one prompt; no spread at all)

    def to_json(self) -> dict[str, float | bool | str | None]:
        return {"mde": self.mde, "below_mde": self.below, "engine_measured": self.engine_measured,
                "power": self.power, **({"mde_undefined": self.undefined} if self.undefined else {})}


def mde_text(value: float | None, why: str | None) -> str:
    """How every output shows an MDE: ``MDE 0.0123``, or ``MDE undefined (why)``."""
    return f"MDE {value:.4f}" if value is not None else f"MDE undefined ({why})"


def mde_verdict(d: np.ndarray, level: float, noise: EngineNoise | None, power: float = DEFAULT_POWER) -> MdeVerdict:
    """The MDE of the comparison whose per-prompt differences are ``d`` (their own variance: the effect's
    included) and whether ``mean(d)`` is under it."""
    d = np.asarray(d, dtype=float)
    shared, pairs = (noise.shared_var, noise.df_pairs) if noise is not None else (0.0, 0)
    var = float(d.var(ddof=1)) if d.size > 1 else 0.0
    if (why := mde_undefined(var, int(d.size), shared)) is not None:
        return MdeVerdict(None, False, noise is not None, power, why)
    value = mde(var, int(d.size), shared, level, power, pairs)
    return MdeVerdict(value, abs(float(d.mean())) < value, noise is not None, power)


@dataclass(frozen=True)
class PairView:
    """What the noise says of one paired comparison: its MDE, bootstrap interval and, with replays, its
    interval widened by the engine's shared variance (None without)."""

    verdict: MdeVerdict
    bootstrap: Interval
    engine_interval: Interval | None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.verdict.to_json(),
                               "bootstrap": {"low": self.bootstrap.low, "high": self.bootstrap.high}}
        if self.engine_interval is not None:
            out["engine_interval"] = {"low": self.engine_interval.low, "high": self.engine_interval.high}
        return out


def pair_view(a: np.ndarray, b: np.ndarray, level: float, noise: EngineNoise | None,
              power: float = DEFAULT_POWER) -> PairView:
    """:class:`PairView` of ``b - a`` (per prompt), at ``level`` (scores in [0, 1]: intervals clipped to [-1, 1])."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    d = b - a
    bounds = (-1.0, 1.0) if score_bounds(a, b) else None
    wide = noise_interval(d, level, noise, bounds) if noise is not None else None
    return PairView(mde_verdict(d, level, noise, power), bootstrap_interval(d, level), wide)
