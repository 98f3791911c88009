"""``RUN/contamination.json``: the contamination gate's matches, and the clean series derived from them
(docs/PROTOCOL.md §7 "Contamination"; the check itself: :mod:`ckpteval.jobs.eval.contamination`).

Written once per check by one process (atomic rename), read by any: the ingesters (``eval/<ds>/clean``)
and ``status``. Guarantee: a reader sees a whole file or none; a malformed one is refused naming the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import read_json_object, write_json_atomic
from ckpteval.coord.entries import scored_per_sample
from ckpteval.coord.results.censoring import stderr
from ckpteval.coord.results.files import Result
from ckpteval.coord.results.points import Point, prompt_major
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import WorkUnit

VERSION = 1


def matches_path(run_path: Path) -> Path:
    return RunDir(run_path).contamination_path


def write_matches(run_path: Path, record: dict[str, Any]) -> Path:
    """Publish one check's record (``{"version", "identity", "datasets": {ds: {"rows", "matched": [...]}}, ...}``)."""
    path = matches_path(run_path)
    write_json_atomic(path, {"version": VERSION, **record})
    return path


def read_matches(run_path: Path) -> dict[str, Any] | None:
    """The last check's record, None when no check ran; ValueError naming the file when it is malformed."""
    path = matches_path(run_path)
    try:
        record = read_json_object(path)
    except FileNotFoundError:
        return None
    datasets = record.get("datasets")
    if record.get("version") != VERSION or not isinstance(datasets, dict) or not all(
            isinstance(d, dict) and isinstance(d.get("matched"), list) for d in datasets.values()):
        raise ValueError(f"{path}: not a contamination record of version {VERSION} (run `ckpteval contamination` again)")
    return record


def dirty_rows(record: Mapping[str, Any] | None) -> dict[str, frozenset[int]]:
    """Per checked dataset, the rows (0-based, in the order the dataset evaluates them) some training row matched."""
    if record is None:
        return {}
    return {name: frozenset(int(m["row"]) for m in d["matched"]) for name, d in record["datasets"].items()}


def clean_metrics(manifest: RunManifest, point: Point, results: Mapping[WorkUnit, Result],
                  dirty: Mapping[str, frozenset[int]]) -> dict[str, float]:
    """``eval/<ds>/clean`` (the point's mean over the prompts no training row matched), its ``/stderr`` and
    ``/prompts``, for each checked per-sample dataset the point scored."""
    out: dict[str, float] = {}
    for entry in manifest.eval.entries:
        if entry.name not in dirty or entry.name not in point.datasets or not scored_per_sample(entry):
            continue
        units = [results[u] for u in entry.units(point.step)]
        scores, n = prompt_major(entry, units).scores, entry.n_samples
        means = [sum(scores[i * n:(i + 1) * n]) / n for i in range(len(scores) // n) if i not in dirty[entry.name]]
        out[f"eval/{entry.name}/clean"] = sum(means) / len(means) if means else float("nan")
        out[f"eval/{entry.name}/clean/stderr"] = stderr(means)
        out[f"eval/{entry.name}/clean/prompts"] = float(len(means))
    return out


def summary(run_path: Path) -> dict[str, Any] | None:
    """What ``status`` shows of the last check: per dataset its rows, matched rows and the tiers that found
    them, the training rows read; ``{"error": ...}`` for a malformed record; None when no check ran."""
    try:
        record = read_matches(run_path)
    except ValueError as e:
        return {"error": str(e)}
    if record is None:
        return None
    datasets = {}
    for name, d in record["datasets"].items():
        tiers: dict[str, int] = {}
        for m in d["matched"]:
            tiers[m.get("tier", "?")] = tiers.get(m.get("tier", "?"), 0) + 1
        datasets[name] = {"rows": d.get("rows"), "matched": len(d["matched"]), "tiers": tiers}
    return {"train_rows": record.get("train_rows"), "checked_at": record.get("checked_at"), "datasets": datasets,
            "skipped": record.get("skipped", [])}
