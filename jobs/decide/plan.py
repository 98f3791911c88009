"""``ckpteval plan RUN --mde M``: how many prompts or samples per prompt a dataset needs for ``compare`` between two
steps to see a difference of ``M``, and what each costs in generated tokens (docs/USER_GUIDE.md "Planning the sample
size").

From the run's own complete points (per-sample scores, :func:`ckpteval.coord.results.points.prompt_major`): a one-way
random-effects split of each point's scores ``y[i,j] = mu + a[i] + e[i,j]`` (``N`` prompts, ``k`` samples) by the
ANOVA mean squares, pooled over steps: ``sigma2_s = MSW``, ``sigma2_p = (MSB - MSW) / k`` (clipped at 0). A paired
comparison of two steps does not see ``sigma2_p`` itself, only the part of the prompts' variance that the pairing
leaves, ``sigma2_d``: per pair of consecutive steps ``var(d_i) - (MSW_A + MSW_B) / k`` (``d_i`` the prompt's mean
difference), pooled over pairs. The MDE of a design ``(N, k)`` is then :func:`ckpteval.jobs.decide.noise.mde` — the
formula ``compare`` reports — of ``sigma2_d + 2 sigma2_s / k`` over ``N`` prompts, with the engine's shared variance
when replays measured it. More prompts shrink all of it, more samples only the ``2 sigma2_s / k`` part.
Limits: the mean metric only; ``sigma2_s`` taken the same at every step; one sample per prompt cannot be split.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ckpteval.coord.entries import scored_per_sample
from ckpteval.coord.results.points import prompt_major
from ckpteval.jobs.decide.data import Metric, RunValues, open_run
from ckpteval.jobs.decide.noise import DEFAULT_POWER, engine_noise, mde
from ckpteval.jobs.decide.stats import DEFAULT_LEVEL
from ckpteval.jobs.flags import Parser, fail, output_width, wrap

PROG = "ckpteval plan"
MAX_SIZE = 10_000_000  # the largest number of prompts (or samples per prompt) a plan searches


@dataclass(frozen=True)
class Split:
    """What a run's points say of one dataset's variance (module docstring)."""

    prompts: int  # N of each point
    samples: int  # k of each point
    steps: int  # points pooled
    pairs: int  # consecutive pairs of steps pooled into pair_var
    prompt_var: float  # sigma2_p: between prompts, within a point
    sample_var: float  # sigma2_s: between samples of one prompt
    pair_var: float  # sigma2_d: of a prompt's true difference between two steps (nan with one step)
    ms_between: float
    ms_within: float

    def diff_var(self, samples: float) -> float:
        """The per-prompt variance of a paired difference with ``samples`` per prompt (``inf``: the prompts' part)."""
        return self.pair_var + (0.0 if math.isinf(samples) else 2 * self.sample_var / samples)


def variance_split(points: Sequence[np.ndarray]) -> Split:
    """The split from per-step ``(N, k)`` score matrices (same prompts in the same order; steps in order).
    ValueError without a point, with one sample per prompt, or with points of different shapes."""
    if not points:
        raise ValueError("no complete point to plan from")
    shapes = {np.shape(p) for p in points}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"points of different shapes cannot be pooled: {sorted(shapes)}")
    n, k = next(iter(shapes))
    if k < 2 or n < 2:
        raise ValueError(f"{n} prompts x {k} samples: prompts and samples cannot be told apart "
                         "(2 or more of each needed)")
    ys = [np.asarray(p, dtype=float) for p in points]
    within = [float(((y - y.mean(axis=1, keepdims=True)) ** 2).sum()) / (n * (k - 1)) for y in ys]
    between = [k * float(y.mean(axis=1).var(ddof=1)) for y in ys]
    msw, msb = float(np.mean(within)), float(np.mean(between))  # equal df per step: the pooled mean squares
    pair = [float((b.mean(axis=1) - a.mean(axis=1)).var(ddof=1)) - (wa + wb) / k
            for a, b, wa, wb in zip(ys, ys[1:], within, within[1:], strict=False)]
    return Split(n, k, len(ys), len(pair), max(0.0, (msb - msw) / k), msw,
                 max(0.0, float(np.mean(pair))) if pair else math.nan, msb, msw)


@dataclass(frozen=True)
class Design:
    """A number of prompts and samples per prompt, its MDE and its generated tokens per point."""

    prompts: int
    samples: int
    mde: float
    tokens: float | None  # per point (None: tokens per sample not recorded)


@dataclass(frozen=True)
class Plan:
    """One dataset's advice for a target MDE."""

    dataset: str
    split: Split
    target: float
    now: Design
    more_prompts: Design | None  # None: no number of prompts reaches it (the engine's shared noise alone is wider)
    more_samples: Design | None  # None: no number of samples reaches it at this many prompts
    tokens_per_sample: float | None
    shared_var: float  # the engine's measured shared variance (0 without replays)

    @property
    def advice(self) -> str:
        """``reached``, ``prompts``, ``samples`` (the cheaper in tokens; prompts when tokens are unknown) or ``neither``."""
        if self.now.mde <= self.target:
            return "reached"
        options = [d for d in (self.more_prompts, self.more_samples) if d is not None]
        if not options:
            return "neither"
        cheapest = min(options, key=lambda d: d.prompts * d.samples)
        return "prompts" if cheapest is self.more_prompts else "samples"

    def to_json(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "target_mde": self.target, "advice": self.advice, "split": asdict(self.split),
                "now": asdict(self.now), "more_prompts": self.more_prompts and asdict(self.more_prompts),
                "more_samples": self.more_samples and asdict(self.more_samples),
                "tokens_per_sample": self.tokens_per_sample, "shared_var": self.shared_var}


@dataclass(frozen=True)
class Settings:
    """What every MDE of a plan is computed at (as ``compare``)."""

    level: float = DEFAULT_LEVEL
    power: float = DEFAULT_POWER
    shared_var: float = 0.0
    replay_pairs: int = 0


def design_mde(split: Split, prompts: int, samples: float, s: Settings) -> float:
    """The MDE ``compare`` would report between two steps evaluated on ``prompts`` x ``samples`` (``inf``: no limit)."""
    return mde(split.diff_var(samples), prompts, s.shared_var, s.level, s.power, s.replay_pairs)


def smallest(ok: Any, start: int) -> int | None:
    """The smallest integer ``>= start`` for which the monotone ``ok`` holds (None: not up to :data:`MAX_SIZE`)."""
    if ok(start):
        return start
    hi = start
    while not ok(hi):
        if hi >= MAX_SIZE:
            return None
        hi = min(2 * hi, MAX_SIZE)
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def plan(dataset: str, split: Split, target: float, tokens_per_sample: float | None, s: Settings) -> Plan:
    """The advice for ``target`` (module docstring). ValueError when the split has no pair of steps."""
    if not split.pairs:
        raise ValueError(f"{dataset}: one complete point ({split.steps} step): a paired difference needs two")
    if split.diff_var(split.samples) <= 0.0 and s.shared_var <= 0.0:
        raise ValueError(f"{dataset}: no spread between prompts or samples: nothing to size an effect against")

    def design(n: int | None, k: int | None) -> Design | None:
        if n is None or k is None:
            return None
        tokens = None if tokens_per_sample is None else n * k * tokens_per_sample
        return Design(n, k, design_mde(split, n, k, s), tokens)

    n, k = split.prompts, split.samples
    prompts = smallest(lambda m: design_mde(split, m, k, s) <= target, n)
    only_samples_noise = split.diff_var(math.inf) <= 0.0 and s.shared_var <= 0.0  # enough samples always reach it
    reachable = only_samples_noise or design_mde(split, n, math.inf, s) <= target
    samples = smallest(lambda m: design_mde(split, n, m, s) <= target, k) if reachable else None
    return Plan(dataset, split, target, design(n, k), design(prompts, k),  # type: ignore[arg-type]
                design(n, samples), tokens_per_sample, s.shared_var)


def run_points(side: RunValues, dataset: str) -> list[np.ndarray]:
    """The ``(N, k)`` score matrices of ``dataset``'s complete points, in step order."""
    spec = side.manifest.entry(dataset)
    out = []
    for step in side.steps_with(dataset):
        scores = prompt_major(spec, [side.results[u] for u in spec.units(step)]).scores  # type: ignore[arg-type]
        out.append(np.asarray(scores, dtype=float).reshape(-1, spec.n_samples))
    return out


def tokens_per_sample(side: RunValues, dataset: str) -> float | None:
    """Mean generated tokens per sample over the dataset's complete points (None: not recorded)."""
    spec = side.manifest.entry(dataset)
    done = [side.results[u] for step in side.steps_with(dataset) for u in spec.units(step)]
    tok = [r.extras.get("completion_tokens") for r in done]
    if not done or any(t is None or not t.get("n") for t in tok):
        return None
    return sum(t["sum"] for t in tok) / sum(t["n"] for t in tok)  # type: ignore[index]


def plan_run(side: RunValues, target: float, level: float, power: float,
             datasets: Sequence[str] | None = None) -> list[Plan]:
    """A :class:`Plan` per dataset scored per sample (or ``datasets``); ValueError naming a dataset it cannot plan."""
    names = [e.name for e in side.manifest.eval.entries if scored_per_sample(e)]
    for name in datasets or ():
        if name not in names:
            raise ValueError(f"--dataset {name!r}: no such dataset scored per sample (datasets: {', '.join(names)})")
    plans = []
    for name in datasets or names:
        noise = engine_noise(side.replay_pairs(Metric(name, "mean")))
        settings = Settings(level, power, noise.shared_var if noise else 0.0, noise.df_pairs if noise else 0)
        try:
            split = variance_split(run_points(side, name))
        except ValueError as e:
            raise ValueError(f"{side.run.path}: {name}: {e}") from None
        plans.append(plan(name, split, target, tokens_per_sample(side, name), settings))
    return plans


def _tokens(d: Design) -> str:
    return "" if d.tokens is None else f", {d.tokens:,.0f} tokens per point"


def render(p: Plan, width: int = 10_000) -> list[str]:
    """A plan as text lines of at most ``width`` columns."""
    s, now = p.split, p.now
    lines = [f"{p.dataset}: {now.prompts} prompts x {now.samples} samples, MDE {now.mde:.4f} now (target "
             f"{p.target:.4f}); from {s.steps} points: sigma2_p {s.prompt_var:.4g} between prompts, sigma2_s "
             f"{s.sample_var:.4g} between samples, sigma2_d {s.pair_var:.4g} of a prompt's difference between steps"]
    for label, d in (("more prompts", p.more_prompts), ("more samples", p.more_samples)):
        if d is None:
            lines.append(f"  {label}: cannot reach it ({_floor(p, label)})")
        else:
            extra = "" if now.tokens is None or d.tokens is None else f" (+{d.tokens - now.tokens:,.0f})"
            lines.append(f"  {label}: {d.prompts} prompts x {d.samples} samples, MDE {d.mde:.4f}{_tokens(d)}{extra}")
    lines.append(f"  advice: {ADVICE[p.advice]}")
    return [part for line in lines for part in wrap(line, width)]


def _floor(p: Plan, label: str) -> str:
    if label == "more samples":
        return "the prompts' own difference variance alone leaves a wider MDE at this many prompts"
    return "the engine's shared variance alone is wider"


ADVICE = {"reached": "the target is already reached", "prompts": "more prompts (fewer tokens)",
          "samples": "more samples per prompt (fewer tokens)", "neither": "neither reaches it"}


def main(argv: list[str]) -> int:
    parser = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, metavar="RUN")
    parser.add_argument("--mde", type=float, required=True, help="the difference between two steps compare must see")
    parser.add_argument("--dataset", action="append", metavar="DS", help="plan this dataset (repeatable; default: all "
                        "scored per sample)")
    parser.add_argument("--level", type=float, default=DEFAULT_LEVEL, help="confidence level (default 0.95, as compare)")
    parser.add_argument("--power", type=float, default=DEFAULT_POWER, help="power (default 0.8, as compare)")
    parser.add_argument("--json", action="store_true", help="print the plans as JSON")
    args = parser.parse_args(argv)
    if not args.mde > 0.0:
        parser.error(f"--mde must be > 0, got {args.mde}")
    for flag in ("level", "power"):
        if not 0.0 < getattr(args, flag) < 1.0:
            parser.error(f"--{flag} must be in (0, 1), got {getattr(args, flag)}")
    try:
        plans = plan_run(open_run(args.run), args.mde, args.level, args.power, args.dataset)
    except (ValueError, FileNotFoundError) as e:
        return fail(PROG, e)
    if args.json:
        print(json.dumps([p.to_json() for p in plans]))
    else:
        print("\n".join(line for p in plans for line in render(p, output_width())))
    return 0
