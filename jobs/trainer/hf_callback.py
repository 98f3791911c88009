"""Plugging the eval dispatcher into any Hugging Face ``transformers.Trainer``: :class:`EvalDispatchCallback`.

Limits: staging export copies ``model.state_dict()`` as the main process sees it (no FSDP/ZeRO-3 gather: use
reuse mode there). See docs/USER_GUIDE.md "Your trainer".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ckpteval.coord.results.files import write_point_skip
from ckpteval.jobs.trainer.config import DispatchConfig
from ckpteval.jobs.trainer.dispatcher import EvalDispatcher

ROTATED = "ckpt_missing"


class EvalDispatchCallback(TrainerCallback):
    """See the module docstring."""

    def __init__(self, dispatcher: EvalDispatcher) -> None:
        self.dispatcher = dispatcher
        self.reuse = dispatcher.config.mode == "reuse"

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Any = None, processing_class: Any = None, **kwargs: Any) -> None:
        if self.reuse:
            self._check_reuse(args)
        if state.global_step == 0 and state.is_world_process_zero and model is not None:
            if self.reuse:
                self._save_final(0, model, processing_class)
            self.dispatcher.dispatch_initial(model)

    def _check_reuse(self, args: TrainingArguments) -> None:
        out = Path(args.output_dir).resolve()
        if out != self.dispatcher.root.resolve():
            raise ValueError(f"reuse mode: the dispatcher's --save-hf dir {self.dispatcher.root} is not the "
                             f"Trainer's output_dir {out}")
        strategy = getattr(args.save_strategy, "value", args.save_strategy)
        if strategy != "steps" or args.save_steps != self.dispatcher.config.save_interval:
            raise ValueError(f"reuse mode: the Trainer must save every {self.dispatcher.config.save_interval} steps "
                             f"(save_strategy='steps', save_steps; got {args.save_strategy}, {args.save_steps})")
        need = min_total_limit(self.dispatcher.config.max_in_flight, self.dispatcher.config.eval_interval or 1,
                               args.save_steps)
        if args.save_total_limit is not None and args.save_total_limit < need:
            raise ValueError(f"reuse mode: save_total_limit={args.save_total_limit} lets the Trainer delete "
                             f"checkpoints before they are evaluated ({self.dispatcher.config.max_in_flight} points "
                             f"in flight x eval_interval {self.dispatcher.config.eval_interval} / save_steps "
                             f"{args.save_steps}): set save_total_limit >= {need} or None")

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
            self._record_rotated(args.save_total_limit)

    def _record_rotated(self, limit: int | None) -> None:
        """Dispatched points whose checkpoint the Trainer's rotation (run just before ``on_save``) deleted:
        their units not done yet become skips that say so, instead of waiting for a dir that is gone."""
        d = self.dispatcher
        for step in d.pending:
            if not d.snapshot_dir(step).is_dir():
                write_point_skip(d.run.results, d.manifest, step, ROTATED,
                                 f"{d.snapshot_dir(step)} rotated away by the Trainer (save_total_limit={limit}) "
                                 "before it was evaluated: raise save_total_limit or set it to None")

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


def reuse_config(args: TrainingArguments, **settings: Any) -> DispatchConfig:
    """The dispatch config of reuse mode for a Trainer run with ``args``: its ``output_dir`` and
    ``save_steps`` are the snapshot dir and save interval; ``settings`` are the other
    :class:`~ckpteval.jobs.trainer.config.DispatchConfig` fields (``eval_interval=...``)."""
    return DispatchConfig(save_hf_dir=Path(args.output_dir), save_interval=int(args.save_steps), **settings)


def min_total_limit(max_in_flight: int, eval_interval: int, save_steps: int) -> int:
    """The fewest saves the Trainer must keep so no point in flight loses its checkpoint: the oldest of
    ``max_in_flight`` pending points is ``max_in_flight x eval_interval / save_steps`` saves old."""
    return max_in_flight * max(1, eval_interval // max(1, save_steps)) + 1


def _last_step(state: TrainerState) -> bool:
    """The Trainer's last step: its point is the final one, never skipped as busy."""
    return state.max_steps > 0 and state.global_step >= state.max_steps
