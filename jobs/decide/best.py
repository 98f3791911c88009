"""``ckpteval best RUN [--metric eval/<ds>[/pass@k|/pass^k|/maj@n]]``: which checkpoint to ship (default metric:
the run's first dataset's mean).

The best step by the metric (``--higher-is-better``, the default, or ``--lower-is-better``), its
interval, and every step *not distinguishable from it*: each other step's paired difference to the
best (per-prompt differences, paired t interval), Bonferroni-corrected for the number of steps
compared, contains 0 (:func:`ckpteval.jobs.decide.stats.best_step`) — **or whose margin to the best is under the
minimum detectable effect** at ``--power`` (:mod:`ckpteval.jobs.decide.noise`; with replays, ``eval.replay``,
the engine's measured noise is in it and widens the intervals). Every step of that set carries its reason;
a single winner is named (``winner``) only when the set is the best alone, else ``winner`` is null and the
output says which steps cannot be told apart. Each difference also has its bootstrap interval. Steps measured on engines of different identities are
refused, naming them and the fields that differ, unless ``--allow-engine-mismatch`` (then recorded as
``engine_notes``); so are steps scored by scorers of different identities, unless ``--allow-scorer-mismatch``
(``scorer_notes``; :mod:`ckpteval.jobs.decide.scorers`). Written to ``RUN/best/<metric>.json`` (atomic; ``/`` written ``__``: one file per metric) and
printed; ``--json`` prints the file's content; ``--wandb-run-id ID`` also writes it into that wandb
run's summary (``best/step``, ``best/mean``, ``best/low``, ``best/high``, ``best/not_distinguishable``,
``best/metric``) as a shared writer (:func:`ckpteval.jobs.metrics.init_wandb`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from ckpteval.coord.atomic import write_json_atomic
from ckpteval.jobs.decide import censoring
from ckpteval.jobs.decide.data import default_metric, open_run, parse_metric
from ckpteval.jobs.decide.engines import ALLOW_FLAG, check_engines, point_engine
from ckpteval.jobs.decide.noise import DEFAULT_POWER, EngineNoise, engine_noise, mde_text, pair_view
from ckpteval.jobs.decide.scorers import ALLOW_SCORER_FLAG, check_scorers, point_scorer
from ckpteval.jobs.decide.stats import DEFAULT_LEVEL, Best, best_step
from ckpteval.jobs.flags import Parser, fail, output_width, wrap

PROG = "ckpteval best"


def best_record(best: Best, metric: str, higher: bool, means: dict[int, float],
                rule: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``RUN/best/<metric>.json`` content (docs/PROTOCOL.md); ``rule``: :func:`noise_rule`'s fields."""
    rule = rule or {"not_distinguishable": list(best.tied), "per_step": {}}
    per_step = rule.get("per_step", {})
    return {"metric": metric, "higher_is_better": higher, "best_step": best.step, "interval": best.interval.to_json(),
            "correction": best.correction, **{k: v for k, v in rule.items() if k != "per_step"},
            "steps": {str(s): {"mean": means[s], **({"diff_to_best": best.differences[s].to_json()}
                                                   if s in best.differences else {}), **per_step.get(str(s), {})}
                      for s in sorted(means)},
            "time": time.time()}


def noise_rule(best: Best, values: dict[int, np.ndarray], noise: EngineNoise | None,
               power: float) -> dict[str, Any]:
    """The MDE rule on top of :func:`best_step`: every other step's MDE (at the family level), bootstrap
    interval, and — when it cannot be told apart from the best — why: its interval (widened by the engine's
    measured noise, with replays) contains 0, or its margin is under the MDE. Returns the record's fields."""
    reasons: dict[str, str] = {}
    per_step: dict[str, dict[str, Any]] = {}
    for step, iv in best.differences.items():
        view = pair_view(values[best.step], values[step], iv.level, noise, power)
        per_step[str(step)] = {"mde": view.verdict.mde, **({"mde_undefined": view.verdict.undefined}
                                                             if view.verdict.undefined else {}),
                               "bootstrap": view.to_json()["bootstrap"]}
        if step in best.tied or not (view.engine_interval or iv).distinguishable:
            reasons[str(step)] = "interval contains 0" if step in best.tied else "engine interval contains 0"
        elif view.verdict.below:
            reasons[str(step)] = f"margin {abs(iv.estimate):.4f} under the MDE {view.verdict.mde:.4f}"
    tied = sorted([best.step, *map(int, reasons)])
    return {"not_distinguishable": tied, "winner": best.step if tied == [best.step] else None, "reasons": reasons,
            "power": power, "engine": noise.to_json() if noise is not None else None, "per_step": per_step}


def render(rec: dict[str, Any], width: int = 10_000) -> str:
    """The decision as text at most ``width`` columns wide: the best step and its interval, the steps not
    distinguishable from it (and whether there is a single winner), then a line per step."""
    iv = rec["interval"]
    head = "best step" if rec.get("winner") is not None else "highest mean (no single winner)"
    lines = [*wrap(f"{head} by {rec['metric']} ({'higher' if rec['higher_is_better'] else 'lower'} is better): "
                   f"{rec['best_step']}  mean {iv['estimate']:.4f} [{iv['low']:.4f}, {iv['high']:.4f}] "
                   f"({iv['level']:.0%}, {iv['n']} prompts)", width),
             *wrap(f"not distinguishable from it: {', '.join(map(str, rec['not_distinguishable']))} "
                   f"({rec['correction']}; MDE at power {rec['power']:.0%})", width),
             *wrap(noise_summary(rec), width),
             *(part for note in (*rec.get("engine_notes", ()), *rec.get("scorer_notes", ()))
               for part in wrap(f"warning: {note}", width)),
             *(part for line in censoring.best_lines(rec.get("censoring"), rec["best_step"]) for part in wrap(line, width))]
    for step, row in rec["steps"].items():
        d = row.get("diff_to_best")
        diff = f"  diff {d['estimate']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]" if d else "  (best)"
        extra = f"  {mde_text(row['mde'], row.get('mde_undefined'))}" if "mde" in row else ""
        why = f"  <- {rec['reasons'][step]}" if step in rec["reasons"] else ""
        lines += wrap(f"  step {step:>8}  mean {row['mean']:.4f}{diff}{extra}{why}", width)
    return "\n".join(lines)


def noise_summary(rec: dict[str, Any]) -> str:
    """The line saying whether there is a single winner, and what the engine's noise was."""
    engine = rec["engine"]
    measured = (f"engine noise from {engine['pairs']} replays: shared sd {engine['shared_var'] ** 0.5:.4f}, "
                f"{engine['changed']:.1%} of prompts changed" if engine else "engine noise not measured (no replays)")
    if rec["winner"] is not None:
        return f"single winner: step {rec['winner']} ({measured})"
    return (f"no single winner: steps {', '.join(map(str, rec['not_distinguishable']))} cannot be told apart "
            f"({measured})")


def main(argv: list[str]) -> int:
    parser = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, metavar="RUN")
    parser.add_argument("--metric", metavar="M", help="eval/<dataset>[/pass@k|/pass^k|/maj@n] (default: eval/<the run's "
                        "first dataset>)")
    way = parser.add_mutually_exclusive_group()
    way.add_argument("--higher-is-better", dest="higher", action="store_true", default=True,
                     help="the largest mean is best (default)")
    way.add_argument("--lower-is-better", dest="higher", action="store_false", help="the smallest mean is best")
    parser.add_argument("--level", type=float, default=DEFAULT_LEVEL, help="family confidence level (default 0.95)")
    parser.add_argument("--power", type=float, default=DEFAULT_POWER, help="power of the minimum detectable effect "
                        "a margin must reach to name a single winner (default 0.8)")
    parser.add_argument("--json", action="store_true", help="print the decision file's content (RUN/best/<metric>.json)")
    parser.add_argument("--wandb-run-id", metavar="ID", help="also write the result into this wandb run's summary")
    parser.add_argument(ALLOW_FLAG, dest="allow_engine_mismatch", action="store_true",
                        help="rank steps measured on engines of different identities anyway, recorded as notes "
                        "(default: refused, naming the steps and the fields that differ)")
    parser.add_argument(ALLOW_SCORER_FLAG, dest="allow_scorer_mismatch", action="store_true",
                        help="rank steps scored by scorers of different identities anyway, recorded as notes "
                        "(default: refused, naming the steps and the fields that differ)")
    args = parser.parse_args(argv)
    for flag in ("level", "power"):
        if not 0.0 < getattr(args, flag) < 1.0:
            parser.error(f"--{flag} must be in (0, 1), got {getattr(args, flag)}")
    try:
        side = open_run(args.run)
        metric = parse_metric(args.metric or default_metric(side.manifest), side.manifest)
        values = {s: side.values(s, metric) for s in side.steps_with(metric.dataset)}
        if not values:
            raise ValueError(f"{side.run.path}: no step has a complete {metric.dataset} point yet")
        notes = check_engines([(f"step {s}", point_engine(side, s, metric.dataset)) for s in sorted(values)],
                              args.allow_engine_mismatch)
        scorer_notes = check_scorers([(f"step {s}", point_scorer(side, s, metric.dataset)) for s in sorted(values)],
                                     args.allow_scorer_mismatch)
        best = best_step(values, higher_is_better=args.higher, level=args.level)
        rule = noise_rule(best, values, engine_noise(side.replay_pairs(metric)), args.power)
        cut = censoring.for_best(side, metric.dataset, best, args.level) if metric.kind == "mean" and args.higher else None
    except (ValueError, FileNotFoundError) as e:
        return fail(PROG, e)
    rec = best_record(best, metric.name, args.higher, {s: float(v.mean()) for s, v in values.items()}, rule)
    if notes:
        rec["engine_notes"] = notes
    if scorer_notes:
        rec["scorer_notes"] = scorer_notes
    if cut is not None:
        rec["censoring"] = cut
    target = side.run.best_path(metric.name)
    target.parent.mkdir(exist_ok=True)
    write_json_atomic(target, rec)
    if args.wandb_run_id:
        try:
            write_wandb_summary(side.run.path, args.wandb_run_id, rec)
        except RuntimeError as e:
            return fail(PROG, e)
    print(json.dumps(rec) if args.json else render(rec, output_width()))
    return 0


def write_wandb_summary(run_dir: Path, run_id: str, rec: dict[str, Any]) -> None:
    """The decision into the training run's wandb summary (RuntimeError without wandb installed)."""
    from ckpteval.jobs.metrics import init_wandb

    wb = init_wandb(run_dir, run_id, {}, join="shared", label="ckpteval-best")
    iv = rec["interval"]
    wb.summary.update({"best/step": rec["best_step"], "best/metric": rec["metric"], "best/mean": iv["estimate"],
                       "best/low": iv["low"], "best/high": iv["high"],
                       "best/not_distinguishable": rec["not_distinguishable"]})
    wb.finish()
