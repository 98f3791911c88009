"""The reference trainer's options and their validation, importable without torch.

``ckpteval train`` parses and validates here (a bad flag costs no torch import and writes nothing),
then hands the validated :class:`TrainConfig` to :mod:`ckpteval.jobs.reference.train.main`. Each field of
:class:`TrainConfig` is its flag (:mod:`ckpteval.jobs.flags`); its ``dispatch`` component is the library's
:class:`ckpteval.jobs.trainer.config.DispatchConfig`, whose fields are the ``--eval-*`` dispatch flags
(declared there, once).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckpteval.coord.results.conditions import check_metric, parse_condition
from ckpteval.coord.run.identity import run_key
from ckpteval.coord.run.manifest import LeaseSettings
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.discovery import refuse_other_runs
from ckpteval.jobs.eval.worker.evalconfig import read_eval_config
from ckpteval.jobs.flags import (
    Parser,
    accept_positional_run_dir,
    add_options,
    check_bounds,
    fail,
    from_args,
    nested,
    option,
    run_dir_from_args,
)
from ckpteval.jobs.metrics import check_wandb_login
from ckpteval.jobs.pathchecks import check_dir_creatable, make_dir_writable
from ckpteval.jobs.trainer.config import EVAL, DispatchConfig

if TYPE_CHECKING:
    from ckpteval.jobs.reference.model import ModelConfig


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
    untied_lm_head: bool = option(False, "an lm_head of its own instead of the input embedding's (tied, the "
                                  "default): a vLLM server on CPU then reloads each snapshot in place rather "
                                  "than relaunching (docs/USER_GUIDE.md, vLLM)")
    # evaluation
    eval: bool = option(True, "train without an eval dispatcher (no snapshots, no points)",
                        flag="--no-eval", group=EVAL)
    eval_at_start: bool = option(True, "do not evaluate the initial weights as step 0 (default: step 0 is a "
                                 "point, once per run)", flag="--no-eval-at-start", group=EVAL)
    eval_samples: int = option(0, "also evaluate 'addition-sampled': the eval set's first 32 prompts, N samples "
                               "each at temperature 1, reporting pass@1, pass@N and maj@N (0: off)",
                               metavar="N", min=0, group=EVAL)
    eval_config: Path | None = option(None, "evaluate the datasets of this eval-config file (the format "
                                      "`ckpteval worker --eval-config` takes) instead of the built-in addition "
                                      "set; its lease settings win over --lease-*", metavar="FILE", group=EVAL)
    eval_posture: str = option("fleet", "fleet: separate eval workers; shared: the trainer evaluates "
                               "in-process (pause-the-world)", choices=("fleet", "shared"), group=EVAL)
    eval_n_prompts: int = option(128, "prompts in the built-in addition eval set", metavar="N", min=1,
                                 group=EVAL)
    eval_shard_size: int = option(64, "prompts per work unit", metavar="N", min=1, group=EVAL)
    lease_duration: float = option(LeaseSettings.duration_s, "work-unit lease duration written to run.json", metavar="S", gt=0,
                                   group=EVAL)
    lease_heartbeat: float = option(LeaseSettings.heartbeat_s, "lease heartbeat interval (< --lease-duration)", metavar="S", gt=0,
                                    group=EVAL)
    dispatch: DispatchConfig = nested(DispatchConfig)  # the --eval-* dispatch flags (their defaults: there)
    model: ModelConfig | None = None  # None: the reference defaults (not a flag; importing it needs torch)

    def validate(self) -> DispatchConfig | None:
        """Check the training flags and return the eval config for this run dir (None with --no-eval)."""
        check_bounds(self)
        if self.run_id is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.run_id):
            raise ValueError(f"--run-id {self.run_id!r} must match [A-Za-z0-9_-]{{1,64}}")
        if self.lease_heartbeat >= self.lease_duration:
            raise ValueError(f"--lease-heartbeat ({self.lease_heartbeat:g}) must be below --lease-duration "
                             f"({self.lease_duration:g})")
        if self.wandb:
            check_wandb_login()  # not installed, or no login: one line, before run.json is written
        check_dir_creatable("--run-dir", self.run_dir)
        d = self.dispatch
        for flag, path in (("--eval-staging-dir", d.staging_dir), ("--save-hf", d.save_hf_dir)):
            if path is not None:
                check_dir_creatable(flag, path)
        builtin = {"addition"} | ({"addition-sampled"} if self.eval_samples else set())
        for flag, metric in d.metric_flags():
            if not self.eval:
                raise ValueError(f"{flag} needs the eval dispatcher: drop --no-eval")
            if self.eval_config is None:  # the built-in sets: checked before anything is written
                check_metric(parse_condition(f"{metric} >= 0", flag), builtin, flag)
        if self.eval and self.eval_config is not None:
            read_eval_config(Path(self.eval_config))  # and its data files: a bad one fails before torch loads
        return self.dispatch.for_run(self.run_dir) if self.eval else None


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


def check_output_dir(cfg: TrainConfig) -> None:
    """Refuse a ``--save-hf`` dir holding another run's checkpoints (ValueError naming one), before writing:
    this run would overwrite them and that run's evaluation would score these weights as its own."""
    if cfg.dispatch.save_hf_dir is None:
        return
    run = RunDir(cfg.run_dir)
    own = run_key(run.manifest()) if run.manifest_path.is_file() else None
    refuse_other_runs(cfg.dispatch.save_hf_dir, own, "--save-hf")


def make_output_dirs(cfg: TrainConfig) -> None:
    """Create the snapshot dirs the flags name (``--eval-staging-dir``, ``--save-hf``) and prove them
    writable, after every check and before run.json: ValueError naming the flag otherwise."""
    if not cfg.eval:
        return
    for flag, path in (("--eval-staging-dir", cfg.dispatch.staging_dir), ("--save-hf", cfg.dispatch.save_hf_dir)):
        if path is not None:
            make_dir_writable(flag, path)


def main(argv: list[str]) -> int:
    """``ckpteval train``: validate everything, then (and only then) write the run and train."""
    try:
        cfg = parse_args(argv)  # a config breaking a rule of its own (DispatchConfig) fails here, in one line
        dispatch = cfg.validate()  # fail fast: before anything is written or trained
        check_existing_run(cfg, dispatch)  # a run already there: checked before anything is written
        check_output_dir(cfg)  # another run's checkpoints in --save-hf: refused before they are overwritten
        make_output_dirs(cfg)  # the first write: a staging dir the filesystem refuses fails here, no run.json
    except (ValueError, FileNotFoundError) as e:
        return fail("ckpteval train", e)
    except PermissionError as e:
        return fail("ckpteval train", f"{e.filename}: permission denied")
    from ckpteval.jobs.reference.train.main import run_training

    return run_training(cfg, dispatch)
