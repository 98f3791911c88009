"""Plugging the eval dispatcher into any Hugging Face ``transformers.Trainer``.

:class:`EvalDispatchCallback` drives an :class:`~ckpteval.jobs.trainer.dispatcher.EvalDispatcher` from the Trainer's
events:

- staging mode: ``on_step_end`` → ``maybe_dispatch(global_step, model)`` (the export snapshots the
  live model's weights; training goes on while they are written);
- reuse mode: ``on_save`` → ``maybe_dispatch`` — the Trainer calls it right after writing
  ``<output_dir>/checkpoint-<step>``, which is then marked ``.complete`` in place (zero extra
  export); ``on_step_end`` only ingests. ``on_train_begin`` checks (before the first step) that the
  dispatcher's save dir is ``args.output_dir`` and its save interval ``args.save_steps``.
- the last step (``global_step >= max_steps``) is dispatched as the final point (never skipped as
  busy, whatever ``max_steps % eval_interval``).
- ``on_train_end`` → ``close(global_step, model)``: the final point. In reuse mode a final step the
  Trainer did not save is saved here first (``save_pretrained`` + the processing class), so the final
  point is never lost to a save schedule.

Only the main process (``state.is_world_process_zero``) dispatches.

Limits: staging export copies ``model.state_dict()`` as the main process sees it, so sharded
weights (FSDP, DeepSpeed ZeRO-3) are not gathered — use reuse mode there. In reuse mode set
``save_total_limit`` to ``None`` (or large): a checkpoint the Trainer rotates away while a point is
being evaluated becomes ``ckpt_missing`` for the units not yet done.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ckpteval.jobs.trainer.dispatcher import EvalDispatcher


class EvalDispatchCallback(TrainerCallback):
    """See the module docstring."""

    def __init__(self, dispatcher: EvalDispatcher) -> None:
        self.dispatcher = dispatcher
        self.reuse = dispatcher.config.mode == "reuse"

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if not self.reuse:
            return
        out = Path(args.output_dir).resolve()
        if out != self.dispatcher.root.resolve():
            raise ValueError(f"reuse mode: the dispatcher's --save-hf dir {self.dispatcher.root} is not the "
                             f"Trainer's output_dir {out}")
        strategy = getattr(args.save_strategy, "value", args.save_strategy)
        if strategy != "steps" or args.save_steps != self.dispatcher.config.save_interval:
            raise ValueError(f"reuse mode: the Trainer must save every {self.dispatcher.config.save_interval} steps "
                             f"(save_strategy='steps', save_steps; got {args.save_strategy}, {args.save_steps})")

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    model: Any = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        if self.reuse:
            self.dispatcher.step = state.global_step
            self.dispatcher.poll()
        else:
            self.dispatcher.maybe_dispatch(state.global_step, model, final=_last_step(state))

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                model: Any = None, **kwargs: Any) -> None:
        if self.reuse and state.is_world_process_zero:
            self.dispatcher.maybe_dispatch(state.global_step, model, final=_last_step(state))

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     model: Any = None, processing_class: Any = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        if self.reuse:
            self._save_final(state.global_step, model, processing_class)
        self.dispatcher.close(state.global_step, model)

    def _save_final(self, step: int, model: Any, processing_class: Any) -> None:
        directory = self.dispatcher.snapshot_dir(step)
        if directory.is_dir() or model is None:
            return
        model.save_pretrained(directory, safe_serialization=True)
        if processing_class is not None:
            processing_class.save_pretrained(directory)


def _last_step(state: TrainerState) -> bool:
    """The Trainer's last step: its point is the final one, never skipped as busy."""
    return state.max_steps > 0 and state.global_step >= state.max_steps
