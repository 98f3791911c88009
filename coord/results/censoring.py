"""Censoring-aware numbers of a point: the lower bound, the score on completed answers, the censored share
(docs/USER_GUIDE.md "Cut-off answers (censoring)"; the metric names: docs/PROTOCOL.md §7).

A sample is *censored* when the engine stopped it at the length limit (the result's per-sample ``truncated``).
Per prompt ``i`` with ``n`` samples, ``c_i`` of them cut off, and ``y_i`` the summed score of its completed
ones: the lower bound is the mean over prompts of ``sum(score * (1 - cut)) / n`` (cut-off counted wrong), the
censored share the mean of ``c_i / n``, and the completed-only score the ratio ``sum(y) / sum(n - c)``, whose
per-prompt linearised values (:func:`completed_values`) carry its standard error over prompts (a ratio estimator,
clustered by prompt) and pair across steps like any per-prompt value. Standard errors are over prompts, as the
point's own ``stderr``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PerPrompt:
    """One dataset's censoring at one step, per prompt (prompts in dataset order)."""

    lower: list[float]  # mean score with cut-off samples counted 0
    censored: list[float]  # share of samples cut off
    done_sum: list[float]  # summed score of the completed samples
    done_n: list[int]  # completed samples

    @property
    def completed(self) -> float:
        """The score on completed answers (nan when every sample was cut off)."""
        total = sum(self.done_n)
        return sum(self.done_sum) / total if total else math.nan


def per_prompt(scores: Sequence[float], truncated: Sequence[float | None] | None, n: int) -> PerPrompt | None:
    """The censoring of prompt-major ``scores`` with their ``truncated`` flags, ``n`` samples per prompt; None when
    some sample's engine did not say whether it was cut (or no flags were recorded)."""
    if not truncated or len(truncated) != len(scores) or any(c is None for c in truncated) or not scores:
        return None
    out = PerPrompt([], [], [], [])
    for i in range(0, len(scores), n):
        s, c = scores[i : i + n], truncated[i : i + n]
        kept = [x for x, cut in zip(s, c, strict=True) if not cut]
        out.lower.append(sum(kept) / len(s))
        out.censored.append(sum(1.0 for cut in c if cut) / len(s))
        out.done_sum.append(sum(kept))
        out.done_n.append(len(kept))
    return out


def completed_values(pp: PerPrompt) -> list[float]:
    """Per-prompt linearised values of the completed-only ratio ``R = sum(y) / sum(m)``: ``R + (y_i - R m_i) / mean(m)``.
    Their mean is ``R`` exactly, their spread over prompts its (delta-method) standard error, and two steps' values
    pair prompt by prompt. Empty when no answer completed."""
    m_bar = sum(pp.done_n) / len(pp.done_n)
    if m_bar == 0:
        return []
    r = pp.completed
    return [r + (y - r * m) / m_bar for y, m in zip(pp.done_sum, pp.done_n, strict=True)]


def stderr(values: Sequence[float]) -> float:
    """The standard error of the mean of per-prompt ``values`` (nan for fewer than two)."""
    if len(values) < 2:
        return math.nan
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def summary(pp: PerPrompt | None) -> dict[str, float]:
    """What a point records (``DatasetScore.censoring``): ``lower``, ``completed``, ``censored``, each with its
    ``<name>_stderr``, and ``prompts``, ``completed_n`` (completed samples); {} when censoring is unknown."""
    if pp is None:
        return {}
    done = completed_values(pp)
    return {"lower": sum(pp.lower) / len(pp.lower), "lower_stderr": stderr(pp.lower),
            "completed": pp.completed, "completed_stderr": stderr(done) if done else math.nan,
            "censored": sum(pp.censored) / len(pp.censored), "censored_stderr": stderr(pp.censored),
            "prompts": float(len(pp.lower)), "completed_n": float(sum(pp.done_n))}
