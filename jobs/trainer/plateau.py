"""The plateau stopping rule (``--eval-stop-plateau 'eval/<ds> over N'``), beside the target rule
``--eval-stop-when``: training may stop once none of the last ``N`` points beats the best point before them
by its minimum detectable effect, with the false-stop error spent across looks.

See docs/USER_GUIDE.md "Stopping on a plateau" for the rule, its error and its simulated false-stop rate
(bench/bench_plateau.py). Guarantee: a pure function of the points' (value, stderr) history, so a resumed
trainer reaches the same verdict; scipy's normal quantiles.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scipy.stats import norm

NUMBER = r"(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
PATTERN = re.compile(rf"^\s*(eval/[^/\s]+)\s+over\s+(\d+)(?:\s+alpha\s+({NUMBER}))?\s*$")
MDE_LEVEL, MDE_POWER = 0.95, 0.8  # the MDE compare and --eval-stop-when's ``margin mde`` use


@dataclass(frozen=True)
class PointValue:
    """One complete point's value of the rule's metric and its logged standard error."""

    step: int
    value: float
    stderr: float


@dataclass(frozen=True)
class PlateauVerdict:
    """Why the rule stopped: the best step, the window and the look's error share."""

    best_step: int
    window: tuple[int, ...]
    look: int
    alpha: float  # the error this look spends (the looks' shares sum to the rule's alpha)
    largest_gain: float  # the window's largest value minus the best's

    def message(self, metric: str) -> str:
        return (f"plateau: no point of steps {self.window[0]}..{self.window[-1]} beats step {self.best_step} by its MDE "
                f"on {metric} (largest gain {self.largest_gain:+.4f}; look {self.look}, error {self.alpha:.2g})")


@dataclass(frozen=True)
class PlateauRule:
    """``metric over window [alpha A]``; see the module docstring."""

    metric: str
    window: int
    alpha: float = 0.05

    @property
    def text(self) -> str:
        return f"{self.metric} over {self.window} alpha {self.alpha:g}"

    def value_of(self, step: int, metrics: Mapping[str, float]) -> PointValue | None:
        """The rule's metric and its standard error in a point's logged metrics (None: not there)."""
        value = metrics.get(self.metric)
        return None if value is None else PointValue(step, float(value), float(metrics.get(f"{self.metric}/stderr", math.nan)))

    def look_alpha(self, look: int) -> float:
        """The error spent at look ``look`` (1, 2, ...): ``alpha * 6 / (pi^2 look^2)``, which sums to ``alpha``
        over every look (Bonferroni over an unbounded number of looks)."""
        return self.alpha * 6.0 / (math.pi**2 * look**2)

    def verdict(self, history: Sequence[PointValue]) -> PlateauVerdict | None:
        """The stop of the newest look over ``history`` (complete points, oldest first), or None.

        Look ``k`` is made when the ``window + k``-th point lands. It stops when, for every point ``j`` of the
        last ``window``, the one-sided upper bound of its gain over the best earlier point,
        ``d_j + z_{1 - a_k / window} se_j``, is below that gain's MDE ``(z_0.975 + z_0.8) se_j``
        (``se_j``: the two points' standard errors combined). A point without a standard error (or with 0)
        makes no look."""
        points = [p for p in history if math.isfinite(p.value)]
        look = len(points) - self.window
        if look < 1:
            return None
        earlier, window = points[: -self.window], points[-self.window :]
        best = max(earlier, key=lambda p: (p.value, p.step))
        a = self.look_alpha(look)
        z_upper = float(norm.ppf(1 - a / self.window))
        z_mde = float(norm.ppf(0.5 + MDE_LEVEL / 2) + norm.ppf(MDE_POWER))
        for p in window:
            se = math.hypot(p.stderr, best.stderr)
            if not se > 0 or not math.isfinite(se):
                return None
            if p.value - best.value + z_upper * se >= z_mde * se:
                return None
        gain = max(p.value for p in window) - best.value
        return PlateauVerdict(best.step, tuple(p.step for p in window), look, a, gain)


def parse_plateau(text: str, flag: str) -> PlateauRule:
    """``'eval/<ds> over N [alpha A]'`` -> :class:`PlateauRule`; one ValueError naming ``flag`` otherwise."""
    m = PATTERN.match(text)
    if m is None:
        raise ValueError(f"{flag} {text!r}: expected 'eval/<dataset> over N' (optionally 'alpha A'): a dataset's "
                         "mean, the metric with a logged standard error")
    window, alpha = int(m.group(2)), 0.05 if m.group(3) is None else float(m.group(3))
    if window < 1:
        raise ValueError(f"{flag} {text!r}: N must be >= 1 point")
    if not 0 < alpha < 1:
        raise ValueError(f"{flag} {text!r}: alpha must be in (0, 1), got {alpha:g}")
    return PlateauRule(m.group(1), window, alpha)
