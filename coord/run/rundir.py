"""The run directory: the one place on the shared filesystem through which jobs talk.

Owns the layout (names below) and nothing about their contents, which the other ``coord`` modules
own. Layout::

    RUN/run.json          manifest (ckpteval.coord.run.manifest)
    RUN/snapshots/        default staging root for exported snapshots (ckpteval.coord.snapshots.snapshot)
    RUN/leases/           one lease file per claimed work unit (ckpteval.coord.work.claims), under
                          leases/step-<N>/ (unit_dir)
    RUN/results/          one result JSON per work unit (ckpteval.coord.results.files), under results/step-<N>/
    RUN/results/duplicates/  later copies of a unit's result (first writer wins), for audit
    RUN/results/step-<N>/step.summary  the step's results summed up for status and plot (ckpteval.coord.results.summary)
    RUN/adopted/          markers of foreign checkpoints admitted after quiescence (ckpteval.coord.snapshots.discovery)
    RUN/lost/             <step>.json per foreign save seen but rotated away before admission (ckpteval.coord.snapshots.discovery)
    RUN/best/<metric>.json  per metric: the best step and the steps not distinguishable from it (ckpteval.jobs.decide)
    RUN/until.json        backfill --until: the condition, the first passing step, the steps evaluated
    RUN/grants.jsonl      adaptive evaluation's added units and why (ckpteval.coord.work.grants)
    RUN/ledger.jsonl      the trainer's append-only dispatch/ingest record (ckpteval.coord.run.ledger)
    RUN/metrics.jsonl     every metric the trainer logged
    RUN/data/             eval-set JSONL files referenced by run.json
    RUN/TRAINING_DONE     written once when training has finished (final step)
    RUN/CONFIG_REFUSED    written by a worker that refused the run's configuration at start (exit 2)
    RUN/INTERRUPTED       written when a supervisor (``ckpteval demo``) stopped the run early; removed on --resume
    RUN/service_ledger.jsonl   the checkpoint-watching service's ingest record (ckpteval.coord.run.ledger)
    RUN/service_metrics.jsonl  every point the service logged (ckpteval.jobs.metrics)
    RUN/base/             the base model dir (config, tokenizer) exports copy into each snapshot
    RUN/train_ckpt/       the reference trainer's resumable checkpoints (step-<N>/), read on --resume
    RUN/judge_cache/      judge verdicts, one file per (judge, template, question, response, reference) (ckpteval.coord.results.verdicts)
    RUN/judge.json        the judge server launched for this run: its URL (ckpteval.coord.results.verdicts)
    RUN/weight_checksums/ per (snapshot, checksum layout) a dir of engine checksums observed and the one that
                          stands once reproduced (ckpteval.coord.snapshots.weight_checksums: the sglang consistency proof)

Guarantee: :meth:`RunDir.create` is idempotent and leaves every directory fsync'd. Limits: it does not
lock the run; two trainers writing one run dir is a user error the protocol does not detect.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from ckpteval.coord.atomic import fsync_dir, read_json_object, write_json_atomic
from ckpteval.coord.run.manifest import RunManifest, load_manifest, save_manifest

SUBDIRS = ("snapshots", "leases", "results", "adopted", "data")
STEP_DIR_PREFIX = "step-"  # results/step-<N>/, leases/step-<N>/: one directory per step
DUPLICATES = "duplicates"  # results/duplicates/: results that lost first-writer-wins, kept for audit
# results/step-<N>/step.summary: what status and plot need of the step's results (ckpteval.coord.results.summary); not
# "*.json", so no result reader takes it for a result
STEP_SUMMARY = "step.summary"


def step_dir_name(step: int) -> str:
    """``step-<10 digits>``: a step's directory under ``results/`` and ``leases/``."""
    return f"{STEP_DIR_PREFIX}{step:010d}"


def step_of_dir(name: str) -> int | None:
    """The step a ``step-<N>`` directory name stands for; None for any other name."""
    digits = name[len(STEP_DIR_PREFIX):]
    return int(digits) if name.startswith(STEP_DIR_PREFIX) and digits.isdigit() else None


def unit_dir(root: Path, step: int) -> Path:
    """Where a unit of ``step`` keeps its files under ``root`` (``results/`` or ``leases/``): its step's
    directory.

    Why per step: a run of 100k steps x 640 units is 64M files; Lustre serializes creates in one directory
    on its lock and every listing reads all of it. A step's directory holds only that step's units (a few
    thousand at most), and readers list only the steps they still wait for."""
    return Path(root) / step_dir_name(step)


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path).expanduser().resolve())

    # -- names ---------------------------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        return self.path / "run.json"

    @property
    def snapshots(self) -> Path:
        return self.path / "snapshots"

    @property
    def leases(self) -> Path:
        return self.path / "leases"

    @property
    def results(self) -> Path:
        return self.path / "results"

    @property
    def adopted(self) -> Path:
        return self.path / "adopted"

    @property
    def lost(self) -> Path:
        return self.path / "lost"

    def best_path(self, metric: str) -> Path:
        """``RUN/best/<metric>.json``: ``ckpteval best``'s decision by ``metric`` ("/" written "__": one file
        per metric, so deciding by another metric never overwrites a decision)."""
        return self.path / "best" / f"{metric.replace('/', '__')}.json"

    @property
    def until_path(self) -> Path:
        return self.path / "until.json"

    @property
    def data(self) -> Path:
        return self.path / "data"

    @property
    def ledger_path(self) -> Path:
        return self.path / "ledger.jsonl"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def done_path(self) -> Path:
        return self.path / "TRAINING_DONE"

    @property
    def interrupted_path(self) -> Path:
        return self.path / "INTERRUPTED"

    @property
    def refused_path(self) -> Path:
        return self.path / "CONFIG_REFUSED"

    @property
    def service_ledger_path(self) -> Path:
        return self.path / "service_ledger.jsonl"

    @property
    def service_metrics_path(self) -> Path:
        return self.path / "service_metrics.jsonl"

    @property
    def base(self) -> Path:
        return self.path / "base"

    @property
    def train_ckpt(self) -> Path:
        return self.path / "train_ckpt"

    @property
    def judge_cache(self) -> Path:
        return self.path / "judge_cache"

    @property
    def judge_path(self) -> Path:
        return self.path / "judge.json"

    @property
    def contamination_path(self) -> Path:
        """``RUN/contamination.json``: the contamination gate's matches (:mod:`ckpteval.coord.results.contamination`)."""
        return self.path / "contamination.json"

    @property
    def weight_checksums(self) -> Path:
        return self.path / "weight_checksums"

    # -- lifecycle ---------------------------------------------------------------------------------
    @classmethod
    def create(cls, path: Path, manifest: RunManifest | None = None) -> RunDir:
        """Create the layout (idempotent) and write ``run.json`` if a manifest is given."""
        run = cls(path)
        run.path.mkdir(parents=True, exist_ok=True)
        for name in SUBDIRS:
            (run.path / name).mkdir(exist_ok=True)
        fsync_dir(run.path)
        if manifest is not None:
            save_manifest(run.manifest_path, manifest)
        return run

    @classmethod
    def open(cls, path: Path) -> RunDir:
        """Open an existing run; FileNotFoundError names what is missing, ValueError what is unreadable."""
        run = cls(path)
        if run.path.exists() and not run.path.is_dir():
            raise ValueError(f"{run.path}: not a directory (a run directory holds run.json)")
        if run.path.is_dir() and not os.access(run.path, os.R_OK | os.X_OK):
            raise ValueError(f"{run.path}: the run directory is not readable by this user")
        if run.manifest_path.exists() and not run.manifest_path.is_file():
            raise ValueError(f"{run.manifest_path}: not a regular file")
        if not run.manifest_path.is_file():
            raise FileNotFoundError(f"{run.manifest_path}: not a ckpteval run directory (no run.json)")
        for sub in (run.results, run.leases):
            if sub.exists() and not sub.is_dir():
                raise ValueError(f"{sub}: not a directory (the run layout needs one here)")
        if not os.access(run.manifest_path, os.R_OK):
            raise ValueError(f"{run.manifest_path}: not readable by this user")
        return run

    def manifest(self) -> RunManifest:
        return load_manifest(self.manifest_path)

    def resolve_data_path(self, path: str) -> Path:
        """Dataset paths in run.json are relative to the run dir unless absolute."""
        p = Path(path)
        return p if p.is_absolute() else self.path / p

    # -- training done ---------------------------------------------------------------------------
    def mark_training_done(self, final_step: int) -> None:
        write_json_atomic(self.done_path, {"final_step": final_step, "time": time.time()})

    def training_done(self) -> int | None:
        """The final step if training has finished, else None."""
        try:
            obj = read_json_object(self.done_path)
        except FileNotFoundError:
            return None
        step = obj.get("final_step")
        if not isinstance(step, int):
            raise ValueError(f"{self.done_path}: field final_step must be an integer")
        return step

    # -- interrupted -----------------------------------------------------------------------------
    def mark_interrupted(self, by: str, signal_name: str) -> None:
        """Record that the run was stopped early (a Ctrl-C or SIGTERM to its supervisor): readers then know
        no trainer will publish more snapshots, as after ``TRAINING_DONE``."""
        write_json_atomic(self.interrupted_path, {"by": by, "signal": signal_name, "time": time.time()})

    def interrupted(self) -> dict | None:
        """The INTERRUPTED record (``by``, ``signal``, ``time``) if the run was stopped early, else None."""
        try:
            return read_json_object(self.interrupted_path)
        except FileNotFoundError:
            return None

    def clear_interrupted(self) -> None:
        """A resumed run is running again (``ckpteval train --resume``)."""
        self.interrupted_path.unlink(missing_ok=True)

    # -- config refused ------------------------------------------------------------------------------
    def refuse_config(self, by: str, message: str) -> None:
        """Record that a consumer refused this run's configuration at start (it can never evaluate a unit;
        docs/PROTOCOL.md): the trainer then skips points instead of waiting for a fleet that cannot run."""
        write_json_atomic(self.refused_path, {"by": by, "message": message, "time": time.time()})

    def config_refused(self) -> dict | None:
        """The CONFIG_REFUSED record (``by``, ``message``, ``time``), else None (also when unreadable)."""
        try:
            return read_json_object(self.refused_path)
        except (FileNotFoundError, ValueError):
            return None

    def ended(self) -> bool:
        """No trainer will publish another snapshot: training is done or the run was interrupted."""
        return self.training_done() is not None or self.interrupted() is not None
