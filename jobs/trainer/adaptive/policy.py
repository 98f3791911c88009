"""Where adaptive evaluation spends: the settings (``--eval-adaptive``) and the pure decision of which steps
of one dataset are still open and how many more samples each gets (docs/USER_GUIDE.md "Adaptive evaluation").

A step is *open* when it is a candidate best step (its paired difference to the best is under that
difference's MDE, and the MDE is wider than the target), or when it is near a ``--eval-stop-when`` target
(within its own MDE of the threshold, the MDE wider than the target). Everything else is decided — far behind
the best, or equal to it within the target — and gets nothing. An open step's samples per prompt double, up to
the cap. Guarantee: a pure function of the points' per-prompt values (scipy's t quantiles).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import t as student_t

from ckpteval.coord.results.conditions import Condition

NUMBER = r"(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
PATTERN = re.compile(rf"^\s*eval/([^/\s]+)\s+mde\s+({NUMBER})(?:\s+max-samples\s+(\d+))?(?:\s+lag\s+(\d+))?"
                     rf"(?:\s+budget\s+({NUMBER})(s?))?\s*$")
LEVEL, POWER = 0.95, 0.8  # compare's MDE


@dataclass(frozen=True)
class AdaptiveSettings:
    """``--eval-adaptive 'eval/<ds> mde M [max-samples K] [budget F | budget Gs]'``."""

    dataset: str
    mde: float  # the MDE a decision needs: a step stays open while its comparison's MDE is wider
    max_samples: int | None = None  # samples per prompt at most (None: 8 x the dataset's n_samples)
    fraction: float | None = None  # budget: eval GPU-seconds at most this fraction of training's
    gpu_s_per_point: float | None = None  # budget: eval GPU-seconds at most this many per point on average
    lag: int = 3  # a candidate is granted only once this many newer points landed (or training ended)

    @property
    def text(self) -> str:
        budget = (f" budget {self.fraction:g}" if self.fraction is not None else
                  f" budget {self.gpu_s_per_point:g}s" if self.gpu_s_per_point is not None else "")
        cap = f" max-samples {self.max_samples}" if self.max_samples is not None else ""
        return f"eval/{self.dataset} mde {self.mde:g}{cap} lag {self.lag}{budget}"


def parse_adaptive(text: str, flag: str) -> AdaptiveSettings:
    """The settings, or one ValueError naming ``flag``."""
    m = PATTERN.match(text)
    if m is None:
        raise ValueError(f"{flag} {text!r}: expected 'eval/<dataset> mde M' (then optionally 'max-samples K', 'lag L' "
                         "and 'budget F' (a fraction of training's GPU-seconds) or 'budget Gs' (GPU-seconds per point))")
    mde, cap = float(m.group(2)), None if m.group(3) is None else int(m.group(3))
    if not 0 < mde < 1:
        raise ValueError(f"{flag} {text!r}: mde must be in (0, 1), got {mde:g}")
    if cap is not None and cap < 2:
        raise ValueError(f"{flag} {text!r}: max-samples must be >= 2")
    lag = 3 if m.group(4) is None else int(m.group(4))
    budget = None if m.group(5) is None else float(m.group(5))
    if budget is not None and not budget > 0:
        raise ValueError(f"{flag} {text!r}: a budget must be > 0")
    per_point = m.group(6) == "s"
    return AdaptiveSettings(m.group(1), mde, cap, None if per_point else budget, budget if per_point else None, lag)


@dataclass(frozen=True)
class StepValues:
    """One complete point of the dataset: its per-prompt values (mean over its samples) and samples per prompt."""

    step: int
    values: np.ndarray
    samples: int


@dataclass(frozen=True)
class Want:
    """More samples for a step, and why."""

    step: int
    add: int  # samples per prompt to add
    reason: str
    urgency: float  # smaller first: how close the open comparison is (|difference| / its MDE)


def diff_mde(d: np.ndarray) -> float:
    """``(t_{0.975} + t_{0.8}) sd(d) / sqrt(n)`` at ``n - 1`` df (compare's MDE without replays); NaN if undefined."""
    n = d.size
    sd = float(d.std(ddof=1)) if n > 1 else 0.0
    if n < 2 or sd == 0.0:
        return math.nan
    q = float(student_t.ppf(0.5 + LEVEL / 2, n - 1) + student_t.ppf(POWER, n - 1))
    return q * sd / math.sqrt(n)


def open_steps(settings: AdaptiveSettings, points: Sequence[StepValues], cap: int,
               target: Condition | None = None, final: bool = False) -> list[Want]:
    """The steps whose decision is still open (module docstring), most urgent first; each once. A candidate is
    granted only once it and the best step each have ``settings.lag`` newer points (or ``final``: training
    ended): while a run still rises, the next points decide most candidates for free."""
    if not points:
        return []
    best = max(points, key=lambda p: (float(p.values.mean()), p.step))
    newer = {p.step: sum(q.step > p.step for q in points) for p in points}
    wants: dict[int, Want] = {}

    def want(p: StepValues, reason: str, urgency: float) -> None:
        add = min(p.samples, cap - p.samples)
        if add > 0 and (p.step not in wants or urgency < wants[p.step].urgency):
            wants[p.step] = Want(p.step, add, reason, urgency)

    for p in points:
        if p.step == best.step or p.values.shape != best.values.shape:
            continue
        d = best.values - p.values
        m = diff_mde(d)
        if math.isnan(m) or float(d.mean()) >= m or m <= settings.mde:
            continue  # undefined, far behind the best, or equal to it within the target: decided
        if not final and (newer[p.step] < settings.lag or newer[best.step] < settings.lag):
            continue  # too new, or the best still moving: the next points may decide it for free
        why = (f"candidate best: {p.values.mean():.4f} is {d.mean():+.4f} from best step {best.step} "
               f"({best.values.mean():.4f}), under that difference's MDE {m:.4f} > target {settings.mde:g}")
        want(p, why, float(d.mean()) / m)
        want(best, f"best step, compared with open candidate step {p.step} (MDE {m:.4f} > target {settings.mde:g})",
             float(d.mean()) / m)
    if best.step in wants:  # the best's samples serve every comparison: deepen it first, then look again
        wants = {best.step: wants[best.step]}
    if target is not None and target.metric == f"eval/{settings.dataset}":
        for p in points:
            own = diff_mde(p.values - p.values.mean()) if p.values.size > 1 else math.nan
            gap = abs(float(p.values.mean()) - target.threshold)
            if not math.isnan(own) and gap < own and own > settings.mde and (final or newer[p.step] >= settings.lag):
                want(p, f"near the target {target.text}: {p.values.mean():.4f}, within its MDE {own:.4f}", gap / own)
    return sorted(wants.values(), key=lambda w: (w.urgency, -w.step))
