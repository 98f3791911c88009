"""``ckpteval compare``: is one step (or run) better than another, or is the difference noise?

Two forms: ``ckpteval compare RUN --steps A B`` (two steps of one run) and ``ckpteval compare RUN_A
RUN_B [--step S | --best --metric M]`` (the same step of two runs — the newest step both have by
default — or each run's best step by ``M``). For every dataset both sides have, it prints the
difference ``B - A`` of the mean score with a paired confidence interval over prompts
(:func:`ckpteval.jobs.decide.stats.paired_interval`: per-prompt differences, paired t interval, two-sided)
and says "not distinguishable from noise" when the interval contains 0. Beside it: the bootstrap interval
(prompts resampled, clustered over their samples) and the difference's **minimum detectable effect** at
``--power`` (:mod:`ckpteval.jobs.decide.noise`): a difference under it is said to be "below the MDE". When the
runs have replays (``eval.replay``) the engine's measured shared noise is in the MDE and widens the
interval the verdict is read from (``engine interval``). ``--json`` prints the same as JSON. Bad input
(unknown step, a dataset that is not paired) is one line, exit 2. Two points measured on engines of different
identities are refused, naming the fields that differ, unless ``--allow-engine-mismatch``
(:mod:`ckpteval.jobs.decide.engines`); so are two points scored by scorers of different identities, unless
``--allow-scorer-mismatch`` (:mod:`ckpteval.jobs.decide.scorers`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.decide import censoring
from ckpteval.jobs.decide.budget import budget_scoring
from ckpteval.jobs.decide.data import Metric, RunValues, check_paired, default_metric, open_run, parse_metric
from ckpteval.jobs.decide.engines import ALLOW_FLAG, check_engines, point_engine
from ckpteval.jobs.decide.noise import (
    DEFAULT_POWER,
    EngineNoise,
    effective_df,
    engine_noise,
    mde_text,
    pair_view,
)
from ckpteval.jobs.decide.scorers import ALLOW_SCORER_FLAG, check_scorers, point_scorer
from ckpteval.jobs.decide.stats import DEFAULT_LEVEL, best_step, paired_interval, t_quantile
from ckpteval.jobs.flags import Parser, fail, output_width, wrap

PROG = "ckpteval compare"


def verdict(low: float, high: float) -> str:
    if low > 0:
        return "B better"
    if high < 0:
        return "A better"
    return "not distinguishable from noise"


def side_noise(a: RunValues, b: RunValues, metric: Metric) -> EngineNoise | None:
    """The engine noise replays measured for ``metric``: of the one run, or of two runs the larger shared
    variance (None when neither has replays of it)."""
    sides = [a] if a is b else [a, b]
    found = [n for n in (engine_noise(s.replay_pairs(metric)) for s in sides) if n is not None]
    return max(found, key=lambda n: n.shared_var) if found else None


def noise_fields(va: Any, vb: Any, level: float, noise: EngineNoise | None, power: float,
                 verdict_now: str) -> dict[str, Any]:
    """The MDE, bootstrap and (with replays) engine-widened interval of one compared row, and the verdict
    read from the widened interval."""
    view = pair_view(va, vb, level, noise, power)
    out: dict[str, Any] = view.to_json()
    if noise is not None and view.engine_interval is not None:
        out["engine"] = noise.to_json()
        if verdict_now != "not distinguishable from noise" and not view.engine_interval.distinguishable:
            out["verdict"] = "not distinguishable from engine noise"
    return out


def compare_sides(a: RunValues, step_a: int, b: RunValues, step_b: int, level: float,
                  metric_text: str | None = None, power: float = DEFAULT_POWER,
                  allow_engine_mismatch: bool = False, allow_scorer_mismatch: bool = False) -> list[dict[str, Any]]:
    """Per dataset both sides have at their steps: the paired difference B - A of the mean and its verdict;
    with ``metric_text`` (``--metric``) only that metric of its dataset. Points of different engine
    identities are refused (:func:`ckpteval.jobs.decide.engines.check_engines`) unless ``allow_engine_mismatch``,
    of different scorer identities (:func:`ckpteval.jobs.decide.scorers.check_scorers`) unless ``allow_scorer_mismatch``."""
    rows = []
    chosen = None if metric_text is None else parse_metric(metric_text, a.manifest)
    for spec in a.manifest.eval.entries:  # an entry without per-sample points has no steps_with
        name = spec.name
        if chosen is not None and name != chosen.dataset:
            continue
        if name not in {d.name for d in b.manifest.eval.entries}:
            continue
        if step_a not in a.steps_with(name) or step_b not in b.steps_with(name):
            continue
        if a is not b:
            check_paired(a, b, name)
        notes = check_engines([(f"A step {step_a}", point_engine(a, step_a, name)),
                               (f"B step {step_b}", point_engine(b, step_b, name))], allow_engine_mismatch)
        scorer_notes = check_scorers([(f"A step {step_a}", point_scorer(a, step_a, name)),
                                      (f"B step {step_b}", point_scorer(b, step_b, name))], allow_scorer_mismatch)
        metric = chosen or Metric(name, "mean")
        va, vb = a.values(step_a, metric), b.values(step_b, metric)
        iv = paired_interval(va, vb, level)
        row = {"dataset": name if chosen is None else metric_text, "a": float(va.mean()), "b": float(vb.mean()), "diff": iv.estimate,
               "low": iv.low, "high": iv.high, "n_prompts": iv.n, "level": level,
               "verdict": verdict(iv.low, iv.high), **({"engine_notes": notes} if notes else {}),
               **({"scorer_notes": scorer_notes} if scorer_notes else {})}
        if metric.kind == "mean":  # the cut-off answers' part in it (jobs.decide.censoring)
            row.update(censoring.for_compare(a, step_a, b, step_b, name, level))
        rows.append({**row, **noise_fields(va, vb, level, side_noise(a, b, metric), power, row["verdict"])})
    if not rows:
        raise ValueError(f"no dataset has a complete point at step {step_a} of {a.run.path} and step {step_b} "
                         f"of {b.run.path}")
    return rows


def _common_newest(a: RunValues, b: RunValues) -> int:
    steps = {s for d in a.manifest.eval.entries for s in a.steps_with(d.name)}
    steps &= {s for d in b.manifest.eval.entries for s in b.steps_with(d.name)}
    if not steps:
        raise ValueError(f"{a.run.path} and {b.run.path} have no step with a complete point in common; give --step")
    return max(steps)


def _best_of(side: RunValues, metric_text: str | None, level: float) -> int:
    metric_text = metric_text or default_metric(side.manifest)
    metric: Metric = parse_metric(metric_text, side.manifest)
    values = {s: side.values(s, metric) for s in side.steps_with(metric.dataset)}
    return best_step(values, level=level).step


def plan(args: Any) -> tuple[RunValues, int, RunValues, int]:
    """(side A, its step, side B, its step) from the parsed flags."""
    if len(args.runs) == 1:
        if args.steps is None or args.step is not None or args.best:
            raise ValueError("one run: give --steps A B (two steps of it); --step/--best compare two runs")
        scoring = args.scoring
        if args.budget is not None:  # jobs.decide.budget: the kept completions cut at --budget tokens
            scoring = args.scoring = budget_scoring(RunDir.open(args.runs[0]), args.budget, list(args.steps))
        side = open_run(args.runs[0], scoring)
        return side, args.steps[0], side, args.steps[1]
    if len(args.runs) != 2:
        raise ValueError(f"give one run (with --steps A B) or two runs, got {len(args.runs)}")
    if args.steps is not None:
        raise ValueError("--steps A B compares two steps of one run; for two runs give --step S or --best")
    if args.budget is not None:
        raise ValueError("--budget compares two steps of one run (--steps A B)")
    a, b = open_run(args.runs[0], args.scoring), open_run(args.runs[1], args.scoring)
    if args.best:
        return a, _best_of(a, args.metric, args.level), b, _best_of(b, args.metric, args.level)
    step = args.step if args.step is not None else _common_newest(a, b)
    return a, step, b, step


def render(rows: list[dict[str, Any]], a: str, b: str, width: int = 10_000) -> str:
    """The comparison as text at most ``width`` columns wide (a path longer than it stays whole): a row per
    dataset when that fits, else two lines per dataset (the numbers, then prompts and verdict); each followed
    by its noise line (:func:`noise_line`)."""
    lines = [*wrap(f"A = {a}", width), *wrap(f"B = {b}", width)]
    head = f"{'dataset':<16} {'A':>8} {'B':>8} {'B - A':>9}  {'interval':<21} {'prompts':>7}  verdict"
    wide = [f"{r['dataset']:<16} {r['a']:8.4f} {r['b']:8.4f} {r['diff']:+9.4f}  {_span(r):<21} "
            f"{r['n_prompts']:>7}  {r['verdict']}" for r in rows]
    if max(len(line) for line in [head, *wide]) <= width:
        lines.append(head)
        for r, line in zip(rows, wide, strict=True):
            lines += [line, *wrap(f"{'':<16} {noise_line(r)}", width)]
            lines += wrap(f"{'':<16} {r['censoring_note']}", width) if r.get("censoring_note") else []
    else:
        for r in rows:
            lines += wrap(f"{r['dataset']}: A {r['a']:.4f}, B {r['b']:.4f}, B - A {r['diff']:+.4f} {_span(r)}", width)
            lines += wrap(f"  over {r['n_prompts']} prompts: {r['verdict']}", width)
            lines += wrap(f"  {noise_line(r)}", width)
            lines += wrap(f"  {r['censoring_note']}", width) if r.get("censoring_note") else []
    lines += wrap(f"(paired t interval over per-prompt differences, {rows[0]['level']:.0%} two-sided; MDE at power "
                  f"{rows[0]['power']:.0%})", width)
    lines += [part for r in rows for note in (*r.get("engine_notes", ()), *r.get("scorer_notes", ()))
              for part in wrap(f"warning: {r['dataset']}: {note}", width)]
    return "\n".join(lines)


def _span(row: dict[str, Any]) -> str:
    return f"[{row['low']:+.4f}, {row['high']:+.4f}]"


def noise_line(r: dict[str, Any]) -> str:
    """What follows a compared row: bootstrap interval, MDE, engine-widened interval."""
    boot = r["bootstrap"]
    text = (f"bootstrap [{boot['low']:+.4f}, {boot['high']:+.4f}]  {mde_text(r['mde'], r.get('mde_undefined'))}"
            f"{' (difference below the MDE)' if r['below_mde'] else ''}")
    if "engine_interval" in r:
        wide, pairs = r["engine_interval"], r["engine"]["pairs"]
        return text + (f"  engine interval [{wide['low']:+.4f}, {wide['high']:+.4f}] ({pairs} replay "
                       f"pair{'s' if pairs != 1 else ''}{few_pairs_note(r['engine'], r['n_prompts'], r['level'])})")
    return text + "  (engine noise not measured: no replays)"


def few_pairs_note(engine: dict[str, Any], prompts: int, level: float) -> str:
    """Why the engine interval is wide with few replay pairs (empty once its t is within 1.3x of the prompts'
    own; :func:`ckpteval.jobs.decide.noise.effective_df`)."""
    p, pairs = 0.5 + level / 2, engine["pairs"] if engine["changed"] > 0 else 0
    widen = t_quantile(p, effective_df(prompts, pairs)) / t_quantile(p, effective_df(prompts))
    return "" if widen <= 1.3 else (f": t at {pairs} df, {widen:.1f}x the prompts' own; 6 or more pairs bring it "
                                    "within 1.3x")


def main(argv: list[str]) -> int:
    parser = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="one run (with --steps) or two runs")
    parser.add_argument("--steps", nargs=2, type=int, metavar=("A", "B"), help="two steps of one run")
    parser.add_argument("--step", type=int, metavar="S", help="two runs: this step of each (default: newest in common)")
    parser.add_argument("--best", action="store_true", help="two runs: each run's best step by --metric")
    parser.add_argument("--metric", metavar="M", help="compare this metric only (eval/<dataset>[/pass@k|/pass^k|/maj@n]); with --best: "
                        "also what best means (default with --best: eval/<first dataset>)")
    parser.add_argument("--scoring", metavar="NAME", help="compare this ckpteval rescore scoring's scores where it "
                        "re-scored a unit (default: the scores as generated); the output names it")
    parser.add_argument("--budget", type=int, metavar="N", help="one run: compare the two steps as if both had been "
                        "capped at N tokens (the scoring ckpteval rescore --budget N made of their kept completions)")
    parser.add_argument("--level", type=float, default=DEFAULT_LEVEL, help="confidence level (default 0.95)")
    parser.add_argument("--power", type=float, default=DEFAULT_POWER, help="power of the minimum detectable effect "
                        "(default 0.8)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(ALLOW_FLAG, dest="allow_engine_mismatch", action="store_true",
                        help="compare points measured on engines of different identities (engine, version, dtype, "
                        "tp/dp/pp, deterministic mode, concurrency) anyway, with a warning (default: refused, "
                        "naming the fields that differ)")
    parser.add_argument(ALLOW_SCORER_FLAG, dest="allow_scorer_mismatch", action="store_true",
                        help="compare points scored by scorers of different identities (the scorer and its settings, "
                        "judge model, sandbox bounds, chat template arguments, reasoning) anyway, with a warning "
                        "(default: refused, naming the fields that differ)")
    args = parser.parse_args(argv)
    if args.budget is not None and args.scoring is not None:
        parser.error("--budget picks its own scoring (the rescore cut at N tokens); give --budget or --scoring")
    for flag in ("level", "power"):
        if not 0.0 < getattr(args, flag) < 1.0:
            parser.error(f"--{flag} must be in (0, 1), got {getattr(args, flag)}")
    try:
        a, step_a, b, step_b = plan(args)
        rows = compare_sides(a, step_a, b, step_b, args.level, args.metric, args.power, args.allow_engine_mismatch,
                             args.allow_scorer_mismatch)
    except (ValueError, FileNotFoundError, KeyError) as e:
        return fail(PROG, e.args[0] if isinstance(e, KeyError) else e)
    shown = f" (scoring {args.scoring})" if args.scoring else ""
    label_a, label_b = f"{a.run.path} step {step_a}{shown}", f"{b.run.path} step {step_b}{shown}"
    print(json.dumps({"a": label_a, "b": label_b, "datasets": rows}) if args.json else render(rows, label_a, label_b, output_width()))
    return 0
