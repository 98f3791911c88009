"""Validation of a trainer's eval settings: the whole posture matrix, checked before training starts.

Every error is a ``ValueError`` whose message names the flag and says how to fix it. The checks are
pure (paths, numbers, filesystem type); node lists are *given* (the launcher reads them from the
scheduler), so this module knows no scheduler.

Limits: node-locality is detected from the filesystem type (tmpfs/ramfs are node-local); a local
ext4/xfs disk is not flagged, since this module cannot know whether it is shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

OVERFLOW_POLICIES = ("backpressure", "skip")
FLEETS = ("attached", "none")
NODE_LOCAL_FS = {"tmpfs", "ramfs"}


@dataclass(frozen=True)
class Waits:
    """How long the dispatcher waits for the eval fleet: the one statement of these defaults, which the
    library entry point (:class:`ckpteval.jobs.trainer.session.EvalRun`), the dispatcher's keyword arguments and
    the reference trainer's ``--eval-poll-interval`` / ``--eval-backpressure-timeout`` /
    ``--eval-drain-timeout`` flags all take from :data:`WAITS`."""

    poll_interval_s: float = 2.0
    """Seconds between listings of ``results/`` (0: at every step)."""
    backpressure_timeout_s: float = 300.0
    """Longest wait for the fleet under backpressure before the point is skipped."""
    drain_timeout_s: float = 300.0
    """Longest wait at the end for outstanding points."""

    def __post_init__(self) -> None:
        for key in ("poll_interval_s", "backpressure_timeout_s", "drain_timeout_s"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{key} must be >= 0 seconds, got {getattr(self, key)}")


WAITS = Waits()


@dataclass
class DispatchConfig:
    """What the trainer's ``--eval-*`` flags mean, validated as one."""

    eval_interval: int | None = None
    staging_dir: Path | None = None  # staging mode: export snapshots here
    save_hf_dir: Path | None = None  # reuse mode: the periodic HF checkpoints are the snapshots
    save_interval: int | None = None
    max_in_flight: int = 2
    keep_snapshots: int = 2
    overflow_policy: str = "backpressure"
    trainer_nodes: tuple[str, ...] | None = None
    fleet_nodes: tuple[str, ...] | None = None
    fleet: str = "attached"  # "none": no eval fleet runs during training; points wait for a backfill
    keep_best: int = 0  # GC never deletes a snapshot currently among the best K points (0: off)
    best_metric: str | None = None  # what ranks them: a point metric (None: eval/<first dataset>), higher better
    trainer_gpus: int | None = None  # GPUs training holds, for eval/cost/fraction_of_training (None: detected)

    @property
    def mode(self) -> str:
        return "reuse" if self.save_hf_dir is not None else "staging"

    @property
    def snapshot_root(self) -> Path:
        root = self.save_hf_dir if self.mode == "reuse" else self.staging_dir
        if root is None:
            raise ValueError("no snapshot source configured")
        return root

    def run_snapshot_root(self, key: str, run_dir: Path) -> Path:
        """Where this run's snapshots go: in staging mode a per-run subdir ``<staging>/<run key>`` (runs
        sharing a staging dir never share names), unless the staging dir is the run's own
        ``RUN/snapshots``; in reuse mode the checkpoint dir itself. List it in run.json's
        ``snapshot_roots``."""
        root = self.snapshot_root
        if self.mode == "reuse" or root.resolve() == (Path(run_dir) / "snapshots").resolve():
            return root
        return root / key

    def listed_snapshot_root(self, listed_roots: tuple[str, ...] | list[str], key: str, run_dir: Path,
                             manifest_path: Path) -> Path:
        """The root of this run's snapshots that run.json lists: the run-scoped root
        (:meth:`run_snapshot_root`), or the configured root itself (a manifest written before run-scoped
        staging). ``ValueError`` naming ``manifest_path`` if it lists neither (the flags differ from the
        ones the run started with). The one check behind ``--resume`` and the dispatcher."""
        listed = {Path(r).resolve() for r in listed_roots}
        scoped = self.run_snapshot_root(key, run_dir)
        for root in (scoped, self.snapshot_root):
            if root.resolve() in listed:
                return root
        raise ValueError(
            f"{manifest_path}: snapshot_roots {sorted(map(str, listed))} does not list {scoped}: "
            "continue the run with the snapshot flags it started with (--eval-staging-dir / --save-hf)"
        )

    def validate(self) -> DispatchConfig:
        """Check every rule; returns self with paths resolved to absolute ones."""
        if self.eval_interval is None or self.eval_interval < 1:
            raise ValueError("--eval-interval: an eval fleet needs a positive eval interval (e.g. --eval-interval 100)")
        if self.staging_dir is None and self.save_hf_dir is None:
            raise ValueError(
                "no snapshot source: pass --eval-staging-dir DIR (export snapshots) or "
                "--save-hf DIR --save-interval N (reuse the periodic HF checkpoints)"
            )
        if self.staging_dir is not None and self.save_hf_dir is not None:
            raise ValueError("--eval-staging-dir and --save-hf both given: choose staging export or checkpoint reuse")
        if self.max_in_flight < 1:
            raise ValueError(f"--eval-max-in-flight must be >= 1, got {self.max_in_flight}")
        if self.keep_snapshots < self.max_in_flight:
            raise ValueError(
                f"--eval-keep-snapshots ({self.keep_snapshots}) must be >= --eval-max-in-flight "
                f"({self.max_in_flight}); raise keep or lower in-flight"
            )
        if self.trainer_gpus is not None and self.trainer_gpus < 0:
            raise ValueError(f"trainer_gpus must be >= 0 (None: detected), got {self.trainer_gpus}")
        if self.keep_best < 0:
            raise ValueError(f"--eval-keep-best must be >= 0, got {self.keep_best}")
        if self.best_metric is not None and not self.best_metric.startswith("eval/"):
            raise ValueError(f"--eval-best-metric {self.best_metric!r}: expected a point metric eval/<dataset>[/...]")
        if self.overflow_policy not in OVERFLOW_POLICIES:
            raise ValueError(f"--eval-overflow-policy must be one of {OVERFLOW_POLICIES}, got {self.overflow_policy!r}")
        if self.fleet not in FLEETS:
            raise ValueError(f"--eval-fleet must be one of {FLEETS}, got {self.fleet!r}")
        if self.fleet == "none" and self.mode != "reuse":
            raise ValueError(
                "--eval-fleet none keeps every point pending for a later backfill: use reuse mode "
                "(--save-hf DIR --save-interval N) so no snapshot piles up in a staging dir"
            )
        if self.mode == "reuse":
            self._validate_reuse()
        self.staging_dir = _resolve("--eval-staging-dir", self.staging_dir)
        self.save_hf_dir = _resolve("--save-hf", self.save_hf_dir)
        self._validate_locality()
        return self

    def _validate_reuse(self) -> None:
        if self.save_interval is None or self.save_interval < 1:
            raise ValueError("--save-hf needs --save-interval N (N >= 1)")
        if self.eval_interval is not None and self.eval_interval % self.save_interval:
            raise ValueError(
                f"--eval-interval ({self.eval_interval}) must be a multiple of --save-interval "
                f"({self.save_interval}) in reuse mode: only saved checkpoints can be evaluated"
            )

    def _validate_locality(self) -> None:
        root = self.snapshot_root
        fs = filesystem_type(root)
        if fs not in NODE_LOCAL_FS or self.fleet_nodes is None:
            return
        trainer = set(self.trainer_nodes or ())
        fleet = set(self.fleet_nodes)
        if not trainer or fleet - trainer:
            raise ValueError(
                f"{root} is node-local ({fs}) but the eval fleet runs on {sorted(fleet - trainer) or sorted(fleet)} "
                f"and the trainer on {sorted(trainer)}: use a shared-filesystem staging dir, or put the fleet "
                "on the trainer's node"
            )


def _resolve(flag: str, path: Path | None) -> Path | None:
    if path is None:
        return None
    try:
        return Path(path).expanduser().resolve()
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{flag}: cannot resolve {path!r} ({e})") from None


def filesystem_type(path: Path, mounts_file: Path = Path("/proc/mounts")) -> str | None:
    """The type of the filesystem holding ``path`` (longest mount-point prefix), or None if unknown."""
    target = Path(path).expanduser().resolve()
    while not target.exists() and target != target.parent:
        target = target.parent
    try:
        lines = mounts_file.read_text().splitlines()
    except FileNotFoundError:
        return None
    best, best_type = -1, None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = Path(parts[1].replace("\\040", " "))
        if target.is_relative_to(mount) and len(str(mount)) > best:
            best, best_type = len(str(mount)), parts[2]
    return best_type
