"""The service posture's own ingestion: points logged into the training run's wandb, exactly once.

Real worker processes in service mode (`--watch`) over marker-less checkpoints, wandb offline
(`WANDB_MODE=offline`, read back from wandb's own `.wandb` file), the fn backend for speed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ckpteval.coord.atomic import read_jsonl
from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.lifecycle import EXIT_DONE, EXIT_USAGE
from tests.support.workers import finish, spawn, write_foreign_checkpoint
from tests.test_metrics import wandb_records
from tests.test_service import _eval_config


def _service(run_dir: Path, watch: Path, cfg: Path, *extra: str):
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return spawn("worker", "--run-dir", str(run_dir), "--watch", str(watch), "--eval-config", str(cfg),
                 "--engine", "fn:tests.support.workers:SumBackend", "--once", "--quiescence", "0.5",
                 "--poll-interval", "0.2", *extra, env=env)


def _eval_steps(path: Path) -> list[int]:
    return [r["eval/step"] for r in read_jsonl(path) if "eval/step" in r]


def test_service_logs_points_into_the_training_run_once(tmp_path: Path) -> None:
    watch, run_dir = tmp_path / "ckpts", tmp_path / "svc"
    watch.mkdir()
    for step in (10, 20):
        write_foreign_checkpoint(tmp_path, watch / f"checkpoint-{step}", step)
    cfg = _eval_config(tmp_path)
    code, out = finish(_service(run_dir, watch, cfg, "--wandb", "--wandb-run-id", "train-run-1",
                                "--wandb-mode", "resume"), timeout=90)
    assert code == EXIT_DONE, out
    assert _eval_steps(RunDir(run_dir).service_metrics_path) == [10, 20]
    assert "logged to wandb run train-run-1" in out

    (wandb_file,) = run_dir.glob("wandb/offline-run-*/run-train-run-1.wandb")
    records = wandb_records(wandb_file)
    metrics = {(r.metric.name or r.metric.glob_name): r.metric.step_metric
               for r in records if r.WhichOneof("record_type") == "metric"}
    assert metrics["eval/*"] == "eval/step"
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert sorted(h["eval/step"] for h in history if "eval/addition" in h) == [10, 20]
    lag = {h["eval/step"]: h["eval/lag_steps"] for h in history if "eval/lag_steps" in h}
    assert lag == {10: 10, 20: 0}

    # a restarted service (shared mode this time) logs nothing twice
    code, out = finish(_service(run_dir, watch, cfg, "--wandb", "--wandb-run-id", "train-run-1"), timeout=90)
    assert code == EXIT_DONE, out
    assert _eval_steps(RunDir(run_dir).service_metrics_path) == [10, 20] and "logged to wandb" not in out


def test_service_wandb_needs_the_training_run_id(tmp_path: Path) -> None:
    watch = tmp_path / "ckpts"
    watch.mkdir()
    code, out = finish(_service(tmp_path / "svc", watch, _eval_config(tmp_path), "--wandb"), timeout=30)
    assert code == EXIT_USAGE and "--wandb-run-id" in out
