"""What a run's files say, as plain data: :func:`collect_status` is ``ckpteval status --json``'s object
and what every status view (tables, plot, demo, the notebook API) is drawn from.

Read-only: it never writes to the run dir, so it is safe to run anywhere, any time, as often as
you like. Everything is derived from the protocol files (docs/PROTOCOL.md): snapshots from their
markers, units from results and lease files, points from results, lag from ``metrics.jsonl``.

Limits: lease ages use this machine's wall clock against the lease file's mtime, so a skewed clock
shifts them; "expired" here is a display hint — the protocol's real expiry is judged by each
contender on its own monotonic clock (see ckpteval.coord.work.claims).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import read_json_object, read_jsonl
from ckpteval.coord.entries import scored_per_sample
from ckpteval.coord.layouts import AUTO
from ckpteval.coord.results.contamination import summary as contamination_summary
from ckpteval.coord.results.scorings import StepFacts, scoring_step_facts, step_facts
from ckpteval.coord.results.training_cost import run_fraction
from ckpteval.coord.run.identity import snapshots_key
from ckpteval.coord.run.ledger import Ledger, LedgerState
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.digests import weights_id
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery, adopted_refs
from ckpteval.coord.snapshots.saves import lost_steps, waiting_saves
from ckpteval.coord.snapshots.weight_checksums import summarize
from ckpteval.coord.work.claims import lease_path, read_lease_holder
from ckpteval.coord.work.steps import run_step_selection
from ckpteval.jobs.eval.catalog.reference import reference_status
from ckpteval.jobs.views.noise import noise_status


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


def _snapshot_rows(manifest: RunManifest, retired: set[int], adopted: Path) -> list[dict[str, Any]]:
    """Marked snapshots under the run's roots (its own: a run-less or another run's marker is not), plus the
    watched checkpoints it adopted (``RUN/adopted/``)."""
    rows = []
    key = snapshots_key(manifest)
    refs = [ref for root in manifest.snapshot_roots for ref in SnapshotDiscovery(Path(root), run=key).poll()]
    marked = {ref.step for ref in refs}
    for ref in refs + [a for a in adopted_refs(adopted) if a.step not in marked and a.path.is_dir()]:
            rows.append({
                "step": ref.step,
                "path": str(ref.path),
                "bytes": ref.marker.total_bytes,
                "mode": ref.marker.mode,
                "complete": True,
                "retired": ref.step in retired,
                "weights": weights_id(ref.marker.tensors),  # same id: same weights (the reference check)
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


def cost_summary(run: RunDir, facts: list[StepFacts], points: list[dict[str, Any]],
                 ledger: LedgerState | None = None) -> dict[str, Any]:
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
        "fraction_of_training": run_fraction(ledger, {p["step"]: p["cost"].get("gpu_s", 0.0)
                                                      for p in points if p.get("cost")}),
    }


def collect_status(run_dir: Path, scoring: str | None = None) -> dict[str, Any]:
    """Everything status shows, as plain data (the ``--json`` output). Each step comes from its summary when
    that is fresh, else from its result files (:mod:`ckpteval.coord.results.summary`); ``scoring``: a rescore's (coord.scorings)."""
    run = RunDir.open(run_dir)
    manifest = run.manifest()
    facts, errors = scoring_step_facts(run, manifest, scoring)
    ledger = Ledger(run.ledger_path, repair=False).state if run.ledger_path.exists() else None
    retired = ledger.retired if ledger else set()
    snapshots = _snapshot_rows(manifest, retired, run.adopted)
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
    status = {
        "run_id": manifest.run_id, "run_dir": str(run.path), "scoring": scoring,  # scoring: None: as generated
        "training_done": run.training_done(),
        "interrupted": run.interrupted(),
        "reeval": {k: manifest.trainer.get(k) for k in ("from_run", "steps")} if selection is not None else None,
        "datasets": [d.name for d in manifest.eval.entries if scored_per_sample(d)],
        "harness_metrics": harness_columns(points),
        "snapshots": snapshots,
        "waiting": waiting,
        "watching": watching(manifest, snapshots, waiting),
        "units": units,
        "points": points,
        "cost": cost_summary(run, [facts[s] for s in sorted(with_results)], points, ledger),
        "noise": noise_status(run, points),  # MDE and replay spread per dataset (jobs.views.noise)
        "attestation": summarize(run.weight_checksums),  # sglang checksums: compared vs reference-only
        "contamination": contamination_summary(run.path),  # the gate's last check (ckpteval contamination)
        "reference": reference_status(manifest, points, snapshots),  # step 0 against published scores (catalog entries)
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
    for p in points:  # last: the readers above take the point as derived
        p["datasets"].update(harness_scores(p.pop("metrics")))
    return status


def watching(manifest: RunManifest, snapshots: list[dict[str, Any]], waiting: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A ``--watch`` run's (its trainer is another program, ``trainer.kind: external``) watched dirs and when
    the newest save there was written (its dir's mtime; None: none yet): nothing tells status when that
    trainer ends, so this is what it knows. None for any other run."""
    if manifest.trainer.get("kind") != "external":
        return None
    times = [w["since"] for w in waiting if w.get("since") is not None]
    for row in snapshots:
        try:
            times.append(Path(row["path"]).stat().st_mtime)
        except OSError:  # rotated away since it was listed
            continue
    return {"roots": [r for r in manifest.trainer.get("foreign_roots", []) if isinstance(r, str)],
            "last_save_at": max(times, default=None)}


def harness_columns(points: list[dict[str, Any]]) -> list[str]:
    """The lm-eval metrics (``"<task>/<metric>"``) any point carries, pin evidence, stderrs and ``n`` left out."""
    return sorted({k for p in points for k in p["metrics"] if "/weight_version/" not in k
                   and not k.endswith("/n") and "_stderr" not in k})


def stderr_name(metric: str) -> str:
    """lm-eval's name for a metric's standard error: ``acc`` -> ``acc_stderr``, ``exact_match/flex`` ->
    ``exact_match_stderr/flex`` (the filter stays last)."""
    name, sep, filt = metric.partition("/")
    return f"{name}_stderr{sep}{filt}"


def harness_scores(flat: dict[str, float]) -> dict[str, dict[str, Any]]:
    """A point's lm-eval metrics (``"<task>/<metric>"``) as per-task entries shaped as a generate set's in
    ``points[].datasets``: ``score`` (the task's first metric, named in ``metric``), its ``stderr``, ``n`` (the
    documents scored; None where not recorded), the pin proof (``weight_version_mean``,
    ``mixed_version_ratio``: the versions read back before and after the task) and every ``metrics``."""
    tasks: dict[str, dict[str, float]] = {}
    for key, value in flat.items():
        task, _, name = key.partition("/")
        tasks.setdefault(task, {})[name] = value
    out = {}
    for task, m in tasks.items():
        names = [k for k in m if not k.startswith("weight_version/") and k != "n" and "_stderr" not in k]
        first = names[0] if names else None
        out[task] = {
            "kind": "lm_eval", "metric": first, "score": m.get(first) if first else None,
            "stderr": m.get(stderr_name(first)) if first else None,
            "n": int(m["n"]) if "n" in m else None,
            "weight_version_mean": m.get("weight_version/mean"),
            "mixed_version_ratio": m.get("weight_version/mixed_version_ratio"),
            "metrics": {k: v for k, v in m.items() if not k.startswith("weight_version/") and k != "n"},
        }
    return out


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
