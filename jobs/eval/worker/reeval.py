"""Re-evaluating an existing run on a new benchmark: a new run dir over another run's snapshots.

``ckpteval backfill --run-dir NEW --from-run OLD --eval-config F [--steps S]`` (and
``ckpteval submit backfill`` with the same flags) creates NEW whose ``run.json`` has the eval of ``F``
(:func:`ckpteval.jobs.eval.worker.evalconfig.read_eval_config`), OLD's snapshot roots (and foreign roots) as its own, and
``trainer = {"kind": "reeval", "from_run", "from_run_id", "steps"}``, and what OLD's engine needed that ``F``
leaves out (its ``base_model`` — a LoRA run's adapters load on it — and engine settings; :func:`engine_needs`); then NEW is backfilled like any
run. ``steps`` (:mod:`ckpteval.coord.work.steps`; ``latest`` resolved to a number at creation) limits the steps
every consumer of NEW considers — workers, backfill array tasks, status.

Promises: **OLD is never written to.** Everything is validated before anything is written (OLD is a
run, NEW is neither OLD nor inside it, the config and its data files, the selection, at least one
selected snapshot present); then only NEW is created. Foreign checkpoints of OLD are re-admitted
with NEW's own adoption records. Only OLD's own snapshots are re-evaluated: under OLD's snapshot roots a
marker must name OLD's run key (recorded as ``trainer.from_run_key``; a run-less or another run's marker
there is not OLD's weights). Re-running the same command is idempotent (NEW exists with the same
source, eval and steps: it is backfilled again, finding nothing to do); any other existing NEW is an
error. With ``--wandb`` the points go into OLD's wandb run (its run id unless ``--wandb-run-id``)
through the service's ingestion (:func:`ckpteval.jobs.eval.worker.service.service_ingestion`).

Limits: only snapshots still on disk can be evaluated (a staging run keeps its newest few; a run that
saved HF checkpoints keeps them all); steps of OLD written after NEW was created are evaluated when a
later backfill finds them, if the selection takes them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import read_json_object
from ckpteval.coord.run.identity import run_key
from ckpteval.coord.run.manifest import RunManifest, parse_manifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
from ckpteval.coord.work.steps import REEVAL_KIND, StepSelection, parse_steps
from ckpteval.jobs.eval.worker.evalconfig import EvalConfig, publish_run, read_eval_config


def source_steps(old: RunDir, manifest: RunManifest) -> list[int]:
    """Steps with a snapshot present in OLD: marked snapshots under its roots, and foreign checkpoints
    it adopted whose dirs still exist (read only)."""
    key = run_key(manifest)  # OLD's own markers only: a run-less or another run's marker is not OLD's snapshot
    steps = {ref.step for root in _roots(manifest) for ref in SnapshotDiscovery(Path(root), run=key).poll()}
    for record in sorted(old.adopted.glob("*.json")) if old.adopted.is_dir() else []:
        try:
            obj = read_json_object(record)
        except (ValueError, FileNotFoundError):
            continue
        if isinstance(obj.get("step"), int) and isinstance(obj.get("source"), str) and Path(obj["source"]).is_dir():
            steps.add(obj["step"])
    return sorted(steps)


def _roots(manifest: RunManifest) -> list[str]:
    return list(manifest.snapshot_roots)


def _foreign_roots(manifest: RunManifest) -> list[str]:
    return [r for r in manifest.trainer.get("foreign_roots", []) if isinstance(r, str)]


@dataclass(frozen=True)
class ReevalPlan:
    """Everything checked, nothing written yet."""

    new: RunDir
    old: RunDir
    old_manifest: RunManifest
    config: EvalConfig
    steps: StepSelection
    selected: list[int]  # selected steps with a snapshot present now
    manifest: RunManifest  # NEW's run.json


def _inside(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def plan_reeval(new_dir: Path, old_dir: Path, config_path: Path, steps_text: str = "all") -> ReevalPlan:
    """Validate a re-evaluation (ValueError / FileNotFoundError name what is wrong); writes nothing."""
    old = RunDir.open(old_dir)
    new = RunDir(new_dir)
    if _inside(new.path, old.path):
        raise ValueError(f"--run-dir {new.path} is inside --from-run {old.path}: the old run is never written to")
    old_manifest = old.manifest()
    for root in _roots(old_manifest) + _foreign_roots(old_manifest):
        if _inside(new.path, Path(root).resolve()):
            raise ValueError(f"--run-dir {new.path} is inside {root}, a snapshot dir of --from-run {old.path}")
    config = read_eval_config(config_path)
    selection = parse_steps(steps_text)
    present = source_steps(old, old_manifest)
    selection = selection.resolve(present)
    selected = selection.select(present)
    if not selected:
        raise ValueError(
            f"--steps {steps_text!r} selects none of the steps with a snapshot in {old.path} "
            f"({_summary(present) or 'none'})"
        )
    # OLD's snapshots carry OLD's run key: NEW adopts them as foreign checkpoints (into its own adopted/,
    # never writing to OLD), so its pin and points speak NEW's key (docs/PROTOCOL.md, run identity).
    foreign = list(dict.fromkeys(_roots(old_manifest) + _foreign_roots(old_manifest)))
    obj = {
        "run_id": config.raw.get("run_id", new.path.name),
        "eval": engine_needs(config.eval, old_manifest),
        "snapshot_roots": _roots(old_manifest),
        "trainer": {"kind": REEVAL_KIND, "from_run": str(old.path), "from_run_id": old_manifest.run_id,
                    "from_run_key": run_key(old_manifest),
                    "steps": selection.text, "foreign_roots": foreign},
        "lease": config.raw.get("lease", old_manifest.to_json()["lease"]),
        "created": time.time(),
    }
    manifest = parse_manifest(obj, config.path)
    if new.manifest_path.exists():
        _check_same(new, manifest)
    return ReevalPlan(new, old, old_manifest, config, selection, selected, manifest)


def engine_needs(eval_section: dict[str, Any], old: RunManifest) -> dict[str, Any]:
    """``eval_section`` with what OLD's engine needed to load OLD's snapshots, where the config leaves it
    out: ``base_model`` (a LoRA run's snapshots are adapters on it) and OLD's engine settings under the
    config's own (``dtype``, ...). The config's values win."""
    out = dict(eval_section)
    if old.eval.base_model is not None and "base_model" not in out:
        out["base_model"] = old.eval.base_model
    if old.eval.engine:
        out["engine"] = {**old.eval.engine, **out.get("engine", {})}
    return out


def _check_same(new: RunDir, manifest: RunManifest) -> None:
    existing = new.manifest()
    same = (
        existing.trainer.get("kind") == REEVAL_KIND
        and all(existing.trainer.get(k) == manifest.trainer[k] for k in ("from_run", "steps"))
        and existing.eval == manifest.eval
    )
    if not same:
        raise ValueError(
            f"{new.manifest_path} exists and is not this re-evaluation (same --from-run, --eval-config and "
            "--steps): pick a new --run-dir"
        )


def _summary(steps: list[int]) -> str:
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    return f"{len(steps)} steps, {steps[0]}..{steps[-1]}"


def create_reeval_run(plan: ReevalPlan) -> RunDir:
    """Write NEW (run dir, data files, run.json); OLD is only read."""
    return publish_run(plan.new.path, plan.manifest, plan.config)
