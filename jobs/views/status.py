"""``ckpteval status RUN [RUN ...]``: what a run's files say, as tables or JSON.

Read-only: it never writes to the run dir, so it is safe to run anywhere, any time, as often as
you like. Everything is derived from the protocol files (docs/PROTOCOL.md): snapshots from their
markers, units from results and lease files, points from results, lag from ``metrics.jsonl``.

Limits: lease ages use this machine's wall clock against the lease file's mtime, so a skewed clock
shifts them; "expired" here is a display hint — the protocol's real expiry is judged by each
contender on its own monotonic clock (see ckpteval.coord.units).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import read_json_object, read_jsonl
from ckpteval.coord.discovery import SnapshotDiscovery, adopted_refs, lost_steps, waiting_saves
from ckpteval.coord.layouts import AUTO
from ckpteval.coord.ledger import Ledger
from ckpteval.coord.manifest import RunManifest
from ckpteval.coord.rundir import RunDir
from ckpteval.coord.steps import run_step_selection
from ckpteval.coord.summary import StepFacts, read_step_facts, step_facts
from ckpteval.coord.units import lease_path, read_lease_holder
from ckpteval.coord.weight_checksums import summarize
from ckpteval.jobs.flags import Parser, add_run_dir_argument, fail, positive_float, run_dirs_from_args
from ckpteval.jobs.views.columns import derived_keys, length_cell
from ckpteval.jobs.views.tables import PlainTable

DEFAULT_WATCH_S = 2.0


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Lines of metrics.jsonl (:func:`ckpteval.coord.atomic.read_jsonl`: a torn last line is ignored, any other
    bad line names the file)."""
    return read_jsonl(path, what="metrics line")


def eval_lags(metrics: list[dict[str, Any]]) -> dict[int, float]:
    return {int(m["eval/step"]): m["eval/lag_steps"] for m in metrics if "eval/step" in m and "eval/lag_steps" in m}


def _lease_info(path: Path, duration: float, now: float) -> dict[str, Any]:
    try:
        holder = read_lease_holder(path)
        age = now - path.stat().st_mtime
    except FileNotFoundError:
        return {}
    info: dict[str, Any] = {}
    if holder is not None:
        info.update(host=holder.hostname, pid=str(holder.pid))
        if holder.token is not None:
            info["token"] = holder.token
    info["age_s"] = round(age, 1)
    info["expired"] = age > duration
    return info


def _snapshot_rows(roots: tuple[str, ...], retired: set[int], adopted: Path) -> list[dict[str, Any]]:
    """Marked snapshots under the run's roots, plus the watched checkpoints it adopted (``RUN/adopted/``)."""
    rows = []
    refs = [ref for root in roots for ref in SnapshotDiscovery(Path(root)).poll()]
    marked = {ref.step for ref in refs}
    for ref in refs + [a for a in adopted_refs(adopted) if a.step not in marked and a.path.is_dir()]:
            rows.append({
                "step": ref.step,
                "path": str(ref.path),
                "bytes": ref.marker.total_bytes,
                "mode": ref.marker.mode,
                "complete": True,
                "retired": ref.step in retired,
            })
    return sorted(rows, key=lambda r: r["step"])


def _unit_rows(run: RunDir, manifest: RunManifest, steps: list[int], facts: dict[int, StepFacts]) -> dict[str, Any]:
    duration = manifest.lease.duration_s
    now = time.time()
    pending, done, skipped = [], 0, {}
    for step in steps:
        f = facts[step]
        for unit_id in f.missing:
            lease = _lease_info(lease_path(run.leases, unit_id, step), duration, now)
            pending.append({"unit": unit_id, **({"lease": lease} if lease else {})})
        done += f.done
        for reason, n in f.skipped.items():
            skipped[reason] = skipped.get(reason, 0) + n
    return {"pending": pending, "done": done, "skipped": skipped}


def _point_rows(steps: list[int], facts: dict[int, StepFacts], lags: dict[int, float]) -> list[dict[str, Any]]:
    return [{**facts[step].point, "lag_steps": lags.get(step)} for step in steps]


def cost_summary(run: RunDir, facts: list[StepFacts], points: list[dict[str, Any]]) -> dict[str, Any]:
    """What evaluation cost next to what training took: total eval GPU-hours (every unit's ``cost``),
    GPU-seconds per complete point, tokens/s per engine (per worker ``host:pid``: its generated tokens
    over its engine seconds), and training's wall time — ``TRAINING_DONE``'s time (now while it runs)
    minus ``run.json``'s modification time, so an approximation (a re-written run.json moves it)."""
    per_engine: dict[str, tuple[list[float], list[float]]] = {}
    for f in facts:
        for key, (tokens, seconds) in f.engines.items():
            acc = per_engine.setdefault(key, ([], []))
            acc[0].append(tokens)
            acc[1].append(seconds)
    gpu_s = math.fsum(f.gpu_s for f in facts)
    complete = [p["cost"].get("gpu_s", 0.0) for p in points if p["complete"] and p.get("cost")]
    try:
        done_at = float(read_json_object(run.done_path).get("time", time.time()))
    except FileNotFoundError:
        done_at = time.time()
    rates = {k: (math.fsum(tok), math.fsum(s)) for k, (tok, s) in per_engine.items()}
    return {
        "eval_gpu_hours": gpu_s / 3600,
        "gpu_s_per_point": sum(complete) / len(complete) if complete else None,
        "training_wall_hours": max(0.0, done_at - run.manifest_path.stat().st_mtime) / 3600,
        "tokens_per_s": {k: (tok / s if s > 0 else None) for k, (tok, s) in sorted(rates.items())},
    }


def collect_status(run_dir: Path) -> dict[str, Any]:
    """Everything status shows, as plain data (the ``--json`` output). Each step comes from its summary when
    that is fresh, else from its result files (:mod:`ckpteval.coord.summary`): the same either way."""
    run = RunDir.open(run_dir)
    manifest = run.manifest()
    facts, errors = read_step_facts(run.results, manifest)
    ledger = Ledger(run.ledger_path, repair=False).state if run.ledger_path.exists() else None
    retired = ledger.retired if ledger else set()
    snapshots = _snapshot_rows(manifest.snapshot_roots, retired, run.adopted)
    waiting = [w for root in manifest.trainer.get("foreign_roots", []) if isinstance(root, str)
               for w in waiting_saves(Path(root), AUTO, run.adopted)]
    with_results = {s for s, f in facts.items() if f.has_results}
    steps = sorted({s["step"] for s in snapshots} | with_results | set(ledger.dispatched if ledger else ()))
    selection = run_step_selection(manifest.trainer, str(run.manifest_path))
    if selection is not None:  # a re-evaluation run shows only the steps it evaluates
        steps = [s for s in steps if s in selection]
    for step in steps:
        if step not in facts:  # known (a snapshot, the ledger) but without a result yet
            facts[step] = step_facts(manifest, step, {})
    units = _unit_rows(run, manifest, steps, facts)
    lags = eval_lags(read_metrics(run.metrics_path))
    points = _point_rows(steps, facts, lags)
    expired = [p for p in units["pending"] if p.get("lease", {}).get("expired")]
    complete = {p["step"] for p in points if p.get("complete")}
    free = {}
    for root in manifest.snapshot_roots:
        if os.path.isdir(root):
            st = os.statvfs(root)
            free[root] = st.f_bavail * st.f_frsize
    return {
        "run_id": manifest.run_id,
        "run_dir": str(run.path),
        "training_done": run.training_done(),
        "interrupted": run.interrupted(),
        "reeval": {k: manifest.trainer.get(k) for k in ("from_run", "steps")} if selection is not None else None,
        "datasets": [d.name for d in manifest.eval.datasets],
        "harness_metrics": harness_columns(points),
        "snapshots": snapshots,
        "waiting": waiting,
        "units": units,
        "points": points,
        "cost": cost_summary(run, [facts[s] for s in sorted(with_results)], points),
        "attestation": summarize(run.weight_checksums),  # sglang checksums: compared vs reference-only
        "health": {
            "expired_leases": len(expired),
            "stuck_units": [p["unit"] for p in expired],
            "malformed_results": errors,
            "staging_free_bytes": free,
            # dispatched, not ingested: still being evaluated, or scored and not (yet) logged by the trainer
            "ledger_pending": [s for s in (ledger.pending if ledger else []) if s not in complete],
            "scored_not_logged": [s for s in (ledger.pending if ledger else []) if s in complete],
            "lost_before_admission": lost_steps(run.lost),
        },
    }


def harness_columns(points: list[dict[str, Any]]) -> list[str]:
    """The lm-eval metrics (``"<task>/<metric>"``) any point carries, pin evidence left out."""
    return sorted({k for p in points for k in p["metrics"] if "/weight_version/" not in k})


def finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float as None: JSON has neither (``status --json`` prints no
    bare ``NaN``/``Infinity`` a strict parser refuses)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


NOT_POOLED = "not pooled: scorers differ"
"""The cell of a dataset whose units were scored differently (two judges): never one number."""


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.{digits}f}"
    return str(x)


def _score_cell(d: dict[str, Any]) -> str:
    se = d.get("stderr")
    if isinstance(se, float) and math.isfinite(se):
        return f"{_fmt(d['score'])}±{se:.3f}"
    return _fmt(d["score"])


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
    different scorers, e.g. two judge models, and so have no one number); then the pin proof over all datasets of the point
    (``wv/mean``: the mean weight version of the samples, which must be the step; ``mixed``: the
    largest fraction of samples from another version, which must be 0). ``datasets``, ``harness`` and
    ``pins`` pick a part of it (all by default). A dataset whose scorer counts things per sample (code:
    errors, timeouts) gets a ``<ds> counts`` column of those counters, summed over the point, a generated set a
    ``<ds> length`` column (:func:`~ckpteval.jobs.views.columns.length_cell`): :func:`points_tables` splits it so when narrow."""
    datasets = status["datasets"] if datasets is None else datasets
    harness = status.get("harness_metrics", []) if harness is None else harness
    table = _table(title or f"points of {status['run_id']}")
    table.add_column("step", justify="right", overflow="fold")
    extra = derived_keys(status)
    counted = {ds for p in status["points"] for ds, d in p["datasets"].items() if d.get("counters")}
    lengths = {ds for p in status["points"] for ds, d in p["datasets"].items() if length_cell(d) != "-"}
    for ds in datasets:
        table.add_column(f"{ds} ±se", justify="right", overflow="fold")
        for key in extra[ds]:
            table.add_column(key, justify="right", overflow="fold")
        if ds in counted:
            table.add_column(f"{ds} counts", overflow="fold")
        if ds in lengths:
            table.add_column(f"{ds} length", overflow="fold")
    for name in harness:
        table.add_column(name, justify="right", overflow="fold")
    for col in ("wv/mean", "mixed", "lag", "units", "skips") if pins else ():
        table.add_column(col, justify="right", overflow="fold")
    for p in status["points"]:
        cells = [str(p["step"])]
        for ds in datasets:
            d = p["datasets"].get(ds)
            if d is None:
                cells += [NOT_POOLED if ds in p.get("mixed_scorers", ()) else "-"]
                cells += ["-"] * (len(extra[ds]) + (ds in counted) + (ds in lengths))
            else:
                cells += [_score_cell(d), *(_fmt(d.get("derived", {}).get(k)) for k in extra[ds])]
                if ds in counted:  # the scorer's per-sample counters, summed (code errors, timeouts, ...)
                    cells.append(" ".join(f"{k}={v}" for k, v in sorted(d.get("counters", {}).items())) or "-")
                if ds in lengths:
                    cells.append(length_cell(d))
        cells += [_fmt(p["metrics"].get(name)) for name in harness]
        if pins:
            cells += _pin_cells(list(p["datasets"].values()))
            skips = ", ".join(f"{k}×{v}" for k, v in p["skips"].items()) or "-"
            cells += [_fmt(p["lag_steps"], 0), f"{p['units_done']}/{p['units_total']}", skips]
        table.add_row(*cells)
    return table


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
    run = status["run_id"]
    tasks: dict[str, list[str]] = {}
    for name in status.get("harness_metrics", []):
        tasks.setdefault(name.split("/")[0], []).append(name)
    return [*(points_table(status, [ds], [], False, f"{ds} of {run}") for ds in status["datasets"]),
            *(points_table(status, [], names, False, f"{task} of {run}") for task, names in tasks.items()),
            points_table(status, [], [], True, f"points of {run}: pin proof, lag, units, skips")]


def _table(title: str) -> PlainTable:
    return PlainTable(title)


def _fits(table: PlainTable, width: int) -> bool:
    return table.maximum_width() <= width  # unconstrained


def render(status: dict[str, Any], width: int = 10_000) -> list[Any]:
    """What ``status`` prints for one run, for a console ``width`` columns wide: the snapshots, the
    pending units (each one line when there are none), the points (:func:`points_tables`), the cost
    line and the health line."""
    items: list[Any] = []
    if status["snapshots"]:
        snaps = _table("snapshots")
        for col in ("step", "MB", "mode", "retired", "path"):
            snaps.add_column(col, overflow="fold")
        for s in status["snapshots"]:
            snaps.add_row(str(s["step"]), f"{s['bytes'] / 1e6:.1f}", s["mode"], "yes" if s["retired"] else "",
                          s["path"])
        items.append(snaps)
    else:
        items.append("snapshots: none")
    if status.get("waiting"):
        items.append(waiting_table(status["waiting"]))
    if status["units"]["pending"]:
        units = _table("pending units")
        for col in ("unit", "claimed by", "lease age s", "expired"):
            units.add_column(col, overflow="fold")
        for p in status["units"]["pending"]:
            lease = p.get("lease", {})
            who = f"{lease.get('host', '')}:{lease.get('pid', '')}" if lease else "unclaimed"
            units.add_row(p["unit"], who, _fmt(lease.get("age_s")), "YES" if lease.get("expired") else "")
        items.append(units)
    else:
        items.append("pending units: none")
    lines = [cost_line(status["cost"]), health_line(status)]
    if any((a := status.get("attestation") or {}).values()):
        lines.insert(1, attestation_line(a))
    return [*items, *points_tables(status, width), *lines]


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
    return "training running"


def health_line(status: dict[str, Any]) -> str:
    """One line: training state, unit counts, expired leases, malformed results, free staging space."""
    h, u = status["health"], status["units"]
    parts = [
        _training_state(status),
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
    return " | ".join(parts)


def watch_interval(ap: Parser, args: Any) -> float | None:
    """``--watch [S]``: the refresh interval, or None. ``status --watch RUN`` reads RUN as a run dir
    (argparse hands the optional value to ``--watch``), not as a malformed interval."""
    if args.watch is None:
        return None
    try:
        return positive_float(args.watch)
    except argparse.ArgumentTypeError as e:
        if args.run_dir is None and not args.watch[:1].isdigit():
            args.run_dir_pos = [Path(args.watch), *(args.run_dir_pos or [])]
            return DEFAULT_WATCH_S
        ap.error(f"--watch {args.watch}: {e}")


def cost_line(cost: dict[str, Any]) -> str:
    """One line: eval GPU-hours beside training's wall time, GPU-s per point, tokens/s per engine."""
    rates = ", ".join(f"{k} {_fmt(v, 1)}" for k, v in cost["tokens_per_s"].items()) or "-"
    return (f"eval cost {cost['eval_gpu_hours']:.3f} GPU-h (training wall {cost['training_wall_hours']:.2f} h)"
            f" | {_fmt(cost['gpu_s_per_point'], 1)} GPU-s per point | tokens/s per engine: {rates}")


def show(console: Any, statuses: list[dict[str, Any]], as_json: bool) -> None:
    """Print each run's status: its tables one run after the other (a rule naming the run between
    several), or JSON — one object for one run, a list of them for several."""
    if as_json:
        obj = finite(statuses[0] if len(statuses) == 1 else statuses)
        print(json.dumps(obj, indent=1, default=str, allow_nan=False), flush=True)
        return
    with console:  # one write per refresh: a reader (or a watch's Ctrl-C) never sees half of one
        for status in statuses:
            if len(statuses) > 1:
                console.rule(f"run {status['run_id']} ({status['run_dir']})")
            for item in render(status, console.width):
                console.print(item, soft_wrap=isinstance(item, str))  # a one-line section stays one line


def main(argv: list[str]) -> int:
    ap = Parser(prog="ckpteval status", description=__doc__.split("\n")[0])
    add_run_dir_argument(ap, many=True)
    ap.add_argument("--json", action="store_true",
                    help="print machine-readable JSON instead of tables (a list of objects for several RUNs)")
    ap.add_argument("--watch", nargs="?", const=str(DEFAULT_WATCH_S), default=None, metavar="S",
                    help=f"refresh every S seconds until Ctrl-C (S defaults to {DEFAULT_WATCH_S:g})")
    args = ap.parse_args(argv)
    interval = watch_interval(ap, args)
    run_dirs = run_dirs_from_args(ap, args)
    from rich.console import Console

    console = Console()
    if interval is not None:  # SIGTERM (kill, timeout) ends a watch as quietly as Ctrl-C
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        while True:
            try:
                statuses = [collect_status(d) for d in run_dirs]
            except (OSError, ValueError) as e:  # missing, unreadable or malformed run files
                return fail("ckpteval status", e)
            if interval and not args.json:
                console.clear()
            show(console, statuses, args.json)
            if not interval:
                return 0
            time.sleep(interval)
    except KeyboardInterrupt:
        if not interval:
            raise  # a one-shot status: the CLI's one line (ckpteval.jobs.cli)
        print(file=sys.stderr)  # Ctrl-C is the way out of --watch: a clean end
        return 0
