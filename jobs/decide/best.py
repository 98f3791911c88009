"""``ckpteval best RUN [--metric eval/<ds>[/pass@k|/maj@n]]``: which checkpoint to ship (default metric:
the run's first dataset's mean).

The best step by the metric (``--higher-is-better``, the default, or ``--lower-is-better``), its
interval, and every step *not distinguishable from it*: each other step's paired difference to the
best (per-prompt differences, paired t interval), Bonferroni-corrected for the number of steps
compared, contains 0 (:func:`ckpteval.jobs.decide.stats.best_step`). Steps measured on engines of
different identities are refused, naming them and the fields that differ, unless ``--allow-engine-mismatch``
(then recorded as ``engine_notes``). Written to ``RUN/best/<metric>.json`` (atomic; ``/`` written ``__``: one file per metric) and
printed; ``--json`` prints the file's content; ``--wandb-run-id ID`` also writes it into that wandb
run's summary (``best/step``, ``best/mean``, ``best/low``, ``best/high``, ``best/not_distinguishable``,
``best/metric``) as a shared writer (:func:`ckpteval.jobs.metrics.init_wandb`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import write_json_atomic
from ckpteval.jobs.decide.data import open_run, parse_metric
from ckpteval.jobs.decide.engines import ALLOW_FLAG, check_engines, point_engine
from ckpteval.jobs.decide.stats import DEFAULT_LEVEL, Best, best_step
from ckpteval.jobs.flags import Parser, fail

PROG = "ckpteval best"


def best_record(best: Best, metric: str, higher: bool, means: dict[int, float]) -> dict[str, Any]:
    """The ``RUN/best/<metric>.json`` content (docs/PROTOCOL.md)."""
    return {"metric": metric, "higher_is_better": higher, "best_step": best.step, "interval": best.interval.to_json(),
            "not_distinguishable": list(best.tied), "correction": best.correction,
            "steps": {str(s): {"mean": means[s], **({"diff_to_best": best.differences[s].to_json()}
                                                   if s in best.differences else {})} for s in sorted(means)},
            "time": time.time()}


def render(rec: dict[str, Any]) -> str:
    iv = rec["interval"]
    lines = [f"best step by {rec['metric']} ({'higher' if rec['higher_is_better'] else 'lower'} is better): "
             f"{rec['best_step']}  mean {iv['estimate']:.4f} [{iv['low']:.4f}, {iv['high']:.4f}] "
             f"({iv['level']:.0%}, {iv['n']} prompts)",
             f"not distinguishable from it: {', '.join(map(str, rec['not_distinguishable']))} ({rec['correction']})",
             *(f"warning: {note}" for note in rec.get("engine_notes", ()))]
    for step, row in rec["steps"].items():
        d = row.get("diff_to_best")
        diff = f"  diff {d['estimate']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]" if d else "  (best)"
        lines.append(f"  step {step:>8}  mean {row['mean']:.4f}{diff}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, metavar="RUN")
    parser.add_argument("--metric", metavar="M", help="eval/<dataset>[/pass@k|/maj@n] (default: eval/<the run's "
                        "first dataset>)")
    way = parser.add_mutually_exclusive_group()
    way.add_argument("--higher-is-better", dest="higher", action="store_true", default=True,
                     help="the largest mean is best (default)")
    way.add_argument("--lower-is-better", dest="higher", action="store_false", help="the smallest mean is best")
    parser.add_argument("--level", type=float, default=DEFAULT_LEVEL, help="family confidence level (default 0.95)")
    parser.add_argument("--json", action="store_true", help="print the decision file's content (RUN/best/<metric>.json)")
    parser.add_argument("--wandb-run-id", metavar="ID", help="also write the result into this wandb run's summary")
    parser.add_argument(ALLOW_FLAG, dest="allow_engine_mismatch", action="store_true",
                        help="rank steps measured on engines of different identities anyway, recorded as notes "
                        "(default: refused, naming the steps and the fields that differ)")
    args = parser.parse_args(argv)
    if not 0.0 < args.level < 1.0:
        parser.error(f"--level must be in (0, 1), got {args.level}")
    try:
        side = open_run(args.run)
        metric = parse_metric(args.metric or f"eval/{side.manifest.eval.datasets[0].name}", side.manifest)
        values = {s: side.values(s, metric) for s in side.steps_with(metric.dataset)}
        if not values:
            raise ValueError(f"{side.run.path}: no step has a complete {metric.dataset} point yet")
        notes = check_engines([(f"step {s}", point_engine(side, s, metric.dataset)) for s in sorted(values)],
                              args.allow_engine_mismatch)
        best = best_step(values, higher_is_better=args.higher, level=args.level)
    except (ValueError, FileNotFoundError) as e:
        return fail(PROG, e)
    rec = best_record(best, metric.name, args.higher, {s: float(v.mean()) for s, v in values.items()})
    if notes:
        rec["engine_notes"] = notes
    target = side.run.best_path(metric.name)
    target.parent.mkdir(exist_ok=True)
    write_json_atomic(target, rec)
    if args.wandb_run_id:
        try:
            write_wandb_summary(side.run.path, args.wandb_run_id, rec)
        except RuntimeError as e:
            return fail(PROG, e)
    print(json.dumps(rec) if args.json else render(rec))
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
