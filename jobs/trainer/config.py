"""The trainer's eval configuration: one nested object, declared once (torchtitan's pattern).

:class:`DispatchConfig` is what a trainer says about evaluation — cadence, snapshot source, overflow,
the fleet, the node lists, ``stop_when`` — and its component :class:`Waits` (how long it waits for the
fleet). Every field states its default and its documentation once: the docstring below the field is
also the ``--help`` text of its flag (:func:`ckpteval.jobs.flags.option`). Everything maps onto it:
the library entry point (``EvalRun(dispatch=DispatchConfig(...))``,
:mod:`ckpteval.jobs.trainer.session`), the reference trainer's ``--eval-*`` flags (its ``TrainConfig``
nests this class, :func:`ckpteval.jobs.flags.nested`), the HF ``Trainer`` callback (which reads the
dispatcher's config) and :class:`~ckpteval.jobs.trainer.dispatcher.EvalDispatcher`, which takes it whole.

Guarantee: a config that exists is consistent — every rule that needs no filesystem is checked in
``__post_init__`` (``ValueError`` naming the field and its flag); :meth:`DispatchConfig.for_run` adds
what needs the run dir and the filesystem (the default staging dir ``RUN/snapshots``, absolute paths,
node-locality). Limits: node-locality is detected from the filesystem type (tmpfs/ramfs are node-local);
a local ext4/xfs disk is not flagged, since this module cannot know whether it is shared. Node lists
are *given* (the launcher reads them from the scheduler): this module knows no scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from ckpteval.coord.results.conditions import parse_condition
from ckpteval.jobs.flags import check_bounds, nested, option

OverflowPolicy = Literal["backpressure", "skip"]
Fleet = Literal["attached", "none"]
NODE_LOCAL_FS = {"tmpfs", "ramfs"}
EVAL = "evaluation"


def _node_list(text: str) -> tuple[str, ...]:
    return tuple(n for n in text.split(",") if n)


@dataclass(frozen=True)
class Waits:
    """How long the dispatcher waits for the eval fleet (never for eval itself between points)."""

    poll_interval_s: float = option(2.0, flag="--eval-poll-interval", metavar="S", min=0, group=EVAL)
    """seconds between listings of results/ (0: at every step)"""
    backpressure_timeout_s: float = option(300.0, flag="--eval-backpressure-timeout", metavar="S", min=0,
                                           group=EVAL)
    """longest wait for the fleet under backpressure before the point is skipped"""
    drain_timeout_s: float = option(300.0, flag="--eval-drain-timeout", metavar="S", min=0, group=EVAL)
    """longest wait at the end for outstanding points"""

    def __post_init__(self) -> None:
        check_bounds(self, fields=True)


@dataclass(frozen=True)
class DispatchConfig:
    """What the trainer's ``--eval-*`` flags mean, validated as one (see the module docstring)."""

    eval_interval: int = option(100, metavar="N", min=1, group=EVAL)
    """dispatch an eval point every N steps (and at the last step)"""
    staging_dir: Path | None = option(None, flag="--eval-staging-dir", metavar="DIR", group=EVAL)
    """staging mode: export snapshots here (default RUN/snapshots)"""
    save_hf_dir: Path | None = option(None, flag="--save-hf", metavar="DIR", group=EVAL)
    """reuse mode: save HF checkpoints here; they are the snapshots (needs --save-interval)"""
    save_interval: int | None = option(None, metavar="N", min=1, group=EVAL)
    """reuse mode: save an HF checkpoint every N steps"""
    max_in_flight: int = option(2, flag="--eval-max-in-flight", metavar="N", min=1, group=EVAL)
    """points dispatched but not yet landed before the overflow policy applies"""
    keep_snapshots: int = option(2, flag="--eval-keep-snapshots", metavar="N", min=1, group=EVAL)
    """snapshots kept on disk (>= --eval-max-in-flight)"""
    keep_best: int = option(0, flag="--eval-keep-best", metavar="K", min=0, group=EVAL)
    """GC never deletes a snapshot currently among the best K points by --eval-best-metric (0: off)"""
    best_metric: str | None = option(None, flag="--eval-best-metric", metavar="M", group=EVAL)
    """the point metric ranking --eval-keep-best, higher is better (default eval/<first dataset>)"""
    stop_when: str | None = option(None, flag="--eval-stop-when", metavar="COND", group=EVAL)
    """finish training cleanly (final snapshot, final point) once an ingested point meets COND, e.g.
    'eval/addition >= 0.9' (add 'margin mde' or 'margin 0.02': it must pass by that much)"""
    stop_plateau: str | None = option(None, flag="--eval-stop-plateau", metavar="RULE", group=EVAL)
    """finish training cleanly once no point of the last N beats the best before them by its MDE, e.g.
    'eval/addition over 5' (optionally 'alpha 0.05': the false-stop error, spent across looks)"""
    adaptive: str | None = option(None, flag="--eval-adaptive", metavar="SPEC", group=EVAL)
    """spend more samples where a decision is still open (candidate best steps, steps near the
    --eval-stop-when target), e.g. 'eval/gsm8k mde 0.03 max-samples 32 budget 0.1' (budget: a fraction of
    training's GPU-seconds, or 'budget 600s' GPU-seconds per point)"""
    overflow_policy: OverflowPolicy = option("backpressure", flag="--eval-overflow-policy", group=EVAL)
    """when too many points are in flight: wait for the fleet (backpressure) or skip the point (skip)"""
    fleet: Fleet = option("attached", flag="--eval-fleet", group=EVAL)
    """none: no eval fleet runs while training (reuse mode) — never wait for one; points stay pending for a
    later `ckpteval backfill` (ingested if it lands while training runs)"""
    trainer_nodes: tuple[str, ...] | None = option(None, metavar="N1,N2", parse=_node_list, group=EVAL)
    """comma list of the trainer's nodes (node-locality check of the staging dir)"""
    fleet_nodes: tuple[str, ...] | None = option(None, metavar="N1,N2", parse=_node_list, group=EVAL)
    """comma list of the eval fleet's nodes (node-locality check)"""
    trainer_gpus: int | None = None
    """GPUs training holds, for eval/cost/fraction_of_training (None: detected, jobs.trainer.cost); not a flag"""
    waits: Waits = nested(Waits)
    """how long the dispatcher waits for the fleet (a component: its flags are this config's)"""

    def __post_init__(self) -> None:
        if not isinstance(self.eval_interval, int):
            raise ValueError(f"eval_interval (--eval-interval) must be a positive integer, got {self.eval_interval!r}")
        check_bounds(self, fields=True)
        if self.trainer_gpus is not None and self.trainer_gpus < 0:
            raise ValueError(f"trainer_gpus must be >= 0 (None: detected), got {self.trainer_gpus}")
        if self.staging_dir is not None and self.save_hf_dir is not None:
            raise ValueError("staging_dir (--eval-staging-dir) and save_hf_dir (--save-hf) both given: choose "
                             "staging export or checkpoint reuse")
        if self.keep_snapshots < self.max_in_flight:
            raise ValueError(f"keep_snapshots (--eval-keep-snapshots, {self.keep_snapshots}) must be >= "
                             f"max_in_flight (--eval-max-in-flight, {self.max_in_flight}); raise keep or lower in-flight")
        if self.best_metric is not None and not self.best_metric.startswith("eval/"):
            raise ValueError(f"best_metric (--eval-best-metric) {self.best_metric!r}: expected a point metric "
                             "eval/<dataset>[/...]")
        if self.stop_when is not None:
            parse_condition(self.stop_when, "--eval-stop-when")
        self.metric_flags()  # --eval-stop-plateau and --eval-adaptive parse (one ValueError naming the flag)
        if self.fleet == "none" and self.mode != "reuse":
            raise ValueError("--eval-fleet none (fleet) keeps every point pending for a later backfill: use reuse "
                             "mode (--save-hf DIR --save-interval N) so no snapshot piles up in a staging dir")
        if self.save_hf_dir is not None and self.save_interval is None:
            raise ValueError("save_hf_dir (--save-hf) needs --save-interval N (save_interval >= 1)")
        if self.save_interval and self.mode == "reuse" and self.eval_interval % self.save_interval:
            raise ValueError(f"eval_interval (--eval-interval {self.eval_interval}) must be a multiple of --save-interval "
                             f"{self.save_interval} (save_interval) in reuse mode: only saved checkpoints can be evaluated")

    def metric_flags(self) -> list[tuple[str, str]]:
        """(flag, the point metric it names) of the flags that name a dataset's metric, to check
        against a run's datasets; ValueError naming the flag when one does not parse."""
        from ckpteval.jobs.trainer.adaptive.policy import parse_adaptive  # scipy: only for a run that asks
        from ckpteval.jobs.trainer.plateau import parse_plateau

        out = []
        if self.stop_when is not None:
            out.append(("--eval-stop-when", parse_condition(self.stop_when, "--eval-stop-when").metric))
        if self.stop_plateau is not None:
            out.append(("--eval-stop-plateau", parse_plateau(self.stop_plateau, "--eval-stop-plateau").metric))
        if self.adaptive is not None:
            out.append(("--eval-adaptive", f"eval/{parse_adaptive(self.adaptive, '--eval-adaptive').dataset}"))
        return out

    @property
    def mode(self) -> str:
        return "reuse" if self.save_hf_dir is not None else "staging"

    @property
    def snapshot_root(self) -> Path:
        root = self.save_hf_dir if self.mode == "reuse" else self.staging_dir
        if root is None:
            raise ValueError("no snapshot source configured: DispatchConfig.for_run(run_dir) names RUN/snapshots")
        return root

    def with_waits(self, **waits: float) -> DispatchConfig:
        """This config with some :class:`Waits` changed: ``config.with_waits(poll_interval_s=0)``."""
        return replace(self, waits=replace(self.waits, **waits))

    def for_run(self, run_dir: Path) -> DispatchConfig:
        """This config for the run at ``run_dir``: staging into ``RUN/snapshots`` unless a snapshot dir is
        given, paths absolute, the node-locality rule checked (ValueError naming the field)."""
        staging = self.staging_dir
        if staging is None and self.save_hf_dir is None:
            staging = Path(run_dir) / "snapshots"
        resolved = replace(self, staging_dir=_resolve("staging_dir (--eval-staging-dir)", staging),
                           save_hf_dir=_resolve("save_hf_dir (--save-hf)", self.save_hf_dir))
        resolved._check_locality()
        return resolved

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
        """This run's snapshot root (:meth:`run_snapshot_root`), which run.json must list: ``ValueError``
        naming ``manifest_path`` if it does not (the flags differ from the ones the run started with).
        The one check behind ``--resume`` and the dispatcher."""
        scoped = self.run_snapshot_root(key, run_dir)
        listed = {Path(r).resolve() for r in listed_roots}
        if scoped.resolve() not in listed:
            raise ValueError(
                f"{manifest_path}: snapshot_roots {sorted(map(str, listed))} does not list {scoped}: "
                "continue the run with the snapshot flags it started with (--eval-staging-dir / --save-hf)")
        return scoped

    def _check_locality(self) -> None:
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


def _resolve(what: str, path: Path | None) -> Path | None:
    if path is None:
        return None
    try:
        return Path(path).expanduser().resolve()
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{what}: cannot resolve {path!r} ({e})") from None


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

