"""What ``ckpteval status`` prints for one run, fitted to the console's width (``COLUMNS``; 80 when piped).

Guarantee: no line is wider than the width given, except one that holds a single word (a path, a run id)
longer than it: tables fold their cells (:mod:`ckpteval.jobs.views.tables`), a table title longer than its
table is a line of its own above it (never broken inside the run id), and the cost and health lines break
between their ``|`` parts (a part longer than the width between its words). The health line's training
state is its last line, so ``ckpteval status RUN | tail -n 1`` says whether training runs, stopped or is done.

Extension points (small, so additions merge easily): :data:`UNPOOLED` (a point key -> the cell of a dataset
that has no one number), :data:`DATASET_LINES` (per-dataset lines under the points tables) and
:data:`RUN_LINES` (the run's lines at the end: cost, attestation, health).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from rich.cells import cell_len

from ckpteval.coord.results.scorings import scoring_label
from ckpteval.jobs.flags import wrap
from ckpteval.jobs.views.noise import noise_lines
from ckpteval.jobs.views.status.data import stderr_name
from ckpteval.jobs.views.tables import PlainTable

NOT_POOLED = "not pooled: scorers differ"
"""The cell of a dataset whose units were scored differently (two judges): never one number."""

ENGINES_DIFFER = "not pooled: engines differ ({})"
"""The cell of a dataset whose units ran on engines of different identities (``{}``: the fields that differ)."""

UNPOOLED: dict[str, str] = {"mixed_scorers": NOT_POOLED, "mixed_engines": ENGINES_DIFFER}
"""A point's key listing the datasets that have no one number at it -> the cell shown for them (the first
that lists the dataset wins; ``{}`` in the cell: what the key holds for the dataset, e.g. the engine fields)."""


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.{digits}f}"
    return str(x)


def derived_keys(status: dict[str, Any]) -> dict[str, list[str]]:
    """Per dataset, the derived metrics (``pass@k``, ``pass^k``, ``maj@n``) any of its points has, in that order."""
    keys: dict[str, set[str]] = {ds: set() for ds in status["datasets"]}
    for p in status["points"]:
        for ds, d in p["datasets"].items():
            keys.setdefault(ds, set()).update(d.get("derived", {}))

    def order(key: str) -> tuple[int, int]:
        k = key[5:] if key.startswith(("pass@", "pass^")) else key.partition("@")[2]
        return ({"pass@": 0, "pass^": 1}.get(key[:5], 2), int(k) if k.isdigit() else 0)

    return {ds: sorted(ks, key=order) for ds, ks in keys.items()}


def _score_cell(d: dict[str, Any]) -> str:
    se = d.get("stderr")
    if isinstance(se, float) and math.isfinite(se):
        return f"{_fmt(d['score'])}±{se:.3f}"
    return _fmt(d["score"])


LENGTH_CELL = (("truncated", "trunc", 2), ("no_answer", "noans", 2), ("completion_tokens", "tok", 0),
               ("reasoning_tokens", "think", 0))
"""The ``<ds> length`` cell: share cut at the length limit, share with no answer, mean tokens, mean reasoning tokens."""


def _length_cell(d: dict[str, Any]) -> str:
    extras = d.get("extras", {})
    parts = [f"{short}={extras[key]:.{digits}f}" for key, short, digits in LENGTH_CELL if key in extras]
    return " ".join(parts) or "-"


CENSORED_COLUMN = "{} completed-only"
"""The column, shown when some sample of ``<ds>`` was cut at the length limit, of its completed-only score ± its
stderr and the censored share (``DatasetScore.censoring``; docs/USER_GUIDE.md "Cut-off answers (censoring)")."""


def _censored_cell(d: dict[str, Any]) -> str:
    c = d.get("censoring") or {}
    if not c:
        return "-"
    done, se = c.get("completed"), c.get("completed_stderr")
    score = "none completed" if not isinstance(done, float) or math.isnan(done) else _fmt(done)
    spread = f"±{se:.3f}" if isinstance(se, float) and math.isfinite(se) and score != "none completed" else ""
    return f"{score}{spread} cut {c['censored']:.0%}"


def _censored(status: dict[str, Any]) -> set[str]:
    """The datasets some point of which had a sample cut off."""
    return {ds for p in status["points"] for ds, d in p["datasets"].items()
            if (d.get("censoring") or {}).get("censored", 0.0) > 0.0}


def _pin_cells(datasets: list[dict[str, Any]]) -> list[str]:
    """One wv/mean and one mixed cell for all datasets of a point: the common version (each dataset's,
    comma-separated, if they differ) and the largest mixed-version ratio."""
    if not datasets:
        return ["-", "-"]
    means = list(dict.fromkeys(_fmt(d["weight_version_mean"], 1) for d in datasets))
    return [",".join(means), _fmt(max(d["mixed_version_ratio"] for d in datasets), 2)]


def points_table(status: dict[str, Any], datasets: list[str] | None = None, harness: list[str] | None = None,
                 pins: bool = True, title: str | None = None) -> Any:
    """The per-point table (also the demo's final table): per dataset the pooled mean ± its standard
    error over prompts and its pass@k / maj@n when it has them (``-`` where a dataset is not part of
    a point, by its cadence, or did not finish; :data:`NOT_POOLED` where its units were scored by
    different scorers, e.g. two judge models, and so have no one number; ``not pooled: engines differ (tp,
    deterministic)`` where they ran on engines of different identities, naming the fields); then the pin proof over all datasets of the point
    (``wv/mean``: the mean weight version of the samples, which must be the step; ``mixed``: the
    largest fraction of samples from another version, which must be 0). ``datasets``, ``harness`` and
    ``pins`` pick a part of it (all by default). A dataset whose scorer counts things per sample (code:
    errors, timeouts) gets a ``<ds> counts`` column of those counters, summed over the point; a generated set a
    ``<ds> length`` column (:data:`LENGTH_CELL`: truncated and no-answer shares, mean completion and reasoning
    tokens), and where a sample was cut off a ``<ds> completed-only`` column (:data:`CENSORED_COLUMN`):
    :func:`points_tables` splits it so when narrow."""
    datasets = status["datasets"] if datasets is None else datasets
    harness = status.get("harness_metrics", []) if harness is None else harness
    table = _table(title or f"points of {status['run_id']}{scoring_label(status.get('scoring'))}")
    table.add_column("step", justify="right", overflow="fold")
    extra = derived_keys(status)
    counted = {ds for p in status["points"] for ds, d in p["datasets"].items() if d.get("counters")}
    lengths = {ds for p in status["points"] for ds, d in p["datasets"].items() if _length_cell(d) != "-"}
    cut = _censored(status)
    for ds in datasets:
        table.add_column(f"{ds} ±se", justify="right", overflow="fold")
        for key in extra[ds]:
            table.add_column(key, justify="right", overflow="fold")
        if ds in counted:
            table.add_column(f"{ds} counts", overflow="fold")
        if ds in lengths:
            table.add_column(f"{ds} length", overflow="fold")
        if ds in cut:
            table.add_column(CENSORED_COLUMN.format(ds), justify="right", overflow="fold")
    for name in harness:
        table.add_column(name, justify="right", overflow="fold")
    for col in ("wv/mean", "mixed", "lag", "units", "skips") if pins else ():
        table.add_column(col, justify="right", overflow="fold")
    for p in status["points"]:
        cells = [str(p["step"])]
        for ds in datasets:
            d = p["datasets"].get(ds)
            if d is None:
                cells += [_unpooled_cell(p, ds)]
                cells += ["-"] * (len(extra[ds]) + (ds in counted) + (ds in lengths) + (ds in cut))
            else:
                cells += [_score_cell(d), *(_fmt(d.get("derived", {}).get(k)) for k in extra[ds])]
                if ds in counted:  # the scorer's per-sample counters, summed (code errors, timeouts, ...)
                    cells.append(" ".join(f"{k}={v}" for k, v in sorted(d.get("counters", {}).items())) or "-")
                if ds in lengths:
                    cells.append(_length_cell(d))
                if ds in cut:
                    cells.append(_censored_cell(d))
        cells += [_harness_cell(p, name) for name in harness]
        if pins:
            cells += _pin_cells(list(p["datasets"].values()))
            skips = ", ".join(f"{k}×{v}" for k, v in p["skips"].items()) or "-"
            cells += [_fmt(p["lag_steps"], 0), f"{p['units_done']}/{p['units_total']}", skips]
        table.add_row(*cells)
    return table


def _harness_cell(point: dict[str, Any], name: str) -> str:
    """An lm-eval metric ``"<task>/<metric>"`` of a point, ± its stderr where lm-eval gave one."""
    task, _, metric = name.partition("/")
    m = point["datasets"].get(task, {}).get("metrics", {})
    if metric not in m:
        return "-"
    return _score_cell({"score": m[metric], "stderr": m.get(stderr_name(metric))})


def _unpooled_cell(point: dict[str, Any], ds: str) -> str:
    """``-`` (no value at this point), or why its units have no one number (:data:`UNPOOLED`)."""
    for key, cell in UNPOOLED.items():
        held = point.get(key, ())
        if ds in held:
            detail = held[ds] if isinstance(held, dict) else ()
            return cell.format(", ".join(detail)) if "{}" in cell else cell
    return "-"


def points_tables(status: dict[str, Any], width: int) -> list[Any]:
    """The points as one table when it fits in ``width`` columns without wrapping, else one table per
    dataset, one per lm-eval task and one for the pin proof, lag, units and skips — so no number is
    ever cut to ``0.1…`` in a narrow terminal or a log (a cell that still does not fit folds onto the
    next line, whole). No points: one line."""
    if not status["points"]:
        return [f"points of {status['run_id']}: none yet"]
    whole = points_table(status)
    if _fits(whole, width):
        return [whole]
    tasks: dict[str, list[str]] = {}
    for name in status.get("harness_metrics", []):
        tasks.setdefault(name.split("/")[0], []).append(name)
    return [f"points of {status['run_id']}, a table per part (as one: {whole.maximum_width()} columns, wider than {width})",
            *(points_table(status, [ds], [], False, ds) for ds in status["datasets"]),
            *(points_table(status, [], names, False, task) for task, names in tasks.items()),
            points_table(status, [], [], True, "pin proof, lag, units, skips")]


def _table(title: str) -> PlainTable:
    return PlainTable(title)


def _fits(table: PlainTable, width: int) -> bool:
    return table.maximum_width() <= width  # unconstrained


def render(status: dict[str, Any], width: int = 10_000) -> list[Any]:
    """What ``status`` prints for one run, for a console ``width`` columns wide: the snapshots, the saves
    waiting for their signal, the pending units (each one line when there are none), the points
    (:func:`points_tables`), the :data:`DATASET_LINES`, then the :data:`RUN_LINES` (cost, attestation,
    health) — every item fitted to ``width`` (module docstring)."""
    items: list[Any] = [snapshots_table(status["snapshots"]) if status["snapshots"] else "snapshots: none"]
    if status.get("waiting"):
        items.append(waiting_table(status["waiting"]))
    items.append(pending_table(status["units"]["pending"]) if status["units"]["pending"] else "pending units: none")
    items += points_tables(status, width)
    items += [line for ds in status["datasets"] for renderer in DATASET_LINES if (line := renderer(status, ds))]
    items += [line for renderer in RUN_LINES for line in renderer(status, width)]
    return [fitted for item in items for fitted in fit(item, width)]


def snapshots_table(rows: list[dict[str, Any]]) -> PlainTable:
    table = _table("snapshots")
    for col in ("step", "MB", "mode", "retired", "path"):
        table.add_column(col, overflow="fold")
    for s in rows:
        table.add_row(str(s["step"]), f"{s['bytes'] / 1e6:.1f}", s["mode"], "yes" if s["retired"] else "", s["path"])
    return table


def pending_table(rows: list[dict[str, Any]]) -> PlainTable:
    table = _table("pending units")
    for col in ("unit", "claimed by", "lease age s", "expired"):
        table.add_column(col, overflow="fold")
    for p in rows:
        lease = p.get("lease", {})
        who = f"{lease.get('host', '')}:{lease.get('pid', '')}" if lease else "unclaimed"
        table.add_row(p["unit"], who, _fmt(lease.get("age_s")), "YES" if lease.get("expired") else "")
    return table


def fit(item: Any, width: int) -> list[Any]:
    """``item`` fitted to ``width``: a line broken between words; a table whose title is wider than the
    table (the table is at most ``width`` wide) as the title on a line of its own, then the untitled table."""
    if isinstance(item, str):
        return wrap(item, width)
    if isinstance(item, PlainTable) and item.title and cell_len(item.title) > min(item.maximum_width(), width):
        untitled = PlainTable("")
        untitled.columns, untitled.rows = item.columns, item.rows
        return [*wrap(item.title, width), untitled]
    return [item]


def join_parts(parts: list[str], width: int) -> list[str]:
    """``parts`` joined by `` | `` into as few lines as fit ``width`` (a part wider than it: :func:`wrap`)."""
    lines: list[str] = []
    for part in parts:
        if lines and cell_len(lines[-1]) + 3 + cell_len(part) <= width:
            lines[-1] += f" | {part}"
        else:
            lines += wrap(part, width)
    return lines


def attestation_line(counts: dict[str, int]) -> str:
    """The sglang consistency record (``RUN/weight_checksums/``) per snapshot and checksum layout."""
    return (f"weight checksums: {counts['stands']} compared (reproduced by independent loads), "
            f"{counts['reference_only']} reference-only (one load, nothing compared), {counts['disputed']} disputed")


def waiting_table(rows: list[dict[str, Any]], now: float | None = None) -> Any:
    """Saves found under watched dirs but not admitted: each with its layout, what it waits for, since when."""
    now = time.time() if now is None else now
    table = _table("saves found, not admitted")
    for col in ("step", "layout", "waits for", "since", "path"):
        table.add_column(col, overflow="fold")
    for w in rows:
        since = "" if w["since"] is None else (f"{time.strftime('%H:%M:%S', time.localtime(w['since']))} "
                                               f"({max(0.0, now - w['since']):.0f}s)")
        table.add_row("" if w["step"] is None else str(w["step"]), w["layout"], w["waits_for"], since, w["path"])
    return table


def _training_state(status: dict[str, Any]) -> str:
    reeval, stopped = status.get("reeval"), status.get("interrupted")
    if reeval:
        return f"re-evaluating {reeval['from_run']} (steps {reeval['steps']})"
    if status["training_done"] is not None:
        return f"training done at step {status['training_done']}"
    if stopped:
        return f"training interrupted ({stopped.get('signal', '?')} to {stopped.get('by', '?')})"
    if (watch := status.get("watching")) is not None:  # another program trains: its end is not signalled here
        return _watching_state(watch)
    return "training running"


def _watching_state(watch: dict[str, Any], now: float | None = None) -> str:
    """What status knows of a watched trainer: its dirs and how long ago it last saved."""
    last = watch.get("last_save_at")
    ago = "no save yet" if last is None else \
        f"last save {max(0.0, (time.time() if now is None else now) - last) / 60:.0f} min ago"
    return f"watching {', '.join(watch['roots'])}: {ago} (its trainer's end is not signalled to ckpteval)"


def health_line(status: dict[str, Any]) -> str:
    """One line: training state, unit counts, expired leases, malformed results, free staging space."""
    return " | ".join([_training_state(status), *_health_parts(status)])


def health_lines(status: dict[str, Any], width: int) -> list[str]:
    """:func:`health_line` when it fits ``width``, else its parts over several lines with the training
    state last (``status | tail -n 1`` is the training state either way)."""
    line = health_line(status)
    if cell_len(line) <= width:
        return [line]
    return [*join_parts(_health_parts(status), width), *wrap(_training_state(status), width)]


def _health_parts(status: dict[str, Any]) -> list[str]:
    h, u = status["health"], status["units"]
    parts = [
        f"units done {u['done']}, pending {len(u['pending'])}, skipped {sum(u['skipped'].values())}",
        f"expired leases {h['expired_leases']}",
        f"malformed results {len(h['malformed_results'])}",
        *(f"{r}: {b / 1e9:.1f} GB free" for r, b in h["staging_free_bytes"].items()),
    ]
    if (gone := h.get("scored_not_logged")) and status.get("interrupted"):
        parts.append(f"scored, never logged by the stopped trainer: steps {', '.join(map(str, gone))} "
                     "(a --resume logs them)")
    if lost := h.get("lost_before_admission"):
        parts.append(f"LOST to rotation before admission: {len(lost)} (steps {', '.join(map(str, lost))})")
    return parts


def cost_line(cost: dict[str, Any]) -> str:
    """One line: eval GPU-hours beside training's wall time, GPU-s per point, tokens/s per engine."""
    return " | ".join(_cost_parts(cost))


def _cost_parts(cost: dict[str, Any]) -> list[str]:
    rates = ", ".join(f"{k} {_fmt(v, 1)}" for k, v in cost["tokens_per_s"].items()) or "-"
    share = cost.get("fraction_of_training")
    return [f"eval cost {cost['eval_gpu_hours']:.3f} GPU-h (training wall {cost['training_wall_hours']:.2f} h"
            f"{'' if share is None else f'; {share:.1%} of training GPU-s'})",
            f"{_fmt(cost['gpu_s_per_point'], 1)} GPU-s per point", f"tokens/s per engine: {rates}"]


def _attestation_lines(status: dict[str, Any], width: int) -> list[str]:
    counts = status.get("attestation") or {}
    return wrap(attestation_line(counts), width) if any(counts.values()) else []


RUN_LINES: list[Callable[[dict[str, Any], int], list[str]]] = [
    lambda status, width: join_parts(_cost_parts(status["cost"]), width),
    lambda status, width: [part for line in noise_lines(status.get("noise")) for part in wrap(line, width)],
    _attestation_lines,
    health_lines,  # keep it last (add lines before it): its last line is the training state (tail -n 1)
]
"""The run's closing lines, in order: each renderer takes (status, width) and returns lines <= width."""

def contamination_line(status: dict[str, Any], ds: str) -> str | None:
    """The contamination gate's finding for ``ds`` (``ckpteval contamination``), None when it was not checked."""
    c = status.get("contamination")
    if c is not None and "error" in c:
        return f"contamination {ds}: {c['error']}"
    if c is None or (d := c["datasets"].get(ds)) is None:
        return None
    if not d["matched"]:
        return f"contamination {ds}: clean (0 of {d['rows']} rows in {c['train_rows']:,} training rows)"
    tiers = ", ".join(f"{t} {n}" for t, n in sorted(d["tiers"].items()))
    return (f"contamination {ds}: {d['matched']} of {d['rows']} rows found in training data ({tiers}); "
            f"eval/{ds}/clean scores the rest")


def reference_line(status: dict[str, Any], ds: str) -> str | None:
    """The step-0 check of ``ds`` against its published score (:mod:`ckpteval.jobs.eval.catalog.reference`), None
    when it has none: the differing settings first, and no z-score when one of them refuses the comparison."""
    r = (status.get("reference") or {}).get(ds)
    if r is None:
        return None
    if "unknown" in r:
        return f"reference {ds}: {r['unknown']}"
    head = f"reference {ds}: {r['model']} {r['metric']} {r['reference']:.3f} ({r['url']})"
    if r["differences"]:
        return f"{head}: not compared, the run differs from the source in: " + "; ".join(r["differences"] + r["warnings"])
    warn = f" [differs: {'; '.join(r['warnings'])}]" if r["warnings"] else ""
    if r["score"] is None:
        return f"{head}: step 0 not scored yet{warn}"
    return f"{head}: " + "; ".join(_base_point(b) for b in r["base_points"]) + warn


def _base_point(b: dict[str, Any]) -> str:
    """One base point of the reference check: step 0's, or a later snapshot's with step 0's weights."""
    z = "n/a (no stderr)" if b["z"] is None else f"{b['z']:+.2f}"
    same = " (step 0's weights)" if b["step"] != 0 else ""
    return f"step {b['step']}{same} {b['score']:.3f} ± {b['stderr']:.3f}, z = {z}"


DATASET_LINES: list[Callable[[dict[str, Any], str], str | None]] = [reference_line, contamination_line]
"""Per-dataset lines under the points tables, in order: each renderer takes (status, dataset name) and
returns one line (fitted by :func:`render`) or None (nothing to say for that dataset)."""

