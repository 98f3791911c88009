"""The reference trainer's options and their validation, importable without torch.

``ckpteval train`` parses and validates here (a bad flag costs no torch import and writes nothing),
then hands the validated :class:`TrainConfig` to :mod:`ckpteval.jobs.reference.train`. Each field of
:class:`TrainConfig` is its flag (:mod:`ckpteval.jobs.flags`); the eval defaults are declared once, on
:class:`ckpteval.jobs.trainer.config.DispatchConfig`.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckpteval.coord.conditions import check_metric, parse_condition
from ckpteval.coord.identity import run_key
from ckpteval.coord.manifest import LeaseSettings
from ckpteval.coord.rundir import RunDir
from ckpteval.jobs.flags import (
    Parser,
    accept_positional_run_dir,
    add_options,
    check_bounds,
    check_dir_creatable,
    fail,
    from_args,
    make_dir_writable,
    option,
    run_dir_from_args,
)
from ckpteval.jobs.trainer.config import FLEETS, OVERFLOW_POLICIES, WAITS, DispatchConfig

if TYPE_CHECKING:
    from ckpteval.jobs.reference.model import ModelConfig


EVAL = "evaluation"
_D = DispatchConfig  # the dispatch defaults are declared once, on DispatchConfig


def _node_list(text: str) -> tuple[str, ...]:
    return tuple(n for n in text.split(",") if n)


@dataclass
class TrainConfig:
    """The trainer's flags (declared once: each field is its flag, see :mod:`ckpteval.jobs.flags`)."""

    run_dir: Path = option(help="the run directory to create (or continue with --resume)", metavar="RUN")
    steps: int = option(600, "training steps (optimizer updates)", min=1)
    arch: str = option("llama", "model architecture of the tiny decoder", choices=("llama", "qwen2"))
    batch_size: int = option(128, "examples per training step", metavar="N", min=1)
    lr: float = option(3e-3, "peak learning rate", gt=0)
    lr_schedule: str = option("cosine", "cosine: linear warmup, then cosine decay to lr/10 at --steps; "
                              "constant: --lr throughout", choices=("cosine", "constant"))
    warmup_steps: int = option(30, "linear warmup steps of the cosine schedule", metavar="N", min=0)
    seed: int = option(0, "seed of the model init and of the training data", min=0)
    run_id: str | None = option(None, "the run's id in run.json, [A-Za-z0-9_-]{1,64} (default: the run "
                                "dir's name)", metavar="ID")
    log_interval: int = option(10, "log train/* metrics every N steps", metavar="N", min=1)
    ckpt_interval: int = option(100, "training checkpoint (RUN/train_ckpt/) every N steps", metavar="N", min=1)
    resume: bool = option(False, "continue from the latest training checkpoint, if any")
    threads: int | None = option(None, "torch CPU threads (default: torch's)", metavar="N", min=1)
    progress: bool = option(True, "no progress bars on stderr (the training bar, and transformers' while saving "
                            "or loading checkpoints)", flag="--no-progress")
    wandb: bool = option(False, "also log to wandb (WANDB_MODE=offline works)")
    lora: bool = option(False, "train only a LoRA adapter (peft) on the fixed seed-initialised base, saved to "
                        "RUN/base and named in run.json eval.base_model; snapshots are adapters "
                        "(adapter_config.json + adapter_model.safetensors)")
    lora_rank: int = option(16, "LoRA rank r (alpha = 2r) with --lora", metavar="R", min=1)
    # evaluation
    eval: bool = option(True, "train without an eval dispatcher (no snapshots, no points)",
                        flag="--no-eval", group=EVAL)
    eval_at_start: bool = option(True, "do not evaluate the initial weights as step 0 (default: step 0 is a "
                                 "point, once per run)", flag="--no-eval-at-start", group=EVAL)
    eval_samples: int = option(0, "also evaluate 'addition-sampled': the eval set's first 32 prompts, N samples "
                               "each at temperature 1, reporting pass@1, pass@N and maj@N (0: off)",
                               metavar="N", min=0, group=EVAL)
    eval_interval: int = option(100, "dispatch an eval point every N steps (and at the last step)",
                                metavar="N", min=1, group=EVAL)
    eval_staging_dir: Path | None = option(None, "staging mode: export snapshots here (default RUN/snapshots)",
                                           metavar="DIR", group=EVAL)
    save_hf_dir: Path | None = option(None, "reuse mode: save HF checkpoints here; they are the snapshots "
                                      "(needs --save-interval)", flag="--save-hf", metavar="DIR", group=EVAL)
    save_interval: int | None = option(None, "reuse mode: save an HF checkpoint every N steps", metavar="N",
                                       min=1, group=EVAL)
    eval_max_in_flight: int = option(_D.max_in_flight, "points dispatched but not yet landed before the "
                                     "overflow policy applies", metavar="N", min=1, group=EVAL)
    eval_keep_snapshots: int = option(_D.keep_snapshots, "snapshots kept on disk (>= --eval-max-in-flight)",
                                      metavar="N", min=1, group=EVAL)
    eval_keep_best: int = option(0, "GC never deletes a snapshot currently among the best K points by "
                                 "--eval-best-metric (0: off)", metavar="K", min=0, group=EVAL)
    eval_best_metric: str | None = option(None, "the point metric ranking --eval-keep-best, higher is better "
                                          "(default eval/<first dataset>)", metavar="M", group=EVAL)
    eval_stop_when: str | None = option(None, "finish training cleanly (final snapshot, final point) once an "
                                        "ingested point meets COND, e.g. 'eval/addition >= 0.9' (add 'margin mde' "
                                        "or 'margin 0.02': it must pass by that much)", metavar="COND",
                                        group=EVAL)
    eval_overflow_policy: str = option(_D.overflow_policy, "when too many points are in flight: wait for "
                                       "the fleet (backpressure) or skip the point (skip)",
                                       choices=OVERFLOW_POLICIES, group=EVAL)
    eval_fleet: str = option("attached", "none: no eval fleet runs while training (reuse mode) — never wait "
                             "for one; points stay pending for a later `ckpteval backfill` (ingested if it "
                             "lands while training runs)", choices=FLEETS, group=EVAL)
    eval_config: Path | None = option(None, "evaluate the datasets of this eval-config file (the format "
                                      "`ckpteval worker --eval-config` takes) instead of the built-in addition "
                                      "set; its lease settings win over --lease-*", metavar="FILE", group=EVAL)
    eval_posture: str = option("fleet", "fleet: separate eval workers; shared: the trainer evaluates "
                               "in-process (pause-the-world)", choices=("fleet", "shared"), group=EVAL)
    eval_n_prompts: int = option(128, "prompts in the built-in addition eval set", metavar="N", min=1,
                                 group=EVAL)
    eval_shard_size: int = option(64, "prompts per work unit", metavar="N", min=1, group=EVAL)
    eval_poll_interval: float = option(WAITS.poll_interval_s, "seconds between listings of results/ (0: at every step)",
                                       metavar="S", min=0,
                                       group=EVAL)
    eval_backpressure_timeout: float = option(WAITS.backpressure_timeout_s, "longest wait for the fleet under backpressure before "
                                              "the point is skipped", metavar="S", min=0, group=EVAL)
    eval_drain_timeout: float = option(WAITS.drain_timeout_s, "longest wait at the end for outstanding points", metavar="S",
                                       min=0, group=EVAL)
    lease_duration: float = option(LeaseSettings.duration_s, "work-unit lease duration written to run.json", metavar="S", gt=0,
                                   group=EVAL)
    lease_heartbeat: float = option(LeaseSettings.heartbeat_s, "lease heartbeat interval (< --lease-duration)", metavar="S", gt=0,
                                    group=EVAL)
    trainer_nodes: tuple[str, ...] | None = option(None, "comma list of the trainer's nodes (node-locality "
                                                   "check of the staging dir)", metavar="N1,N2",
                                                   parse=_node_list, group=EVAL)
    fleet_nodes: tuple[str, ...] | None = option(None, "comma list of the eval fleet's nodes (node-locality "
                                                 "check)", metavar="N1,N2", parse=_node_list, group=EVAL)
    model: ModelConfig | None = None  # None: the reference defaults (not a flag; importing it needs torch)

    def validate(self) -> DispatchConfig | None:
        """Check the training flags and return the validated eval config (None with --no-eval)."""
        check_bounds(self)
        if self.run_id is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.run_id):
            raise ValueError(f"--run-id {self.run_id!r} must match [A-Za-z0-9_-]{{1,64}}")
        if self.save_hf_dir is not None and self.save_interval is None:
            raise ValueError("--save-hf needs --save-interval N")
        if self.lease_heartbeat >= self.lease_duration:
            raise ValueError(f"--lease-heartbeat ({self.lease_heartbeat:g}) must be below --lease-duration "
                             f"({self.lease_duration:g})")
        if self.wandb and importlib.util.find_spec("wandb") is None:
            raise ValueError("--wandb needs the wandb package: pip install 'ckpteval[wandb]'")
        check_dir_creatable("--run-dir", self.run_dir)
        for flag, path in (("--eval-staging-dir", self.eval_staging_dir), ("--save-hf", self.save_hf_dir)):
            if path is not None:
                check_dir_creatable(flag, path)
        if self.eval_stop_when is not None:
            if not self.eval:
                raise ValueError("--eval-stop-when needs the eval dispatcher: drop --no-eval")
            condition = parse_condition(self.eval_stop_when, "--eval-stop-when")
            if self.eval_config is None:  # the built-in sets: checked before anything is written
                check_metric(condition, {"addition"} | ({"addition-sampled"} if self.eval_samples else set()),
                             "--eval-stop-when")
        if not self.eval:
            return None
        staging = self.eval_staging_dir
        if staging is None and self.save_hf_dir is None:
            staging = Path(self.run_dir) / "snapshots"
        return DispatchConfig(
            eval_interval=self.eval_interval,
            staging_dir=staging,
            save_hf_dir=self.save_hf_dir,
            save_interval=self.save_interval,
            max_in_flight=self.eval_max_in_flight,
            keep_snapshots=self.eval_keep_snapshots,
            keep_best=self.eval_keep_best,
            best_metric=self.eval_best_metric,
            overflow_policy=self.eval_overflow_policy,
            fleet=self.eval_fleet,
            trainer_nodes=self.trainer_nodes,
            fleet_nodes=self.fleet_nodes,
        ).validate()


DESCRIPTION = ("ckpteval train: the reference trainer — a tiny addition model on CPU, with the eval dispatcher "
               "(snapshots for an eval fleet, or in-process evaluation with --eval-posture shared).")


def build_parser() -> Parser:
    p = Parser(prog="ckpteval train", description=DESCRIPTION)
    add_options(p, TrainConfig)
    accept_positional_run_dir(p)
    return p


def parse_args(argv: list[str]) -> TrainConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    run_dir_from_args(parser, args)
    cfg: TrainConfig = from_args(TrainConfig, args)
    return cfg


def check_existing_run(cfg: TrainConfig, dispatch: DispatchConfig | None) -> None:
    """Refuse, before writing, a run dir that holds a run without --resume, or one this config cannot continue."""
    run = RunDir(cfg.run_dir)
    if not run.manifest_path.exists():
        return
    if not cfg.resume:
        raise ValueError(f"{run.path} already holds a run; pass --resume to continue it")
    manifest = RunDir.open(run.path).manifest()  # an unreadable or malformed run.json: a usage error
    if dispatch is not None:  # the same check the dispatcher makes, before anything is written
        dispatch.listed_snapshot_root(manifest.snapshot_roots, run_key(manifest), run.path, run.manifest_path)


def make_output_dirs(cfg: TrainConfig) -> None:
    """Create the snapshot dirs the flags name (``--eval-staging-dir``, ``--save-hf``) and prove them
    writable, after every check and before run.json: ValueError naming the flag otherwise."""
    if not cfg.eval:
        return
    for flag, path in (("--eval-staging-dir", cfg.eval_staging_dir), ("--save-hf", cfg.save_hf_dir)):
        if path is not None:
            make_dir_writable(flag, path)


def main(argv: list[str]) -> int:
    """``ckpteval train``: validate everything, then (and only then) write the run and train."""
    cfg = parse_args(argv)
    try:
        dispatch = cfg.validate()  # fail fast: before anything is written or trained
        check_existing_run(cfg, dispatch)  # a run already there: checked before anything is written
        make_output_dirs(cfg)  # the first write: a staging dir the filesystem refuses fails here, no run.json
    except (ValueError, FileNotFoundError) as e:
        return fail("ckpteval train", e)
    except PermissionError as e:
        return fail("ckpteval train", f"{e.filename}: permission denied")
    from ckpteval.jobs.reference.train import run_training

    return run_training(cfg, dispatch)
