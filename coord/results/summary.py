"""Step summaries: what ``ckpteval status`` and ``ckpteval plot`` need of one step's results, in one file.

A reader that parses every result file of a 1,000-point run (640k files) takes half a minute. A step's
summary, ``results/step-<N>/step.summary`` (:data:`ckpteval.coord.run.rundir.STEP_SUMMARY`, docs/PROTOCOL.md §1),
holds its :class:`StepFacts` — the derived point and the per-unit facts status shows — computed from the
result files whose names it fingerprints (:func:`names_fingerprint`), for the ``run.json`` it was derived
under (:func:`manifest_digest`). Results are immutable once published (first writer wins, a superseding
retry is a new ``<unit>.retry<k>.json`` name), so the set of result names identifies the content: a reader
lists the step directory and uses the summary only when both fingerprints match; otherwise (a result landed
since, a retry, a re-written run.json) it reads that step's results (:func:`read_step_facts`).

Guarantee: a summary is only a shortcut. Readers print the same with and without one; a missing, stale or
corrupt summary costs time, never correctness (it is ignored, never an error). It is written atomically
(temp + fsync + rename) by an ingester (:func:`write_step_summary`, from :func:`ckpteval.jobs.ingest.ingest_point`)
from what its :class:`~ckpteval.coord.results.files.ResultIndex` read, only when that read of the directory was
whole and a listing after it shows the same names — and by ``ckpteval backfill`` when it ends (a backfill run
has no ingester). Readers never write one (the run dir may be read-only).

Limits: a result landing after its step was ingested (a retry by a worker, not a backfill) leaves the
summary stale — every reader then reads that step in full, as before summaries; so does a step no ingester
and no backfill saw whole (a worker-only run without the service). Float sums here use ``math.fsum`` (exact, in any
order), so they do not depend on the order a directory lists its files. Key order inside the file is part
of its content (the order status prints in), so it is not written with the sorted protocol encoding. NaN
and ±inf in the facts are written ``{"nonfinite": "nan" | "inf" | "-inf"}`` (strict JSON, exact round
trip); a summary holding a bare ``NaN``/``Infinity`` is ignored (read as stale).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import dumps, tag_nonfinite, untag_nonfinite, write_bytes_atomic
from ckpteval.coord.results.files import Result, ResultIndex, result_names
from ckpteval.coord.results.points import derive_point
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.run.rundir import STEP_SUMMARY, step_dir_name, step_of_dir
from ckpteval.coord.work.units import WorkUnit, units_for_step

SUMMARY_VERSION = 4  # 3: points carry mixed_engines and replays; non-finite statistics tagged; 4: censoring


@dataclass(frozen=True)
class StepFacts:
    """What status and plot show of one step, from the results of its units."""

    point: dict[str, Any]
    """The derived point (:func:`ckpteval.coord.results.files.derive_point`) as ``dataclasses.asdict`` gives it."""
    missing: tuple[str, ...]
    """Ids of the step's units without a result, in :func:`ckpteval.coord.work.units.units_for_step` order."""
    done: int
    """Units of the step whose result is ok (as written: before a pin violation is attributed)."""
    skipped: dict[str, int]
    """Skip reason -> units of the step whose result is that skip (as written)."""
    engines: dict[str, list[float]]
    """``"host:pid"`` -> [generated tokens, engine seconds] summed over the step's results with a cost."""
    gpu_s: float
    """Every result's ``cost.gpu_s`` summed."""
    has_results: bool
    """Whether any result of the step exists (a step without one shows only when otherwise known)."""


def step_facts(manifest: RunManifest, step: int, results: Mapping[WorkUnit, Result]) -> StepFacts:
    """The facts of ``step`` from ``results`` (the step's results; others are ignored)."""
    mine = {u: r for u, r in results.items() if u.step == step}
    missing, done, skipped = [], 0, {}
    for unit in units_for_step(manifest, step):
        r = mine.get(unit)
        if r is None:
            missing.append(unit.id)
        elif r.ok:
            done += 1
        else:
            skipped[r.skip_reason] = skipped.get(r.skip_reason, 0) + 1
    per_engine: dict[str, tuple[list[float], list[float]]] = {}
    for r in mine.values():
        if r.cost:
            tokens, seconds = per_engine.setdefault(f"{r.worker.get('host', '?')}:{r.worker.get('pid', '?')}", ([], []))
            tokens.append(r.cost.get("generated_tokens", 0.0))
            seconds.append(r.cost.get("engine_s", 0.0))
    return StepFacts(
        point=asdict(derive_point(manifest, step, mine)),
        missing=tuple(missing),
        done=done,
        skipped=skipped,
        engines={k: [math.fsum(tok), math.fsum(s)] for k, (tok, s) in sorted(per_engine.items())},
        gpu_s=math.fsum(r.cost.get("gpu_s", 0.0) for r in mine.values()),
        has_results=bool(mine),
    )


def names_fingerprint(names: Iterable[str]) -> str:
    """``"<count>:<blake2b of the sorted names>"``: what a step directory's result files are."""
    ordered = sorted(names)
    digest = hashlib.blake2b("\n".join(ordered).encode(), digest_size=16).hexdigest()
    return f"{len(ordered)}:{digest}"


def manifest_digest(manifest: RunManifest) -> str:
    """A digest of the manifest the facts were derived under (units, datasets and run key come from it)."""
    return hashlib.blake2b(dumps(manifest.to_json()), digest_size=16).hexdigest()


def encode_summary(facts: StepFacts, step: int, names: str, run: str) -> bytes:
    """The summary file's bytes: NaN/±inf (a stderr over one prompt, no attestation recorded, a canary over
    other token ids) as ``{"nonfinite": ...}`` (:func:`ckpteval.coord.atomic.tag_nonfinite`), never bare."""
    obj = {"summary": SUMMARY_VERSION, "step": step, "names": names, "run": run, "facts": tag_nonfinite(asdict(facts))}
    return (json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n").encode()  # key order kept: it is content


def read_summary(path: Path, step: int, names: str, run: str) -> StepFacts | None:
    """The facts in the summary at ``path`` if it is whole, of this version and step, and made from result
    files ``names`` under manifest ``run``; None otherwise (missing, stale or corrupt: never an error)."""
    try:
        obj = json.loads(path.read_bytes(), parse_constant=_refuse)
        if obj["summary"] != SUMMARY_VERSION or obj["step"] != step or obj["names"] != names or obj["run"] != run:
            return None
        f = untag_nonfinite(obj["facts"])
        point = {**f["point"], "mixed_scorers": tuple(f["point"]["mixed_scorers"]),  # asdict keeps the tuples
                 "mixed_engines": {k: tuple(v) for k, v in f["point"]["mixed_engines"].items()}}
        return StepFacts(point=point, missing=tuple(f["missing"]), done=int(f["done"]), skipped=dict(f["skipped"]),
                         engines=dict(f["engines"]), gpu_s=float(f["gpu_s"]), has_results=bool(f["has_results"]))
    except (OSError, ValueError, KeyError, TypeError):  # ValueError: JSON or UTF-8; a summary is only a shortcut
        return None


def _refuse(name: str) -> None:
    raise ValueError(f"a bare {name} in a step summary")  # written by an older ckpteval: read the results


def write_step_summary(index: ResultIndex, manifest: RunManifest, step: int) -> bool:
    """Write ``step``'s summary from what ``index`` read of its directory; True if written.

    Nothing is written when that read was not whole (:meth:`ResultIndex.step_read`) or the directory lists
    other result names now (one landed since the read): readers then read the step's results, as without a
    summary. An OSError (a read-only run dir, a full disk)
    is swallowed: a summary is only a shortcut, never a reason for ingestion to fail.
    """
    read = index.step_read(step)
    if read is None or not read[0]:
        return False
    names, results = read
    directory = index.results_dir / step_dir_name(step)
    try:
        if frozenset(result_names(directory)) != names:
            return False
        data = encode_summary(step_facts(manifest, step, results), step, names_fingerprint(names),
                              manifest_digest(manifest))
        write_bytes_atomic(directory / STEP_SUMMARY, data)
    except OSError:
        return False
    return True


def read_step_facts(results_dir: Path, manifest: RunManifest) -> tuple[dict[int, StepFacts], dict[str, str]]:
    """The facts of every step with a result under ``results_dir``, and the malformed result files (name
    relative to ``results/`` -> why): one listing of ``results/`` and one per step directory; a step whose
    summary is fresh is read from it, any other from its result files (:class:`ResultIndex`). Never writes."""
    try:
        top = list(os.scandir(results_dir))
    except FileNotFoundError:
        return {}, {}
    run = manifest_digest(manifest)
    facts: dict[int, StepFacts] = {}
    stale: list[int] = []
    for entry in top:
        step = step_of_dir(entry.name)
        if step is None or not entry.is_dir():
            continue
        try:
            names = result_names(Path(entry.path))
        except (FileNotFoundError, NotADirectoryError):
            continue
        if not names:
            continue
        found = read_summary(Path(entry.path) / STEP_SUMMARY, step, names_fingerprint(names), run)
        if found is None:
            stale.append(step)
        else:
            facts[step] = found
    index = ResultIndex(results_dir, manifest)
    index.refresh(only_steps=stale)
    again = index.steps() & set(facts)  # a result moved by hand into another step's directory: read both
    if again:
        index.refresh(only_steps=again)
    for step in index.steps():
        facts[step] = step_facts(manifest, step, index.for_step(step))
    return facts, index.errors
