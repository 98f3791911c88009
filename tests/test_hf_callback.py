"""EvalDispatchCallback inside a real transformers.Trainer (tiny model, CPU, a few steps)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainingArguments

from ckpteval.coord.results.files import ResultIndex
from ckpteval.coord.snapshots.snapshot import read_marker, snapshot_dirname
from ckpteval.jobs.metrics import MetricsSink
from ckpteval.jobs.reference.model import (
    ModelConfig,
    batch_for_training,
    build_model,
    build_tokenizer,
    make_addition_examples,
)
from ckpteval.jobs.trainer.dispatcher import EvalDispatcher
from ckpteval.jobs.trainer.hf_callback import EvalDispatchCallback
from tests.support.training import InstantFleet, eval_lines, make_train_run

SMALL = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)


class AdditionDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        tok = build_tokenizer()
        self.rows = [{k: v[0] for k, v in batch_for_training([ex], tok).items()}
                     for ex in make_addition_examples(n, seed=7)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def _trainer(output_dir: Path, dispatcher: EvalDispatcher, max_steps: int, **args) -> Trainer:
    targs = TrainingArguments(output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=8,
                              learning_rate=3e-3, report_to=[], use_cpu=True, disable_tqdm=True,
                              logging_strategy="no", **args)
    return Trainer(model=build_model(SMALL, "llama").train(), args=targs, train_dataset=AdditionDataset(),
                   processing_class=build_tokenizer(), callbacks=[EvalDispatchCallback(dispatcher)])


def test_staging_mode_dispatches_from_on_step_end(tmp_path: Path) -> None:
    run, dispatch = make_train_run(tmp_path / "run", eval_interval=2)
    dispatcher = EvalDispatcher.open(dispatch.with_waits(poll_interval_s=0.0, drain_timeout_s=60), run,
                                MetricsSink(run.metrics_path), run.base)
    fleet = InstantFleet(run)
    fleet.start()
    try:
        _trainer(tmp_path / "out", dispatcher, max_steps=5, save_strategy="no").train()
    finally:
        fleet.stop.set()
    points = {r["eval/step"]: r for r in eval_lines(run.path)}
    assert sorted(points) == [0, 2, 4, 5]  # step 0 (the initial weights), every interval step, the final one
    assert all(p["eval/addition/weight_version/mean"] == s for s, p in points.items())
    assert (run.snapshots / snapshot_dirname(5)).is_dir() and run.training_done() == 5


def test_reuse_mode_marks_trainer_checkpoints_from_on_save(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run, dispatch = make_train_run(tmp_path / "run", save_hf_dir=out, save_interval=2, eval_interval=2,
                                   eval_max_in_flight=3, eval_keep_snapshots=3)
    dispatcher = EvalDispatcher.open(dispatch.with_waits(poll_interval_s=0.0, drain_timeout_s=60), run,
                                MetricsSink(run.metrics_path), run.base)
    fleet = InstantFleet(run)
    fleet.start()
    try:
        _trainer(out, dispatcher, max_steps=5, save_strategy="steps", save_steps=2).train()
    finally:
        fleet.stop.set()
    for step in (0, 2, 4, 5):  # 0: saved by the callback at train begin; 5: the final step, saved by the callback since the Trainer did not
        marker = read_marker(out / f"checkpoint-{step}")
        assert marker.mode == "reuse" and "model.safetensors" in marker.files
    assert list(run.snapshots.iterdir()) == []  # zero extra export
    assert sorted(r["eval/step"] for r in eval_lines(run.path)) == [0, 2, 4, 5]


def test_reuse_mode_refuses_a_mismatched_save_schedule(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run, dispatch = make_train_run(tmp_path / "run", save_hf_dir=out, save_interval=2, eval_interval=2)
    dispatcher = EvalDispatcher.open(dispatch, run, MetricsSink(run.metrics_path), run.base)
    with pytest.raises(ValueError, match="save every 2 steps"):
        _trainer(out, dispatcher, max_steps=2, save_strategy="steps", save_steps=3).train()


def test_reuse_mode_refuses_a_save_total_limit_that_rotates_points_away(tmp_path: Path) -> None:
    """2 points in flight x eval every 4 / save every 2 = 4 saves back: a limit of 2 would delete them."""
    out = tmp_path / "out"
    run, dispatch = make_train_run(tmp_path / "run", save_hf_dir=out, save_interval=2, eval_interval=4,
                                   eval_max_in_flight=2)
    dispatcher = EvalDispatcher.open(dispatch, run, MetricsSink(run.metrics_path), run.base)
    with pytest.raises(ValueError, match=r"save_total_limit=2 .* set save_total_limit >= 5 or None"):
        _trainer(out, dispatcher, max_steps=4, save_strategy="steps", save_steps=2, save_total_limit=2).train()
    assert not (out / "checkpoint-2").exists()  # refused before the first step


def test_reuse_checkpoint_rotated_away_is_recorded_as_rotation(tmp_path: Path) -> None:
    """No fleet yet (points pending): the Trainer's rotation deletes a dispatched checkpoint; at the next
    save its units say so, instead of "never appeared" forever."""
    out = tmp_path / "out"
    run, dispatch = make_train_run(tmp_path / "run", save_hf_dir=out, save_interval=2, eval_interval=2,
                                   eval_max_in_flight=8, eval_keep_snapshots=8, eval_fleet="none")
    dispatcher = EvalDispatcher.open(dispatch.with_waits(poll_interval_s=0.0), run, MetricsSink(run.metrics_path), run.base)
    _trainer(out, dispatcher, max_steps=6, save_strategy="steps", save_steps=2, save_total_limit=17).train()
    assert (out / "checkpoint-2").is_dir() and 4 in dispatcher.pending  # a sufficient limit rotates nothing
    shutil.rmtree(out / "checkpoint-4")  # what rotation does: the dir vanishes, then on_save runs
    EvalDispatchCallback(dispatcher)._record_rotated(3)
    skips = [r for r in ResultIndex(run.results).refresh().values() if r.unit.step == 4]
    assert skips and all(r.skip_reason == "ckpt_missing" and "rotated away by the Trainer (save_total_limit=3)"
                         in r.message for r in skips)
