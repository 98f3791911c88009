"""``ckpteval train``: the reference trainer — a tiny decoder learning 2-digit addition on CPU.

It exists to drive the eval machinery with a real model whose score climbs from 0 to ~1, and to
show how a training loop uses it: build an :class:`~jobs.trainer.dispatcher.EvalDispatcher`, call
``maybe_dispatch(step, model)`` after each optimizer step and ``close(final_step, model)`` at the
end. Read top to bottom:

1. :class:`TrainConfig` from the command line; the eval flags are validated as one
   (:meth:`jobs.trainer.config.DispatchConfig.validate`) before anything is written or trained.
2. The run directory: ``run.json`` (the eval config every consumer reads: the built-in addition set,
   or the datasets and lm-eval tasks of ``--eval-config FILE`` (read by
   :func:`jobs.eval.service.read_eval_config`, the service's reader, and checked before anything is
   written), sampling, lease settings, snapshot roots, trainer identity), ``base/`` (config + tokenizer, which
   exports copy), ``data/addition.jsonl``. Written once; a resumed run keeps them.
3. Model, optimizer, and — with ``--resume`` — the latest training checkpoint.
4. The loop: learning rate (linear warmup + cosine decay to lr/10 by default: the constant rate
   plateaus near 0.92 exact match at 600 steps, the schedule reaches 1.0 by step 400), batch, loss,
   step; in reuse mode save the HF checkpoint ``checkpoint-<step>`` every
   ``--save-interval``; ``maybe_dispatch``; log ``train/*``; save a training checkpoint every
   ``--ckpt-interval``.
5. The end: final training checkpoint (and, in reuse mode, the final HF checkpoint, whatever the
   save interval), ``dispatcher.close`` (final point, training done, drain).

Training checkpoints (``RUN/train_ckpt/step-<N>/``) hold no pickles: ``model.safetensors``
(``safetensors.torch.save_model``, tied weights stored once), ``optimizer.safetensors`` (every
optimizer state tensor plus the torch RNG state), ``state.json`` (step, param groups, config). Each
is published by an atomic directory rename; the newest two are kept. Batches are a pure function of
``(seed, step)``, so a resumed run sees exactly the data the killed one would have.

Preemption: SIGTERM or SIGUSR1 (SLURM's pre-timeout signal) makes the loop save a training
checkpoint at the next step boundary, wait (bounded) for an export in flight, and exit with status
75 (``EX_TEMPFAIL``); run it again with ``--resume`` (a requeued job does). Training is not marked
done.

Limits: CPU only, one process; the shared posture here has no producer of its own (the gate is
exercised by the tests), it shows the blocking eval path.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from tqdm import tqdm

from coord.atomic import fsync_dir, read_json_object, tmp_name, write_json_atomic
from coord.ledger import LedgerError
from coord.manifest import EvalSpec, LeaseSettings, RunManifest
from coord.rundir import RunDir
from coord.snapshot import MARKER, producer_identity
from jobs.eval.evalsets import write_addition_dataset
from jobs.eval.service import install_eval_data, read_eval_config
from jobs.metrics import MetricsSink, init_wandb
from jobs.reference.model import (
    ModelConfig,
    batch_for_training,
    build_model,
    build_tokenizer,
    make_addition_examples,
    save_base_model_dir,
    save_tokenizer,
)
from jobs.trainer.config import OVERFLOW_POLICIES, DispatchConfig
from jobs.trainer.dispatcher import EvalDispatcher, SharedEval, checkpoint_dirname

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: checkpoint saved, run again with --resume
KEEP_TRAIN_CKPTS = 2


# --------------------------------------------------------------------------------------------------
# 1. Config
# --------------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    run_dir: Path
    steps: int = 600
    arch: str = "llama"
    batch_size: int = 128
    lr: float = 3e-3
    lr_schedule: str = "cosine"  # cosine (warmup, then decay to lr/10) | constant
    warmup_steps: int = 30
    seed: int = 0
    run_id: str | None = None
    log_interval: int = 10
    ckpt_interval: int = 100
    resume: bool = False
    threads: int | None = None
    progress: bool = True
    wandb: bool = False
    # evaluation
    eval: bool = True
    eval_interval: int = 100
    eval_staging_dir: Path | None = None  # default RUN/snapshots (staging mode)
    save_hf_dir: Path | None = None  # reuse mode
    save_interval: int | None = None
    eval_max_in_flight: int = 2
    eval_keep_snapshots: int = 2
    eval_overflow_policy: str = "backpressure"
    eval_posture: str = "fleet"
    eval_config: Path | None = None  # the eval-config file (service format): replaces the built-in set
    eval_n_prompts: int = 128
    eval_shard_size: int = 64
    eval_poll_interval: float = 2.0
    eval_backpressure_timeout: float = 300.0
    eval_drain_timeout: float = 300.0
    lease_duration: float = 60.0
    lease_heartbeat: float = 10.0
    trainer_nodes: tuple[str, ...] | None = None
    fleet_nodes: tuple[str, ...] | None = None
    model: ModelConfig = field(default_factory=ModelConfig)

    def validate(self) -> DispatchConfig | None:
        """Check the training flags and return the validated eval config (None with --no-eval)."""
        for name in (
            "steps",
            "batch_size",
            "log_interval",
            "ckpt_interval",
            "eval_n_prompts",
            "eval_shard_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.lr_schedule not in ("cosine", "constant"):
            raise ValueError(f"--lr-schedule must be cosine or constant, got {self.lr_schedule!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.arch not in ("llama", "qwen2"):
            raise ValueError(f"--arch must be llama or qwen2, got {self.arch!r}")
        if self.eval_posture not in ("fleet", "shared"):
            raise ValueError(f"--eval-posture must be fleet or shared, got {self.eval_posture!r}")
        if self.run_id is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.run_id):
            raise ValueError(f"--run-id {self.run_id!r} must match [A-Za-z0-9_-]{{1,64}}")
        if self.save_hf_dir is not None and self.save_interval is None:
            raise ValueError("--save-hf needs --save-interval N")
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
            overflow_policy=self.eval_overflow_policy,
            trainer_nodes=self.trainer_nodes,
            fleet_nodes=self.fleet_nodes,
        ).validate()


def parse_args(argv: list[str]) -> TrainConfig:
    p = argparse.ArgumentParser(prog="ckpteval train", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--arch", choices=("llama", "qwen2"), default="llama")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine",
                   help="cosine: linear warmup, then cosine decay to lr/10 at --steps")
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-id", help="default: the run dir's name")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--ckpt-interval", type=int, default=100, help="training checkpoint every N steps")
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest training checkpoint, if any"
    )
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--wandb", action="store_true", help="also log to wandb (WANDB_MODE=offline works)")
    g = p.add_argument_group("evaluation")
    g.add_argument("--no-eval", dest="eval", action="store_false")
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-staging-dir", type=Path, help="export snapshots here (default RUN/snapshots)")
    g.add_argument("--save-hf", dest="save_hf_dir", type=Path, help="reuse mode: save HF checkpoints here")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--eval-max-in-flight", type=int, default=2)
    g.add_argument("--eval-keep-snapshots", type=int, default=2)
    g.add_argument("--eval-overflow-policy", choices=OVERFLOW_POLICIES, default="backpressure")
    g.add_argument("--eval-posture", choices=("fleet", "shared"), default="fleet")
    g.add_argument("--eval-config", type=Path, metavar="FILE",
                   help="evaluate the datasets of this eval-config file (the format `ckpteval worker --eval-config` "
                        "takes) instead of the built-in addition set; its lease settings win over --lease-*")
    g.add_argument("--eval-n-prompts", type=int, default=128)
    g.add_argument("--eval-shard-size", type=int, default=64)
    g.add_argument("--eval-poll-interval", type=float, default=2.0, help="seconds between results listings")
    g.add_argument("--eval-backpressure-timeout", type=float, default=300.0)
    g.add_argument("--eval-drain-timeout", type=float, default=300.0)
    g.add_argument("--lease-duration", type=float, default=60.0)
    g.add_argument("--lease-heartbeat", type=float, default=10.0)
    g.add_argument(
        "--trainer-nodes", type=_node_list, help="comma list (node-locality check of the staging dir)"
    )
    g.add_argument("--fleet-nodes", type=_node_list, help="comma list")
    return TrainConfig(**vars(p.parse_args(argv)))


def _node_list(text: str) -> tuple[str, ...]:
    return tuple(n for n in text.split(",") if n)


# --------------------------------------------------------------------------------------------------
# 2. Run directory
# --------------------------------------------------------------------------------------------------


def prepare_run(cfg: TrainConfig, dispatch: DispatchConfig | None) -> RunDir:
    """Create the run dir, or reopen it on --resume; run.json is written last, once.

    With ``--eval-config`` the file is read and checked (datasets present, fields valid) before anything
    is written; on ``--resume`` it must describe the run's eval.
    """
    run = RunDir(cfg.run_dir)
    config = read_eval_config(cfg.eval_config) if cfg.eval_config is not None else None
    if run.manifest_path.is_file():
        if not cfg.resume:
            raise ValueError(f"{run.path} already holds a run; pass --resume to continue it")
        if config is not None and run.manifest().eval != config.spec:
            raise ValueError(f"{run.manifest_path} holds a different eval than --eval-config {config.path}")
        return run
    run = RunDir.create(cfg.run_dir)
    save_base_model_dir(base_model_dir(run), cfg.model, cfg.arch)  # type: ignore[arg-type]
    if config is None:
        dataset = write_addition_dataset(run, n=cfg.eval_n_prompts, shard_size=cfg.eval_shard_size)
        eval_spec = EvalSpec(datasets=(dataset,), engine={"dtype": "float32"})
    else:
        install_eval_data(run, config)
        eval_spec = config.spec
    roots = (str(dispatch.snapshot_root),) if dispatch is not None else (str(run.snapshots),)
    manifest = RunManifest(
        run_id=cfg.run_id or (config.raw.get("run_id") if config else None) or _run_id(run.path),
        eval=eval_spec,
        snapshot_roots=roots,
        trainer=trainer_identity(cfg, dispatch),
        lease=(config.lease if config and config.lease else LeaseSettings(cfg.lease_duration, cfg.lease_heartbeat)),
        created=time.time(),
    )
    RunDir.create(run.path, manifest)
    return run


def base_model_dir(run: RunDir) -> Path:
    return run.path / "base"


def _run_id(path: Path) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", path.name)[:64] or "run"


def trainer_identity(cfg: TrainConfig, dispatch: DispatchConfig | None) -> dict[str, Any]:
    return {
        "program": "ckpteval train",
        **producer_identity(),
        "arch": cfg.arch,
        "model": asdict(cfg.model),
        "steps": cfg.steps,
        "batch_size": cfg.batch_size,
        "lr": cfg.lr,
        "lr_schedule": cfg.lr_schedule,
        "warmup_steps": cfg.warmup_steps,
        "seed": cfg.seed,
        "eval_interval": cfg.eval_interval if dispatch else None,
        "eval_mode": dispatch.mode if dispatch else None,
        "eval_posture": cfg.eval_posture if dispatch else None,
    }


# --------------------------------------------------------------------------------------------------
# 3. Training checkpoints (no pickles)
# --------------------------------------------------------------------------------------------------


def train_ckpt_root(run: RunDir) -> Path:
    return run.path / "train_ckpt"


def save_train_checkpoint(run: RunDir, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Path:
    """Publish ``train_ckpt/step-<N>/`` atomically; keep the newest :data:`KEEP_TRAIN_CKPTS`."""
    root = train_ckpt_root(run)
    root.mkdir(exist_ok=True)
    final = root / f"step-{step:010d}"
    if final.exists():
        return final
    tmp = tmp_name(final)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))
    state = opt.state_dict()
    tensors = {"rng.torch": torch.get_rng_state()}
    for index, slots in state["state"].items():
        for key, value in slots.items():
            tensors[f"state.{index}.{key}"] = (
                value if isinstance(value, torch.Tensor) else torch.tensor(value)
            )
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "optimizer.safetensors"))
    write_json_atomic(tmp / "state.json", {"step": step, "param_groups": state["param_groups"]})
    for name in ("model.safetensors", "optimizer.safetensors"):
        with open(tmp / name, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(root)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-KEEP_TRAIN_CKPTS]:
        shutil.rmtree(old)
    return final


def latest_train_checkpoint(run: RunDir) -> Path | None:
    done = sorted(p for p in train_ckpt_root(run).glob("step-*") if (p / "state.json").is_file())
    return done[-1] if done else None


def load_train_checkpoint(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Restore model, optimizer and RNG from ``path``; returns its step."""
    missing, unexpected = load_model(model, str(path / "model.safetensors"))
    if missing or unexpected:
        raise ValueError(f"{path}: model keys differ (missing {missing}, unexpected {unexpected})")
    meta = read_json_object(path / "state.json")
    tensors = load_file(str(path / "optimizer.safetensors"))
    torch.set_rng_state(tensors.pop("rng.torch"))
    slots: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        slots.setdefault(int(index), {})[key] = value
    opt.load_state_dict({"state": slots, "param_groups": meta["param_groups"]})
    return int(meta["step"])


# --------------------------------------------------------------------------------------------------
# 4. HF checkpoints (reuse mode): the periodic save the eval fleet reuses
# --------------------------------------------------------------------------------------------------


def save_hf_checkpoint(save_dir: Path, step: int, model: torch.nn.Module, cfg: TrainConfig) -> Path:
    """``save_pretrained`` + tokenizer into ``<save_dir>/checkpoint-<step>`` (atomic rename).

    A checkpoint already marked complete (a resumed run re-running the step) is left alone: the
    fleet may be reading it.
    """
    final = Path(save_dir) / checkpoint_dirname(step)
    if (final / MARKER).is_file():
        return final
    if final.exists():
        shutil.rmtree(final)  # our own unmarked leftover of a killed save
    tmp = tmp_name(final)
    model.save_pretrained(tmp, safe_serialization=True)
    save_tokenizer(tmp, cfg.model.max_position_embeddings)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    return final


# --------------------------------------------------------------------------------------------------
# 5. The loop
# --------------------------------------------------------------------------------------------------


class _Preemption:
    """Turns SIGTERM/SIGUSR1 into a flag the loop checks at step boundaries."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signum = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """The learning rate of ``step`` (1-based): a pure function of the step, so resuming needs no state."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def training_batch(cfg: TrainConfig, step: int, tokenizer: Any) -> dict[str, torch.Tensor]:
    """The batch of ``step``: a pure function of (seed, step), so a resumed run sees the same data."""
    return batch_for_training(
        make_addition_examples(cfg.batch_size, seed=cfg.seed * 1_000_003 + step), tokenizer
    )


def build_dispatcher(
    cfg: TrainConfig, dispatch: DispatchConfig | None, run: RunDir, sink: MetricsSink
) -> EvalDispatcher | None:
    if dispatch is None:
        return None
    shared = None
    if cfg.eval_posture == "shared":
        from jobs.eval.engines.hf import HFEngine
        from jobs.trainer.gate import ProducerGate

        shared = SharedEval(HFEngine(device="cpu"), ProducerGate())
    return EvalDispatcher(
        dispatch,
        run,
        sink,
        base_model_dir(run),
        shared=shared,
        poll_interval_s=cfg.eval_poll_interval,
        backpressure_timeout_s=cfg.eval_backpressure_timeout,
        drain_timeout_s=cfg.eval_drain_timeout,
    )


def train(cfg: TrainConfig, dispatch: DispatchConfig | None, run: RunDir) -> int:
    """The training loop; ``dispatch`` and ``run`` come from :func:`main`'s validation and set-up."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    manifest = run.manifest()

    model = build_model(cfg.model, cfg.arch, seed=cfg.seed).train()  # type: ignore[arg-type]
    tokenizer = build_tokenizer(cfg.model.max_position_embeddings)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    start = 0
    if cfg.resume and (ckpt := latest_train_checkpoint(run)) is not None:
        start = load_train_checkpoint(ckpt, model, opt)

    wandb_run = init_wandb(run.path, manifest.run_id, {"trainer": manifest.trainer}) if cfg.wandb else None
    sink = MetricsSink(run.metrics_path, wandb_run)
    dispatcher = build_dispatcher(cfg, dispatch, run, sink)
    preempt = _Preemption()
    bar = tqdm(total=cfg.steps, initial=start, desc="train", disable=not cfg.progress, dynamic_ncols=True)
    t_start = t_window = time.perf_counter()
    try:
        for step in range(start + 1, cfg.steps + 1):
            lr = lr_at(cfg, step)
            for group in opt.param_groups:
                group["lr"] = lr
            loss = model(**training_batch(cfg, step, tokenizer)).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

            if cfg.save_hf_dir is not None and cfg.save_interval and step % cfg.save_interval == 0:
                save_hf_checkpoint(cfg.save_hf_dir, step, model, cfg)
            if dispatcher is not None:
                dispatcher.maybe_dispatch(step, model)
            if step % cfg.log_interval == 0:
                now = time.perf_counter()
                sink.log_train(step, {"train/loss": loss.item(), "train/lr": lr,
                                      "train/steps_per_second": cfg.log_interval / (now - t_window)})
                t_window = now
            if step % cfg.ckpt_interval == 0:
                save_train_checkpoint(run, step, model, opt)
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", pending=len(dispatcher.pending) if dispatcher else 0,
                            landed=dispatcher.landed if dispatcher else 0)
            if preempt.signum is not None:
                return _preempted(run, step, model, opt, dispatcher, sink)
    finally:
        bar.close()
        preempt.restore()
    train_seconds = time.perf_counter() - t_start

    save_train_checkpoint(run, cfg.steps, model, opt)
    if cfg.save_hf_dir is not None:  # the final point is never skipped: reuse mode needs its checkpoint
        save_hf_checkpoint(cfg.save_hf_dir, cfg.steps, model, cfg)
    if dispatcher is not None:
        dispatcher.close(cfg.steps, model)
    sink.close()
    steps_run = cfg.steps - start
    summary = {
        "final_step": cfg.steps,
        "steps_run": steps_run,
        "train_seconds": round(train_seconds, 3),
        "steps_per_second": round(steps_run / train_seconds, 3) if steps_run else None,
        "points_landed": dispatcher.landed if dispatcher else 0,
    }
    print(json.dumps(summary), flush=True)
    return 0


def _preempted(run: RunDir, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
               dispatcher: EvalDispatcher | None, sink: MetricsSink) -> int:
    save_train_checkpoint(run, step, model, opt)
    if dispatcher is not None:
        dispatcher.suspend(timeout_s=60.0)
    sink.close()
    print(f"ckpteval train: preempted at step {step}; checkpoint saved, rerun with --resume", file=sys.stderr)
    return PREEMPTED_EXIT


def main(argv: list[str]) -> int:
    cfg = parse_args(argv)
    try:
        dispatch = cfg.validate()  # fail fast: before anything is written or trained
        run = prepare_run(cfg, dispatch)
        run.manifest()  # a malformed run.json (on --resume) is a usage error, not a crash
    except (ValueError, FileNotFoundError) as e:
        print(f"ckpteval train: {e}", file=sys.stderr)
        return 2
    try:
        return train(cfg, dispatch, run)
    except LedgerError as e:  # a malformed ledger line on --resume: named, nothing changed
        print(f"ckpteval train: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
