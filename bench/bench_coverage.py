"""Coverage of ``ckpteval compare``'s decision at the sizes users run (#37): 2, 3, 5, 20 prompts x 1, 2, 6 replay pairs.

Two steps of the *same true score* are compared, as ``compare`` does (the paired t interval, and with replays the
interval widened by the engine's measured shared variance, whose verdict wins: ``jobs/decide/compare.py``
``noise_fields``). Scores: each prompt's value is the mean of ``--samples`` samples drawn at its success rate;
step B's rate differs from A's per prompt by ``u_i`` ~ U(-0.1, 0.1) (mean 0: no true difference); every evaluation
shifts all its prompts' rates by ``g`` ~ N(0, ``--tau``) (the engine's shared shift that only replays see);
replays are pairs of evaluations of one snapshot. Printed per cell: the rate the engine interval covers the true
difference 0 (nominal: the level, 0.95), the rate ``compare`` says "A better" or "B better" (nominal 0.05), and
the mean half-width of the engine interval — for the code as of f5db8fb (before #37: series t quantile, df
Welch-Satterthwaite from the same data, rounded) and as now (scipy t; df ``min(n - 1, pairs)``).
Seeded; about 20 s on one core.

    .venv/bin/python bench/bench_coverage.py [--reps 4000] [--tau 0.05] [--samples 8] [--seed 37]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import numpy as np

import ckpteval.jobs.decide.noise as noise_now
import ckpteval.jobs.decide.stats as stats_now

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "f5db8fb"
PROMPTS = (2, 3, 5, 20)
PAIRS = (1, 2, 6)
LEVEL = 0.95


def load_before(folder: Path) -> tuple[ModuleType, ModuleType]:
    """``jobs/decide/stats.py`` and ``noise.py`` as of :data:`BEFORE`, imported from ``folder`` (noise's import of
    stats pointed at the old stats)."""
    mods = []
    for name in ("stats", "noise"):
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE}:jobs/decide/{name}.py"], check=True,
                              capture_output=True, text=True).stdout
        text = text.replace("from ckpteval.jobs.decide.stats import", "from before_stats import")
        path = folder / f"before_{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"before_{name}", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[f"before_{name}"] = mod
        spec.loader.exec_module(mod)
        mods.append(mod)
    return mods[0], mods[1]


def evaluate(rng: np.random.Generator, rates: np.ndarray, samples: int, tau: float) -> np.ndarray:
    """One evaluation: every prompt's rate shifted by the evaluation's own ``g``, then ``samples`` draws per prompt."""
    shifted = np.clip(rates + rng.normal(0.0, tau), 0.0, 1.0)
    return rng.binomial(samples, shifted) / samples


def one(rng: np.random.Generator, mods: tuple[ModuleType, ModuleType], n: int, pairs: int, samples: int,
        tau: float) -> tuple[bool, bool, float]:
    """One comparison: (the engine interval covers 0, compare's verdict is not "noise", the interval's half-width)."""
    stats, noise = mods
    rate_a = rng.uniform(0.3, 0.7, n)
    rate_b = rate_a + rng.uniform(-0.1, 0.1, n)
    replays = [(evaluate(rng, rate_a, samples, tau), evaluate(rng, rate_a, samples, tau)) for _ in range(pairs)]
    a, b = evaluate(rng, rate_a, samples, tau), evaluate(rng, rate_b, samples, tau)
    plain = stats.paired_interval(a, b, LEVEL)
    measured = noise.engine_noise(replays)
    wide = noise.noise_interval(b - a, LEVEL, measured, (-1.0, 1.0))
    return not wide.distinguishable, plain.distinguishable and wide.distinguishable, (wide.high - wide.low) / 2


def cell(seed: int, mods: tuple[ModuleType, ModuleType], n: int, pairs: int, reps: int, samples: int,
         tau: float) -> tuple[float, float, float]:
    rng = np.random.default_rng([seed, n, pairs])
    got = np.array([one(rng, mods, n, pairs, samples, tau) for _ in range(reps)], dtype=float)
    return float(got[:, 0].mean()), float(got[:, 1].mean()), float(got[:, 2].mean())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=4000)
    parser.add_argument("--tau", type=float, default=0.05, help="sd of the engine's shift of a whole evaluation")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--seed", type=int, default=37)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = load_before(Path(tmp))
        now = (stats_now, noise_now)
        print(f"true difference 0, engine shift sd {args.tau}, {args.samples} samples/prompt, {args.reps} draws per "
              f"cell, level {LEVEL} (nominal: coverage {LEVEL}, false verdict {1 - LEVEL:.2f})")
        print(f"{'prompts':>7} {'pairs':>5} | {'before: cover':>13} {'false':>6} {'half':>6} | "
              f"{'now: cover':>10} {'false':>6} {'half':>6}")
        worst = [0.0, 0.0]  # the largest false-verdict rate, before and now
        for n in PROMPTS:
            for k in PAIRS:
                old = cell(args.seed, before, n, k, args.reps, args.samples, args.tau)
                new = cell(args.seed, now, n, k, args.reps, args.samples, args.tau)
                worst = [max(worst[0], old[1]), max(worst[1], new[1])]
                print(f"{n:>7} {k:>5} | {old[0]:>13.3f} {old[1]:>6.3f} {old[2]:>6.3f} | "
                      f"{new[0]:>10.3f} {new[1]:>6.3f} {new[2]:>6.3f}")
    print(f"ratio of the worst false-verdict rate to the nominal {1 - LEVEL:.2f}: before {worst[0] / (1 - LEVEL):.2f}, "
          f"now {worst[1] / (1 - LEVEL):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
