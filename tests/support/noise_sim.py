"""Scripted engines over synthetic per-prompt scores: the proof-by-simulation of the noise floor (#29).

An engine here maps a snapshot's *true* per-prompt correctness to what one evaluation reports:

- :func:`deterministic` reports the truth every time (a batch-invariant engine, greedy or seeded);
- :func:`noisy` flips each answer at random with probability ``flip`` per evaluation (the engine's
  per-prompt noise: a generation that comes out differently), and, with ``drift`` > 0, shifts the whole
  evaluation: it draws ``g ~ N(0, drift)`` per evaluation and flips each wrong answer to right with
  probability ``max(g, 0)`` and each right one to wrong with probability ``max(-g, 0)`` (a shift shared by
  every prompt of one evaluation: batch composition, kernels).

Pure numpy, seeded: the statistics of :mod:`ckpteval.jobs.decide.noise` are checked against engines whose
noise is known, over many seeds, in well under a second per thousand replicates.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ckpteval.jobs.decide.noise import EngineNoise, effective_df, engine_noise, mde, quantile

Engine = Callable[[np.ndarray, np.random.Generator], np.ndarray]  # true correctness -> one evaluation

def deterministic(truth: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One evaluation on a deterministic engine: the truth, whatever the seed."""
    return np.asarray(truth, dtype=float).copy()


def noisy(truth: np.ndarray, rng: np.random.Generator, flip: float, drift: float = 0.0) -> np.ndarray:
    """One evaluation on the noisy engine (module docstring)."""
    y = np.asarray(truth, dtype=bool).copy()
    y ^= rng.random(y.size) < flip
    if drift > 0:
        g = rng.normal(0.0, drift)
        move = rng.random(y.size) < abs(g)
        y = np.where(move, g > 0, y)  # g > 0: moved answers become right; g < 0: wrong
    return y.astype(float)


def population(rng: np.random.Generator, n: int, p: float) -> np.ndarray:
    """A snapshot's true per-prompt correctness: n prompts, each right with probability p."""
    return (rng.random(n) < p).astype(float)


def churned(truth: np.ndarray, rng: np.random.Generator, churn: float, p: float, gained: float = 0.0) -> np.ndarray:
    """Another step's true correctness, prompts drawn from the same population (rate ``p``): each right prompt
    turns wrong with probability ``churn``, each wrong one turns right with probability ``churn p / (1 - p)``
    (the same expected score: a step that learned some prompts and forgot as many) plus ``gained / (1 - p)``
    (its expected score higher by ``gained``)."""
    u = rng.random(truth.size)
    up = churn * p / (1 - p) + gained / (1 - p)
    return np.where(truth == 1, (u >= churn).astype(float), (u < up).astype(float))


def measure(rng: np.random.Generator, engine: Engine, n: int, replays: int, churn: float = 0.1,
            gain: float = 1.0, level: float = 0.95, power: float = 0.8) -> tuple[bool, bool, bool, float]:
    """One replicate: ``replays`` pairs of evaluations of a snapshot measure the engine; then step A is compared
    with a step B of the *same true score* (:func:`churned`). Returns (the engine-aware band
    ``t sqrt(s2_d/n + 2 tau2)`` covers their reported difference, the t-only band does, a step B' truly better
    by the measured MDE is detected, that MDE). ``gain``: what one prompt turned right adds to the expected
    reported score on this engine."""
    p = 0.6
    truth = population(rng, n, p)
    noise: EngineNoise | None = engine_noise([(engine(truth, rng), engine(truth, rng)) for _ in range(replays)])
    shared, k = (noise.shared_var, noise.df_pairs) if noise is not None else (0.0, 0)
    other = churned(truth, rng, churn, p)
    d = engine(other, rng) - engine(truth, rng)
    var = float(d.var(ddof=1))
    within = abs(d.mean()) <= quantile(0.5 + level / 2, effective_df(n, k)) * np.sqrt(var / n + 2 * shared)
    within_t = abs(d.mean()) <= quantile(0.5 + level / 2, n - 1) * np.sqrt(var / n)
    effect = mde(var, n, shared, level, power, k, bounded=True)
    better = churned(truth, rng, churn, p, gained=min(effect / gain, (1 - p) * (1 - churn)))
    d_eff = engine(better, rng) - engine(truth, rng)
    v_eff = float(d_eff.var(ddof=1))
    detected = d_eff.mean() > quantile(0.5 + level / 2, effective_df(n, k)) * np.sqrt(v_eff / n + 2 * shared)
    return bool(within), bool(within_t), bool(detected), effect


def gain_of(flip: float, drift: float) -> float:
    """What one prompt turned right adds to the noisy engine's expected reported score: (1 - 2 flip)(1 - E|g|),
    E|g| = drift sqrt(2/pi)."""
    return (1 - 2 * flip) * (1 - drift * float(np.sqrt(2 / np.pi)))


def coverage(seed: int, reps: int, n: int, flip: float, drift: float, replays: int) -> dict[str, float]:
    """Over ``reps`` replicates (:func:`measure`) on the noisy engine (``flip`` 0 and ``drift`` 0: the
    deterministic one): the rate each band covers a same-true-score difference, the detection rate of an
    effect of the MDE, the mean MDE."""
    rng = np.random.default_rng(seed)

    def engine(truth: np.ndarray, r: np.random.Generator) -> np.ndarray:
        return noisy(truth, r, flip, drift) if flip or drift else deterministic(truth, r)

    runs = [measure(rng, engine, n, replays, gain=gain_of(flip, drift)) for _ in range(reps)]
    return {"covered": float(np.mean([r[0] for r in runs])), "covered_t_only": float(np.mean([r[1] for r in runs])),
            "power": float(np.mean([r[2] for r in runs])), "mde": float(np.mean([r[3] for r in runs]))}
