"""Adaptive evaluation against evaluating everything at every point (#40; ``jobs/trainer/adaptive``).

A scripted engine: ``--prompts`` prompts with difficulties ``a_i`` ~ N(0, 1.5); at step ``s`` prompt ``i`` is
answered right with probability ``sigmoid(a_i + f(s))``, ``f`` rising over the first half of ``--points``
points and then flat with small bumps (N(0, ``--bump``)): an RL run whose last points are close. Every sample
costs ``--tokens`` generated tokens. Two ways to evaluate the same run (same draws per (step, prompt, sample)):

- **full**: every point at ``--full`` samples per prompt (the baseline, measured in the same run), rising over the first
  ``--rising`` share of the points;
- **adaptive**: every point at ``--base`` samples; as each point lands, the policy the dispatcher uses
  (:func:`ckpteval.jobs.trainer.adaptive.policy.open_steps`, target MDE ``--mde``, cap ``--full``) grants the
  open steps more samples (doubling) until nothing is open.

Printed over ``--reps`` seeded runs: generated tokens of each (their ratio), the MDE of the comparisons of the
best step with its *candidates* (the steps whose difference to the best is under its MDE when everything is
evaluated in full) under each way, and whether the best step chosen is the same — and its true accuracy
(the regret against the truly best step). About 10 s on one core.

    .venv/bin/python bench/bench_adaptive.py [--reps 20] [--points 40] [--prompts 200] [--base 2] [--full 16] [--lag 3]
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from ckpteval.jobs.trainer.adaptive.policy import AdaptiveSettings, StepValues, diff_mde, open_steps


class ScriptedRun:
    """The run's true accuracies and one fixed draw per (step, prompt, sample): both ways read the same draws."""

    def __init__(self, points: int, prompts: int, full: int, bump: float, rising: float,
                 rng: np.random.Generator) -> None:
        a = rng.normal(0.0, 1.5, prompts)
        top = max(1, int(points * rising))
        rise = np.minimum(np.arange(points) / top, 1.0) * 2.0
        f = rise + np.where(np.arange(points) >= top, rng.normal(0, bump, points), 0.0)
        self.p = 1 / (1 + np.exp(-(a[None, :] - 1.0 + f[:, None])))  # steps x prompts
        self.draws = rng.random((points, prompts, full)) < self.p[:, :, None]

    def values(self, step: int, samples: int) -> np.ndarray:
        return self.draws[step, :, :samples].mean(axis=1)

    @property
    def truth(self) -> np.ndarray:
        return self.p.mean(axis=1)


def adaptive(run: ScriptedRun, settings: AdaptiveSettings, base: int, cap: int) -> dict[int, int]:
    """Samples per prompt each step ends with, points landing one at a time."""
    samples: dict[int, int] = {}
    steps = run.p.shape[0]
    for step in range(steps + 1):  # the last look is the end of training's (``final``)
        if step < steps:
            samples[step] = base
        while True:
            points = [StepValues(s, run.values(s, n), n) for s, n in samples.items()]
            wants = open_steps(settings, points, cap, final=step == steps)
            if not wants:
                break
            for w in wants:
                samples[w.step] += w.add
    return samples


def candidates(run: ScriptedRun, samples: dict[int, int]) -> tuple[int, list[int]]:
    """The best step by the evaluated means and the steps not far behind it (difference under its MDE)."""
    means = {s: run.values(s, n).mean() for s, n in samples.items()}
    best = max(means, key=lambda s: (means[s], s))
    out = []
    for s, n in samples.items():
        if s != best:
            d = run.values(best, samples[best]) - run.values(s, n)
            m = diff_mde(d)
            if not math.isnan(m) and d.mean() < m:
                out.append(s)
    return best, out


def mdes(run: ScriptedRun, samples: dict[int, int], best: int, steps: list[int]) -> list[float]:
    return [diff_mde(run.values(best, samples[best]) - run.values(s, samples[s])) for s in steps]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--points", type=int, default=40)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--base", type=int, default=2)
    p.add_argument("--full", type=int, default=16)
    p.add_argument("--mde", type=float, default=0.02)
    p.add_argument("--lag", type=int, default=3, help="newer points before a candidate is granted")
    p.add_argument("--bump", type=float, default=0.05, help="the plateau's bumps (logit sd)")
    p.add_argument("--rising", type=float, default=0.75, help="share of the points over which accuracy rises")
    p.add_argument("--tokens", type=int, default=1000, help="generated tokens per sample")
    p.add_argument("--seed", type=int, default=40)
    args = p.parse_args()
    settings = AdaptiveSettings("x", args.mde, args.full, lag=args.lag)
    tok_full = tok_adapt = oracle = 0
    same, regret_full, regret_adapt, m_full, m_adapt, n_cand = 0, [], [], [], [], []
    for rep in range(args.reps):
        run = ScriptedRun(args.points, args.prompts, args.full, args.bump, args.rising,
                          np.random.default_rng(args.seed + rep))
        full = {s: args.full for s in range(args.points)}
        adapt = adaptive(run, settings, args.base, args.full)
        tok_full += sum(full.values()) * args.prompts * args.tokens
        tok_adapt += sum(adapt.values()) * args.prompts * args.tokens
        best_full, cands = candidates(run, full)
        best_adapt, _ = candidates(run, adapt)
        same += best_full == best_adapt
        truth = run.truth
        regret_full.append(truth.max() - truth[best_full])
        regret_adapt.append(truth.max() - truth[best_adapt])
        m_full += mdes(run, full, best_full, cands)
        m_adapt += mdes(run, adapt, best_full, cands)
        n_cand.append(len(cands))
        oracle += (len(cands) + 1) * args.full + (args.points - len(cands) - 1) * args.base
    print(f"{args.reps} runs x {args.points} points x {args.prompts} prompts; full {args.full} samples/prompt, "
          f"adaptive from {args.base} (target MDE {args.mde}, lag {args.lag}); {args.tokens} tokens/sample")
    print(f"candidate steps per run (difference to the best under its MDE, full evaluation): mean {np.mean(n_cand):.1f}")
    print(f"MDE of best-vs-candidate comparisons: full {np.nanmean(m_full):.4f}, adaptive {np.nanmean(m_adapt):.4f}")
    print(f"best step: same in {same}/{args.reps} runs; true-accuracy regret full {np.mean(regret_full):.4f}, "
          f"adaptive {np.mean(regret_adapt):.4f}")
    print(f"generated tokens: full {tok_full:.3g}, adaptive {tok_adapt:.3g}; "
          f"ratio {tok_full / tok_adapt:.2f}x fewer with adaptive evaluation (an oracle that knew the candidates: "
          f"{tok_full / (oracle * args.prompts * args.tokens):.2f}x)")


if __name__ == "__main__":
    main()
