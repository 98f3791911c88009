"""``ckpteval train``: the reference trainer — a tiny decoder learning 2-digit addition on CPU.

It drives the eval machinery with a real model whose score climbs from 0 to ~1 and shows how a training loop
uses it (``start_eval``, ``maybe_dispatch`` per step, ``close``). Guarantee: every flag and an existing run are
checked before anything is written; batches are a pure function of ``(seed, step)``, so ``--resume`` sees the
data the killed run would have; SIGTERM/SIGUSR1 save a training checkpoint and exit 75, SIGINT 130. Limits: CPU
only, one process. See docs/USER_GUIDE.md "A run on one machine (CPU)" and "Stopping things".
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ckpteval.coord.run.ledger import LedgerError
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.snapshot import producer_identity
from ckpteval.jobs.eval.kinds.generate.evalsets import write_addition_dataset
from ckpteval.jobs.eval.worker.evalconfig import EvalConfig, install_eval_data
from ckpteval.jobs.flags import fail
from ckpteval.jobs.lifecycle import EXIT_INTERRUPTED, EXIT_TRAIN_PREEMPTED, STOP_SIGNALS
from ckpteval.jobs.metrics import MetricsSink, init_wandb
from ckpteval.jobs.reference.model import (
    ModelConfig,
    batch_for_training,
    build_model,
    build_tokenizer,
    make_addition_examples,
    save_base_model_dir,
    save_hf_checkpoint,
)
from ckpteval.jobs.reference.train import config as train_config
from ckpteval.jobs.reference.train.ckpt import (
    latest_train_checkpoint,
    load_train_checkpoint,
    save_train_checkpoint,
)
from ckpteval.jobs.reference.train.config import TrainConfig, parse_args
from ckpteval.jobs.trainer.config import DispatchConfig
from ckpteval.jobs.trainer.dispatcher import EvalDispatcher
from ckpteval.jobs.trainer.session import EvalRun, open_dispatcher, prepare_eval_run

__all__ = ["TrainConfig", "main", "parse_args", "prepare_run", "run_training", "train"]

PREEMPTED_EXIT = EXIT_TRAIN_PREEMPTED  # checkpoint saved, run again with --resume
SAMPLED_PROMPTS = 32  # --eval-samples: prompts of the sampled set (the eval set's first ones)


# --------------------------------------------------------------------------------------------------
# 1. Config
# --------------------------------------------------------------------------------------------------


# TrainConfig, its flags and its validation live in ckpteval.jobs.reference.train.config (no torch import).


# --------------------------------------------------------------------------------------------------
# 2. Run directory
# --------------------------------------------------------------------------------------------------


def eval_run(cfg: TrainConfig, dispatch: DispatchConfig | None) -> EvalRun:
    """The trainer's run and eval flags as the library's :class:`~ckpteval.jobs.trainer.session.EvalRun`."""
    return EvalRun(
        run_dir=cfg.run_dir, dispatch=dispatch, eval_config=cfg.eval_config, resume=cfg.resume, run_id=cfg.run_id,
        trainer=trainer_identity(cfg, dispatch), lease=LeaseSettings(cfg.lease_duration, cfg.lease_heartbeat),
    )


def prepare_run(cfg: TrainConfig, dispatch: DispatchConfig | None) -> RunDir:
    """Create the run dir, or reopen it on --resume, through the library's
    :func:`~ckpteval.jobs.trainer.session.prepare_eval_run` (every check before anything is written; run.json
    last, once); this trainer adds its own base dir and, without ``--eval-config``, its built-in set."""
    check_resume_cadence(cfg, dispatch)
    return prepare_eval_run(eval_run(cfg, dispatch), build_eval=lambda run, config: reference_eval(cfg, run, config))


def check_resume_cadence(cfg: TrainConfig, dispatch: DispatchConfig | None) -> None:
    """``--resume`` with another ``--eval-interval`` than the run was created with is refused: its points
    would mix two cadences (and a point dispatched under the old one could be skipped as off-cadence)."""
    run = RunDir(cfg.run_dir)
    if dispatch is None or not cfg.resume or not run.manifest_path.is_file():
        return
    was = run.manifest().trainer.get("eval_interval")
    if isinstance(was, int) and was != dispatch.eval_interval:
        raise ValueError(f"--resume: {run.manifest_path} was created with --eval-interval {was}, not "
                         f"{dispatch.eval_interval}; resume with --eval-interval {was} (or start a new --run-dir)")


# `--engine vllm` on the built-in sets: fp32 as trained (vLLM's dtype auto downcasts an fp32 model:
# vllm/config/model.py _resolve_auto_dtype) and eager (nothing to compile for a 2-layer model on CPU)
REFERENCE_VLLM = {"dtype": "float32", "enforce_eager": True}


def reference_eval(cfg: TrainConfig, run: RunDir, config: EvalConfig | None) -> EvalSpec:
    """RUN/base (the reference model's config and tokenizer; with --lora its weights too) and the eval
    section: the eval-config file's datasets, or the built-in addition set."""
    # --lora: the base's weights are part of the run (the adapters are trained on exactly them)
    base_weights = build_model(model_config(cfg), cfg.arch, seed=cfg.seed) if cfg.lora else None  # type: ignore[arg-type]
    save_base_model_dir(base_model_dir(run), model_config(cfg), cfg.arch, model=base_weights)  # type: ignore[arg-type]
    base_model = str(base_model_dir(run).resolve()) if cfg.lora else None
    if config is not None:
        install_eval_data(run, config)
        return replace(config.spec, base_model=base_model) if base_model else config.spec
    datasets = [write_addition_dataset(run, n=cfg.eval_n_prompts, shard_size=cfg.eval_shard_size)]
    if cfg.eval_samples > 0:
        n = min(SAMPLED_PROMPTS, cfg.eval_n_prompts)
        datasets.append(write_addition_dataset(
            run, name="addition-sampled", n=n, shard_size=min(n, cfg.eval_shard_size),
            n_samples=cfg.eval_samples, temperature=1.0, pass_k=tuple(sorted({1, cfg.eval_samples})),
        ))
    return EvalSpec(entries=tuple(datasets), engine={"dtype": "float32", "vllm": REFERENCE_VLLM}, base_model=base_model)


def model_config(cfg: TrainConfig) -> ModelConfig:
    """The model's shape: ``cfg.model``, or the reference defaults when not given."""
    return cfg.model or ModelConfig(tie_word_embeddings=not cfg.untied_lm_head)


def base_model_dir(run: RunDir) -> Path:
    return run.base


def trainer_identity(cfg: TrainConfig, dispatch: DispatchConfig | None) -> dict[str, Any]:
    return {
        "program": "ckpteval train",
        **producer_identity(),
        "arch": cfg.arch,
        "model": asdict(model_config(cfg)),
        "steps": cfg.steps,
        "batch_size": cfg.batch_size,
        "lr": cfg.lr,
        "lr_schedule": cfg.lr_schedule,
        "warmup_steps": cfg.warmup_steps,
        "seed": cfg.seed,
        "eval_interval": dispatch.eval_interval if dispatch else None,
        "eval_mode": dispatch.mode if dispatch else None,
        "eval_posture": cfg.eval_posture if dispatch else None,
        "lora_rank": cfg.lora_rank if cfg.lora else None,
    }


# --------------------------------------------------------------------------------------------------
# 5. The loop
# --------------------------------------------------------------------------------------------------


class _Preemption:
    """Turns SIGTERM/SIGUSR1/SIGINT into a flag the loop checks at step boundaries (a second SIGINT: stop now)."""

    SIGNALS = STOP_SIGNALS

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: the user will not wait for the checkpoint
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
    cfg: TrainConfig, dispatch: DispatchConfig | None, run: RunDir, sink: MetricsSink,
    preempt: _Preemption | None = None,
) -> EvalDispatcher | None:
    if dispatch is None:
        return None
    shared = None
    if cfg.eval_posture == "shared":
        from ckpteval.jobs.eval.engines.hf.engine import HFEngine
        from ckpteval.jobs.trainer.gate import ProducerGate, SharedEval

        engine = HFEngine(device="cpu")
        if cfg.lora:
            from ckpteval.jobs.eval.engines.hf.lora import HFLoRAEngine

            engine = HFLoRAEngine(str(base_model_dir(run)), device="cpu")
        shared = SharedEval(engine, ProducerGate())
    return open_dispatcher(
        eval_run(cfg, dispatch), run, sink, shared=shared,
        should_stop=(lambda: preempt.signum is not None) if preempt is not None else (lambda: False),
    )


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """``model`` wrapped as a peft LoRA model (rank ``rank``, alpha ``2 * rank``, every linear layer of
    the decoder): only the adapter trains, the base stays the seed-initialised weights in RUN/base."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS))
    return get_peft_model(model, config)


def silence_library_progress_bars() -> None:
    """``--no-progress`` (or stderr not a terminal) means no bar at all: also transformers' ("Writing model
    shards" on every ``--save-hf`` checkpoint, "Loading weights") and huggingface_hub's."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"


def train(cfg: TrainConfig, dispatch: DispatchConfig | None, run: RunDir) -> int:
    """The training loop; ``dispatch`` and ``run`` come from :func:`main`'s validation and set-up."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    bars = cfg.progress and sys.stderr.isatty()  # a log file or a SLURM .out gets no bar redrawn into it
    if not bars:
        silence_library_progress_bars()
    manifest = run.manifest()

    model = build_model(model_config(cfg), cfg.arch, seed=cfg.seed).train()  # type: ignore[arg-type]
    if cfg.lora:
        model = with_lora(model, cfg.lora_rank)
    tokenizer = build_tokenizer(model_config(cfg).max_position_embeddings)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr)
    start = 0
    if cfg.resume and (ckpt := latest_train_checkpoint(run)) is not None:
        start = load_train_checkpoint(ckpt, model, opt)

    wandb_run = init_wandb(run.path, manifest.run_id, {"trainer": manifest.trainer}) if cfg.wandb else None
    sink = MetricsSink(run.metrics_path, wandb_run)
    preempt = _Preemption()  # before the dispatcher: a stop signal ends its waits too
    dispatcher = build_dispatcher(cfg, dispatch, run, sink, preempt)
    final_step = cfg.steps
    bar = tqdm(total=cfg.steps, initial=start, desc="train", disable=not bars, dynamic_ncols=True)
    t_start = t_window = time.perf_counter()
    save_dir, save_interval = cfg.dispatch.save_hf_dir, cfg.dispatch.save_interval  # reuse mode (also --no-eval)
    if dispatcher is not None and cfg.eval_at_start and start == 0:
        if save_dir is not None:  # reuse mode: the initial weights' checkpoint is the snapshot
            save_hf_checkpoint(save_dir, 0, model)
        dispatcher.dispatch_initial(model)
    try:
        for step in range(start + 1, cfg.steps + 1):
            lr = lr_at(cfg, step)
            for group in opt.param_groups:
                group["lr"] = lr
            loss = model(**training_batch(cfg, step, tokenizer)).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

            last = step == cfg.steps  # the final point: dispatched now, never skipped busy
            if save_dir is not None and save_interval and (step % save_interval == 0 or last):
                save_hf_checkpoint(save_dir, step, model)
            if dispatcher is not None:
                dispatcher.maybe_dispatch(step, model, final=last)
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
                return _preempted(run, step, model, opt, dispatcher, sink, preempt.signum)
            if dispatcher is not None and dispatcher.stop_requested is not None:
                final_step = step  # --eval-stop-when met: finish here (final snapshot, final point)
                break
    finally:
        bar.close()
        preempt.restore()
    train_seconds = time.perf_counter() - t_start

    save_train_checkpoint(run, final_step, model, opt)
    if save_dir is not None:  # the final point is never skipped: reuse mode needs its checkpoint
        save_hf_checkpoint(save_dir, final_step, model)
    preempt = _Preemption()  # the end's waits (final export, drain) end on a stop signal too
    try:
        if dispatcher is not None:
            dispatcher.should_stop = lambda: preempt.signum is not None
            finished = dispatcher.close(final_step, model)
            if not finished:  # stopped before the final snapshot was published: requeue finishes it
                return _preempted(run, final_step, model, opt, dispatcher, sink, preempt.signum)
    finally:
        preempt.restore()
    sink.close()
    steps_run = final_step - start
    summary = {
        "final_step": final_step,
        "steps_run": steps_run,
        "train_seconds": round(train_seconds, 3),
        "steps_per_second": round(steps_run / train_seconds, 3) if steps_run else None,
        "points_landed": dispatcher.landed if dispatcher else 0,
    }
    if dispatcher is not None and dispatcher.stop_requested is not None:
        rule = dispatcher.ledger.state.stop_requested.get(dispatcher.stop_requested, {})
        summary["stopped"] = {"reason": rule.get("reason") or f"--eval-stop-when {cfg.dispatch.stop_when}",
                              "point_step": dispatcher.stop_requested}
    print(json.dumps(summary), flush=True)
    return 0


def _preempted(run: RunDir, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
               dispatcher: EvalDispatcher | None, sink: MetricsSink, signum: int | None = None) -> int:
    save_train_checkpoint(run, step, model, opt)
    if dispatcher is not None:
        dispatcher.suspend(timeout_s=60.0)
    sink.close()
    if signum == signal.SIGINT:  # a person stopped it (a requeue is SIGTERM): status and the fleet see it ended
        run.mark_interrupted("ckpteval train", "SIGINT")  # --resume clears it
        print(f"ckpteval train: interrupted at step {step}; checkpoint saved, rerun with --resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"ckpteval train: preempted at step {step}; checkpoint saved, rerun with --resume", file=sys.stderr)
    return PREEMPTED_EXIT


def run_training(cfg: TrainConfig, dispatch: DispatchConfig | None) -> int:
    """Write the run (or reopen it on --resume) and train; ``cfg`` is validated by :mod:`train_config`."""
    try:
        run = prepare_run(cfg, dispatch)
    except (ValueError, FileNotFoundError) as e:
        return fail("ckpteval train", e)
    except PermissionError as e:
        return fail("ckpteval train", f"{e.filename}: permission denied")
    try:
        return train(cfg, dispatch, run)
    except LedgerError as e:  # a malformed ledger line on --resume: named, nothing changed
        return fail("ckpteval train", e)


def main(argv: list[str]) -> int:
    return train_config.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
