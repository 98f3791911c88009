"""``ckpteval.jobs.trainer.session``: your own trainer in a few lines (create or resume a run, get its dispatcher).

A real ``transformers.Trainer`` with :class:`EvalDispatchCallback` in staging and in reuse mode, built
only through the library entry point (no test helper writes the run); the engine-free
:class:`tests.support.training.InstantFleet` plays the eval fleet. Bad settings fail before anything is
written. (The plain PyTorch loop is the user guide's "Your trainer" block, run by tests/test_docs.py.)
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from transformers import Trainer, TrainingArguments

from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.snapshot import read_marker, snapshot_dirname
from ckpteval.jobs.reference.model import (
    build_model,
    build_tokenizer,
    make_addition_examples,
    save_base_model_dir,
)
from ckpteval.jobs.trainer.config import DispatchConfig, Waits
from ckpteval.jobs.trainer.hf_callback import EvalDispatchCallback
from ckpteval.jobs.trainer.session import EvalRun, start_eval
from tests.support.training import InstantFleet, eval_lines
from tests.test_hf_callback import SMALL, AdditionDataset


def _inputs(tmp: Path) -> tuple[Path, Path]:
    """A user's eval-config file (with its dataset) and HF model dir (config + tokenizer)."""
    rows = make_addition_examples(4, seed=3)
    (tmp / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp / "eval.json"
    cfg.write_text(json.dumps({"eval": {"datasets": [{"name": "sums", "path": "sums.jsonl", "n_prompts": 4,
                                                      "scorer": "exact", "shard_size": 2, "max_new_tokens": 4}]},
                               "lease": {"duration_s": 5, "heartbeat_s": 1}}))
    return cfg, save_base_model_dir(tmp / "model", SMALL, "llama")


def _train(out: Path, dispatcher, **args) -> None:  # noqa: ANN001
    targs = TrainingArguments(output_dir=str(out), max_steps=5, per_device_train_batch_size=8, report_to=[],
                              use_cpu=True, disable_tqdm=True, logging_strategy="no", **args)
    fleet = InstantFleet(dispatcher.run)
    fleet.start()
    try:
        Trainer(model=build_model(SMALL, "llama").train(), args=targs, train_dataset=AdditionDataset(16),
                processing_class=build_tokenizer(), callbacks=[EvalDispatchCallback(dispatcher)]).train()
    finally:
        fleet.stop.set()


def test_hf_trainer_staging_through_the_entry_point(tmp_path: Path) -> None:
    cfg, model_dir = _inputs(tmp_path)
    dispatcher = start_eval(EvalRun(run_dir=tmp_path / "run", eval_config=cfg, base_model_dir=model_dir,
                                    dispatch=DispatchConfig(eval_interval=2, waits=Waits(poll_interval_s=0.0))))
    _train(tmp_path / "out", dispatcher, save_strategy="no")
    run = RunDir(tmp_path / "run")
    assert sorted(r["eval/step"] for r in eval_lines(run.path)) == [0, 2, 4, 5] and run.training_done() == 5
    assert (run.snapshots / snapshot_dirname(5) / "tokenizer.json").is_file()  # the base dir's tokenizer
    manifest = run.manifest()
    assert [d.name for d in manifest.eval.entries] == ["sums"] and manifest.lease.duration_s == 5
    assert manifest.trainer["program"] == "library"


def test_hf_trainer_reuse_through_the_entry_point_and_resume(tmp_path: Path) -> None:
    cfg, model_dir = _inputs(tmp_path)
    out = tmp_path / "out"
    spec = EvalRun(run_dir=tmp_path / "run", eval_config=cfg, base_model_dir=model_dir,
                   dispatch=DispatchConfig(eval_interval=2, save_hf_dir=out, save_interval=2, max_in_flight=3,
                                           keep_snapshots=3, waits=Waits(poll_interval_s=0.0)))
    _train(out, start_eval(spec), save_strategy="steps", save_steps=2)
    for step in (0, 2, 4, 5):
        assert read_marker(out / f"checkpoint-{step}").mode == "reuse"
    with pytest.raises(ValueError, match=r"already holds a run; pass EvalRun\(resume=True\)"):
        start_eval(spec)
    spec.resume = True
    again = start_eval(spec)  # the same run, its ledger replayed: nothing logged twice
    assert again.landed == 4 and sorted(r["eval/step"] for r in eval_lines(again.run.path)) == [0, 2, 4, 5]
    second = dataclasses.replace(spec, run_dir=tmp_path / "run2", resume=False)  # another run, the same output dir
    with pytest.raises(ValueError, match=r"save_hf_dir \(--save-hf\) .* holds 4 checkpoint\(s\) of another run"):
        start_eval(second)
    assert not (tmp_path / "run2" / "run.json").exists()


@pytest.mark.parametrize("change, dispatch, says", [
    ({"eval_config": None}, {}, "no datasets: give eval_config"),
    ({"base_model_dir": None}, {}, "base_model_dir: exports copy its config"),
    ({}, {"stop_when": "eval/nope >= 1"}, "no dataset or task 'nope'"),
    ({}, {"stop_when": "loss < 1"}, "--eval-stop-when 'loss < 1': expected"),
    ({}, {"max_in_flight": 3, "keep_snapshots": 1}, "keep_snapshots (--eval-keep-snapshots, 1)"),
    ({}, {"waits": {"drain_timeout_s": -1.0}}, "drain_timeout_s (--eval-drain-timeout) must be >= 0"),
])
def test_bad_settings_fail_before_anything_is_written(tmp_path: Path, change: dict, dispatch: dict, says: str) -> None:
    cfg, model_dir = _inputs(tmp_path)
    with pytest.raises(ValueError, match=re.escape(says)):
        waits = Waits(**dispatch.pop("waits", {}))
        settings = {"run_dir": tmp_path / "run", "eval_config": cfg, "base_model_dir": model_dir,
                    "dispatch": DispatchConfig(eval_interval=2, waits=waits, **dispatch), **change}
        start_eval(EvalRun(**settings))
    assert not (tmp_path / "run").exists()


def test_the_trainer_library_does_not_load_the_eval_worker() -> None:
    """``import ckpteval.jobs.trainer.session`` (what a training loop imports) loads neither the eval worker
    nor the shared posture's scoring stack, nor the engines, the canary's engine side, unit claims (leases) or
    kept completions, nor snapshot discovery, nor --eval-stop-plateau's and --eval-adaptive's scipy-backed modules: 48
    ckpteval modules, packages not counted (53 before #27 cut those five chains; +1 in #40: coord.work.grants, with
    which points pool granted samples). The rest
    is what the dispatcher imports at its top (GC, ledger, points, ingest, export, the canary's
    trainer side) and what run.json parsing needs."""
    import subprocess
    import sys

    code = ("import sys, ckpteval.jobs.trainer.session; print(' '.join(m for m, mod in sys.modules.items() "
            "if m.startswith('ckpteval') and not hasattr(mod, '__path__')))")  # modules, not their folders' packages
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    unwanted = {"ckpteval.jobs.eval.worker.main", "ckpteval.jobs.eval.worker.loop", "ckpteval.jobs.eval.kinds.generate.scoring",
                "ckpteval.jobs.eval.kinds.evaluate", "ckpteval.jobs.trainer.gate", "ckpteval.jobs.eval.proof.attest",
                "ckpteval.jobs.eval.engines.base", "ckpteval.jobs.eval.proof.canary_check", "ckpteval.coord.work.claims",
                "ckpteval.coord.work.lease", "ckpteval.coord.results.completions", "ckpteval.coord.snapshots.discovery",
                "ckpteval.jobs.trainer.plateau", "ckpteval.jobs.trainer.adaptive.policy"}
    assert not loaded & unwanted and len(loaded) <= 48, sorted(loaded)
