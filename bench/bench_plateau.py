"""The plateau stopping rule's false-stop rate by simulation (#40; ``jobs/trainer/plateau.py``).

A run's points: ``--pre`` flat points, then a jump of exactly the MDE of a difference ``(z_0.975 + z_0.8) se
sqrt(2)`` that stays (the least favourable case: every look whose window holds a post-jump point and whose
earlier points are all pre-jump is a look where stopping is false). Printed: the false-stop rate of the rule
(error spent across looks) against its nominal ``alpha``, and of the same looks each given the whole
``alpha`` (the baseline, measured in the same run); and the rule's power: how often, and how soon, it stops on
a curve that rises by the MDE then falls back by ``--drop`` se and stays flat (a plateau below its best).
Seeded; a few seconds.

    .venv/bin/python bench/bench_plateau.py [--reps 2000] [--window 5] [--alpha 0.05] [--se 0.02]
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from scipy.stats import norm

from ckpteval.jobs.trainer.plateau import PlateauRule, PointValue


class Unspent(PlateauRule):
    """The baseline: every look tests at the whole alpha (no spending)."""

    def look_alpha(self, look: int) -> float:
        return self.alpha


def false_stop_rate(rule: PlateauRule, pre: int, se: float, reps: int, seed: int) -> float:
    rng = np.random.default_rng(seed)
    jump = (norm.ppf(0.975) + norm.ppf(0.8)) * se * math.sqrt(2)
    stops = 0
    for _ in range(reps):
        history = [PointValue(t, (jump if t >= pre else 0.0) + rng.normal(0, se), se) for t in range(pre + rule.window)]
        stops += any(rule.verdict(history[: t + 1]) is not None for t in range(pre, pre + rule.window))
    return stops / reps


def stop_times(rule: PlateauRule, se: float, drop: float, points: int, reps: int, seed: int) -> list[int | None]:
    rng = np.random.default_rng(seed)
    jump = (norm.ppf(0.975) + norm.ppf(0.8)) * se * math.sqrt(2)
    out: list[int | None] = []
    for _ in range(reps):
        history: list[PointValue] = []
        stopped = None
        for t in range(points):
            mean = jump * min(t, 4) / 4 - (drop * se if t > 4 else 0.0)
            history.append(PointValue(t, mean + rng.normal(0, se), se))
            if rule.verdict(history) is not None:
                stopped = t
                break
        out.append(stopped)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--alpha", type=float, default=0.05)
    p.add_argument("--se", type=float, default=0.02)
    p.add_argument("--drop", type=float, default=1.0)
    p.add_argument("--points", type=int, default=30)
    p.add_argument("--seed", type=int, default=40)
    args = p.parse_args()
    rule = PlateauRule("eval/x", args.window, args.alpha)
    baseline = Unspent("eval/x", args.window, args.alpha)
    print(f"window {args.window}, alpha {args.alpha}, se {args.se}, {args.reps} runs per cell")
    print(f"{'flat points before the jump':>28}  {'false stops (spent)':>20}  {'(whole alpha each look)':>24}")
    worst, worst_base = 0.0, 0.0
    for pre in (1, 2, 5, 10, 20):
        a = false_stop_rate(rule, pre, args.se, args.reps, args.seed + pre)
        b = false_stop_rate(baseline, pre, args.se, args.reps, args.seed + pre)
        worst, worst_base = max(worst, a), max(worst_base, b)
        print(f"{pre:>28}  {a:>20.4f}  {b:>24.4f}")
    times = stop_times(rule, args.se, args.drop, args.points, args.reps, args.seed)
    stopped = [t for t in times if t is not None]
    median = float(np.median(stopped)) if stopped else math.nan
    print(f"plateau {args.drop:g} se below its best after point 4: stops in {len(stopped) / len(times):.3f} of runs "
          f"within {args.points} points, median at point {median:g}")
    print(f"false-stop ratio: {worst:.4f} worst case against nominal {args.alpha} "
          f"(ratio {worst / args.alpha:.2f}); without spending {worst_base:.4f} (ratio {worst_base / args.alpha:.2f})")


if __name__ == "__main__":
    main()
