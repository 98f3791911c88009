"""``ckpteval plot RUN [RUN ...] -o curve.png``: score vs step per dataset, skips marked, lag below (when
there is lag); several runs are overlaid on one step axis, a colour per run.

The plotted series are exactly the derived points (ckpteval.coord.results.files.derive_point) of complete steps;
:func:`plot_series` returns them so a test can check the picture shows what the run says. Each
dataset's pooled mean is drawn with a band of ± its standard error over prompts, and its pass@k /
maj@n (when it has them) as dashed lines of the same colour; a generated set's mean completion and
reasoning tokens and its truncated / no-answer shares in a length panel below (:data:`LENGTH_SERIES`).
A dataset evaluated every few points
(its ``every``) is drawn at exactly the steps it was evaluated at.
Matplotlib runs headless (Agg). Limits: incomplete points are not drawn.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from ckpteval.coord.results.scorings import scoring_label
from ckpteval.jobs.flags import Parser, add_run_dir_argument, fail, run_dirs_from_args
from ckpteval.jobs.views.budget_curve import budget_curves, budget_path, curve_figure, write_wandb_curves
from ckpteval.jobs.views.status.main import collect_status

FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "webp", "eps")
_STYLES = ("--", ":", "-.")
_MARKERS = ("^", "v", "s")
_DS_MARKERS = ("o", "s", "D", "P", "X")  # several runs: a marker per dataset


def plot_series(status: dict[str, Any]) -> dict[str, Any]:
    """The data the figure draws: per dataset and lm-eval metric (steps, values), its stderr band (steps, low,
    high: finite ones only), its derived series ``"<ds> <key>"`` (steps, values), skipped (step, reasons), lag."""
    names = list(status["datasets"]) + list(status.get("harness_metrics", []))
    series: dict[str, tuple[list[int], list[float]]] = {name: ([], []) for name in names}
    bands: dict[str, tuple[list[int], list[float], list[float]]] = {ds: ([], [], []) for ds in status["datasets"]}
    derived: dict[str, tuple[list[int], list[float]]] = {}
    lengths: dict[str, tuple[list[int], list[float]]] = {}  # "<ds> <extra>" of LENGTH_SERIES
    skipped: list[tuple[int, str]] = []
    lag: tuple[list[int], list[float]] = ([], [])
    for p in status["points"]:
        if not p["complete"]:
            continue
        for ds, d in p["datasets"].items():
            if d.get("kind") == "lm_eval":  # its metrics: the "<task>/<metric>" series below
                continue
            series[ds][0].append(p["step"])
            series[ds][1].append(d["score"])
            se = d.get("stderr")
            if isinstance(se, float) and math.isfinite(se):
                bands[ds][0].append(p["step"])
                bands[ds][1].append(d["score"] - se)
                bands[ds][2].append(d["score"] + se)
            for key, value in d.get("derived", {}).items():
                steps, values = derived.setdefault(f"{ds} {key}", ([], []))
                steps.append(p["step"])
                values.append(value)
            for key in (k for k in LENGTH_SERIES if k in d.get("extras", {})):
                steps, values = lengths.setdefault(f"{ds} {key}", ([], []))
                steps.append(p["step"])
                values.append(d["extras"][key])
        for name in status.get("harness_metrics", []):  # lm-eval tasks: "<task>/<metric>"
            task, _, metric = name.partition("/")
            if metric in (m := p["datasets"].get(task, {}).get("metrics", {})):
                series[name][0].append(p["step"])
                series[name][1].append(m[metric])
        if p["skips"]:
            skipped.append((p["step"], ",".join(sorted(p["skips"]))))
        if p["lag_steps"] is not None:
            lag[0].append(p["step"])
            lag[1].append(p["lag_steps"])
    return {"series": series, "bands": bands, "derived": derived, "lengths": lengths, "skipped": skipped, "lag": lag}


def figure(data: dict[str, Any] | list[tuple[str, dict[str, Any]]], title: str) -> Any:
    """The matplotlib figure of :func:`plot_series`'s data — one run's, or several ``(label, data)``
    runs overlaid on the same step axis (one colour per run; its datasets told apart by marker, each
    label ``"<run> <dataset>"``): scores on top (legend outside the axes, so it never covers a point),
    the lag panel below only when a run has lag (a trainer ingested its points; service and backfill
    runs have none)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # headless; no pyplot (no global figures)
    from matplotlib.figure import Figure

    runs = [("", data)] if isinstance(data, dict) else data
    has_lag = any(d["lag"][0] for _, d in runs)
    has_len = any(d.get("lengths") for _, d in runs)
    ratios = [3] + [1.5] * has_len + [1] * has_lag
    fig = Figure(figsize=(9, 4.5 + 2 * has_len + 1.5 * has_lag))
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(len(ratios), 1, sharex=True, gridspec_kw={"height_ratios": ratios})) if len(ratios) > 1 \
        else [fig.subplots(1, 1)]
    ax, ax_lag = axes[0], axes[-1]
    if has_len:
        _draw_lengths(axes[1], runs)
    for i, (label, d) in enumerate(runs):
        _draw_scores(ax, d, label, f"C{i}" if len(runs) > 1 else None, 0.02 + 0.33 * (i % 3))
    ax.set_ylabel("score")
    values = [s for _, d in runs for _, scores in [*d["series"].values(), *d.get("derived", {}).values()]
              for s in scores if not math.isnan(s)]
    if all(0 <= s <= 1 for s in values):
        ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if has_lag:
        width = max(1, _min_gap(sorted({s for _, d in runs for s in d["lag"][0]})) * 0.6) / len(runs)
        for i, (_, d) in enumerate(runs):  # several runs: bars side by side, each in its run's colour
            offset = (i - (len(runs) - 1) / 2) * width
            ax_lag.bar([s + offset for s in d["lag"][0]], d["lag"][1], width=width,
                       color=f"C{i}" if len(runs) > 1 else "gray")
        ax_lag.set_ylabel("lag (steps)")
        ax_lag.grid(alpha=0.3)
    axes[-1].set_xlabel("training step")
    _integer_steps(ax, runs)
    fig.tight_layout()
    fig.set_layout_engine(None)  # laid out once: savefig need not draw the whole figure an extra time first
    return fig


def _draw_scores(ax: Any, data: dict[str, Any], run: str, colour: str | None, note_y: float) -> None:
    """One run's score lines, ± stderr bands, derived lines and skip marks (their note at ``note_y`` of
    the axes' height, so runs skipping the same step don't print over each other). ``colour`` None: a
    colour per dataset (one run); else the run's colour, its datasets told apart by marker."""
    prefix = f"{run} " if run else ""
    for j, (ds, (steps, scores)) in enumerate(data["series"].items()):
        marker = "o" if colour is None else _DS_MARKERS[j % len(_DS_MARKERS)]
        (line,) = ax.plot(steps, scores, marker=marker, color=colour, label=f"{prefix}{ds}")
        b_steps, low, high = data.get("bands", {}).get(ds, ([], [], []))
        if b_steps:
            ax.fill_between(b_steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        mine = [(name, xy) for name, xy in data.get("derived", {}).items() if name.startswith(f"{ds} ")]
        for i, (name, (d_steps, values)) in enumerate(mine):
            ax.plot(d_steps, values, linestyle=_STYLES[i % len(_STYLES)], marker=_MARKERS[i % len(_MARKERS)],
                    markersize=4, color=line.get_color(), alpha=0.8, label=f"{prefix}{name}")
    for step, reasons in data["skipped"]:
        ax.axvline(step, color=colour or "red", alpha=0.3, linestyle="--")
        ax.annotate(f"{prefix}skipped: {reasons}", (step, note_y), rotation=90, fontsize=7, color=colour or "red",
                    xycoords=("data", "axes fraction"))


LENGTH_SERIES = {"completion_tokens": ("tokens", "-"), "reasoning_tokens": ("tokens", "--"),
                 "truncated": ("share", ":"), "no_answer": ("share", "-.")}
"""The generation numbers drawn in the length panel: mean tokens on its left axis, shares on its right."""


def _draw_lengths(ax: Any, runs: list[tuple[str, dict[str, Any]]]) -> None:
    """The length panel: per dataset its mean completion (solid) and reasoning (dashed) tokens, and on a
    right-hand axis in [0, 1] its truncated (dotted) and no-answer (dash-dot) shares."""
    share = ax.twinx()
    for i, (label, d) in enumerate(runs):
        prefix = f"{label} " if label else ""
        colours: dict[str, str] = {}
        for name, (steps, values) in d.get("lengths", {}).items():
            ds, key = name.rsplit(" ", 1)
            axis, style = LENGTH_SERIES[key]
            colour = f"C{i}" if len(runs) > 1 else colours.setdefault(ds, f"C{list(d['series']).index(ds) % 10}")
            (share if axis == "share" else ax).plot(steps, values, linestyle=style, marker=".", color=colour,
                                                    label=f"{prefix}{name}")
    ax.set_ylabel("mean tokens")
    share.set_ylabel("share")
    share.set_ylim(-0.02, 1.02)
    handles = ax.get_legend_handles_labels()
    more = share.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="upper left", bbox_to_anchor=(1.08, 1.0),
              borderaxespad=0.0, fontsize=7)
    ax.grid(alpha=0.3)


def _integer_steps(ax: Any, runs: list[tuple[str, dict[str, Any]]]) -> None:
    """Steps are integers: whole-number ticks only, and a single step is centred in a window around it
    (matplotlib's default for one x value is ±0.04 — fractional ticks)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    steps = {s for _, d in runs for xs, _ys in d["series"].values() for s in xs}
    steps |= {s for _, d in runs for s, _why in d["skipped"]}
    if len(steps) == 1:
        (step,) = steps
        ax.set_xlim(step - 1, step + 1)


def draw(data: dict[str, Any] | list[tuple[str, dict[str, Any]]], out: Path, title: str) -> None:
    figure(data, title).savefig(out, dpi=100)  # no pyplot: nothing to close


def _min_gap(steps: list[int]) -> float:
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False) if b > a]
    return min(gaps) if gaps else 1


def plot_run(run_dir: Path, out: Path, scoring: str | None = None, wandb_run_id: str | None = None) -> dict[str, Any]:
    """One run's curve into ``out``; with budget scorings (``rescore --budget``) its length-budget curves into
    :func:`budget_path` too (and, with ``wandb_run_id``, into that wandb run). ``data["budget"]``: those curves."""
    status = collect_status(run_dir, scoring)
    data = plot_series(status)
    draw(data, out, f"ckpteval run {status['run_id']}{scoring_label(scoring)}")
    data["budget"] = budget_curves(run_dir)
    if data["budget"]:
        curve_figure(data["budget"], f"ckpteval run {status['run_id']}").savefig(budget_path(out), dpi=100)
        if wandb_run_id:
            write_wandb_curves(run_dir, wandb_run_id, data["budget"])
    return data


def plot_runs(run_dirs: list[Path], out: Path, scoring: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Several runs overlaid, aligned by step; each labelled by its run id (by its dir as given when
    two runs share an id). Returns the ``(label, data)`` pairs drawn."""
    statuses = [collect_status(d, scoring) for d in run_dirs]
    ids = [s["run_id"] for s in statuses]
    labels = ids if len(set(ids)) == len(ids) else [str(d) for d in run_dirs]
    runs = [(label, plot_series(s)) for label, s in zip(labels, statuses, strict=True)]
    draw(runs, out, "ckpteval runs " + ", ".join(labels) + scoring_label(scoring))
    return runs


def check_output(out: Path) -> None:
    """``-o FILE`` is writable and names a format, checked before the run is read."""
    if out.suffix.lower().lstrip(".") not in FORMATS:
        raise ValueError(f"--output {out}: unknown image format {out.suffix!r}; use one of {', '.join(FORMATS)}")
    if out.is_dir():
        raise ValueError(f"--output {out}: is a directory")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"--output {out}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ValueError(f"--output {out}: not writable by this user")


def main(argv: list[str]) -> int:
    ap = Parser(prog="ckpteval plot", description="plot score vs step per dataset (PNG, PDF, SVG, ...)")
    add_run_dir_argument(ap, many=True)
    ap.add_argument("-o", "--output", type=Path, default=None, metavar="FILE",
                    help="image to write; the suffix picks the format: " + ", ".join(FORMATS)
                    + " (default: curve.png in the (first) run dir)")
    ap.add_argument("--scoring", metavar="NAME", help="plot this ckpteval rescore scoring's scores where it re-scored "
                    "a unit (default: the scores as generated); the title names it")
    ap.add_argument("--wandb-run-id", metavar="ID", help="also log one run's length-budget curves (rescore --budget) "
                    "into this wandb run")
    args = ap.parse_args(argv)
    run_dirs = run_dirs_from_args(ap, args)
    if args.output is None:  # beside the run it plots, never the working dir (one run's curve over another's)
        args.output = Path(run_dirs[0]) / "curve.png"
    try:
        check_output(args.output)
        if len(run_dirs) == 1:
            data = plot_run(run_dirs[0], args.output, args.scoring, args.wandb_run_id)
        else:
            plot_runs(run_dirs, args.output, args.scoring)
            data = {}
    except (OSError, ValueError, RuntimeError) as e:  # bad run files; unwritable output; wandb missing
        return fail("ckpteval plot", e)
    print(args.output)
    if data.get("budget"):
        print(budget_path(args.output))
    return 0
