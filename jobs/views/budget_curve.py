"""Length-budget curves: each step's score as if generated with ``max_new_tokens = N``, for every budget
``ckpteval rescore --budget N`` cut the kept completions at, plus the point as generated (at the set's own
``max_new_tokens``). Drawn by ``ckpteval plot`` (``<out>.budget.<ext>``) and logged to wandb with
``--wandb-run-id`` (docs/USER_GUIDE.md "Length-budget curves"). Limits: a step is drawn only at the budgets
whose scoring re-scored all of its units (an incomplete scoring's point is not complete).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckpteval.coord.entries import scored_per_sample
from ckpteval.coord.results.files import ResultIndex
from ckpteval.coord.results.points import derive_point
from ckpteval.coord.results.scorings import budget_scorings, open_scoring
from ckpteval.coord.run.rundir import RunDir

Curves = dict[str, dict[int, list[tuple[int, float]]]]  # dataset -> step -> [(budget, score)], budgets ascending


def budget_curves(run_dir: Path) -> Curves:
    """Every generate/env dataset's curve per complete step (module docstring); ``{}`` without budget scorings."""
    run = RunDir.open(run_dir)
    manifest = run.manifest()
    scorings = budget_scorings(run)
    if not scorings:
        return {}
    own = ResultIndex(run.results, manifest)
    steps = sorted({u.step for u in own.refresh()})
    curves: Curves = {}
    sources = [(budget, ResultIndex(open_scoring(run, name) / "results", manifest))
               for budget, name in sorted(scorings.items())]
    for _, cut in sources:
        cut.refresh()
    for step in steps:
        whole = derive_point(manifest, step, own.for_step(step))
        if not whole.complete:
            continue
        for budget, cut in sources:
            point = derive_point(manifest, step, {**own.for_step(step), **cut.for_step(step)})
            for ds, score in point.datasets.items():
                if budget < _cap(manifest.entry(ds)) and _rescored(own, cut, step, ds):
                    curves.setdefault(ds, {}).setdefault(step, []).append((budget, score.score))
        for ds, score in whole.datasets.items():
            if ds in curves and step in curves[ds]:
                curves[ds][step].append((_cap(manifest.entry(ds)), score.score))
    return curves


def _cap(entry: Any) -> float:
    """The set's own generation cap (infinite for a set without one: never cut)."""
    cap = getattr(entry, "max_new_tokens", None) if scored_per_sample(entry) else None
    return float("inf") if cap is None else cap


def _rescored(own: ResultIndex, cut: ResultIndex, step: int, dataset: str) -> bool:
    """The scoring re-scored every ok unit of ``dataset`` at ``step`` (else its point would mix cut and uncut)."""
    mine = [u for u, r in own.for_step(step).items() if u.dataset == dataset and r.ok and not u.replay]
    done = cut.for_step(step)
    return bool(mine) and all(u in done for u in mine)


def curve_figure(curves: Curves, title: str, most: int = 8) -> Any:
    """Score against token budget, a panel per dataset, a line per step (at most ``most``: evenly spread, the
    last always)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5 * len(curves), 4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(curves), squeeze=False)[0]
    for ax, (ds, by_step) in zip(axes, sorted(curves.items()), strict=True):
        steps = sorted(by_step)
        shown = sorted({steps[round(i * (len(steps) - 1) / max(most - 1, 1))] for i in range(min(most, len(steps)))})
        for step in shown:
            budgets, scores = zip(*by_step[step], strict=True)
            ax.plot(budgets, scores, marker="o", label=f"step {step}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("token budget (max_new_tokens)")
        ax.set_ylabel("score")
        ax.set_title(f"{title}: {ds}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def budget_path(out: Path) -> Path:
    """Where ``ckpteval plot -o OUT`` writes the budget curves: ``OUT`` with ``.budget`` before its suffix."""
    return out.with_name(f"{out.stem}.budget{out.suffix}")


def write_wandb_curves(run_dir: Path, run_id: str, curves: Curves) -> None:
    """Each dataset's curves into that wandb run (shared writer): a table ``eval/<ds>/budget_curve`` (step,
    budget, score) and its line chart, one line per step; RuntimeError without wandb installed."""
    from ckpteval.jobs.metrics import init_wandb

    wb = init_wandb(run_dir, run_id, {}, join="shared", label="ckpteval-plot")
    import wandb

    for ds, by_step in sorted(curves.items()):
        rows = [[step, budget, score] for step, points in sorted(by_step.items()) for budget, score in points]
        table = wandb.Table(columns=["step", "budget", "score"], data=rows)
        steps = sorted(by_step)
        chart = wandb.plot.line_series(xs=[[b for b, _ in by_step[s]] for s in steps],
                                       ys=[[v for _, v in by_step[s]] for s in steps], keys=[f"step {s}" for s in steps],
                                       title=f"{ds}: score vs token budget", xname="token budget")
        wb.log({f"eval/{ds}/budget_curve": table, f"eval/{ds}/budget_curve_chart": chart})
    wb.finish()
