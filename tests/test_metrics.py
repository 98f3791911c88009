"""MetricsSink: metrics.jsonl semantics, and the wandb path offline, read back from wandb's own file."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ckpteval.jobs.metrics import MetricsSink, init_wandb
from tests.support.training import read_jsonl


def test_jsonl_lines_carry_their_step_and_eval_points_are_logged_once(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    sink = MetricsSink(path)
    sink.log_train(10, {"train/loss": 1.5})
    assert sink.log_eval({"eval/step": 5, "eval/addition": 0.25, "eval/addition/weight_version/mean": math.nan})
    assert not sink.log_eval({"eval/step": 5, "eval/addition": 0.99})  # already there
    with pytest.raises(ValueError, match="eval/step"):
        sink.log_eval({"eval/addition": 1.0})
    rows = read_jsonl(path)
    assert rows[0] == {"step": 10, "train/loss": 1.5}
    assert rows[1] == {"step": 5, "eval/step": 5, "eval/addition": 0.25, "eval/addition/weight_version/mean": None}
    assert len(rows) == 2


def test_reopened_sink_skips_points_already_in_the_file_and_repairs_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    MetricsSink(path).log_eval({"eval/step": 4, "eval/addition": 0.5})
    with open(path, "ab") as f:
        f.write(b'{"step": 8, "eval/st')  # killed mid-write
    sink = MetricsSink(path)  # the requeued trainer
    assert sink.repaired_bytes > 0 and sink.has_eval_step(4) and not sink.has_eval_step(8)
    assert not sink.log_eval({"eval/step": 4, "eval/addition": 0.5})
    assert sink.log_eval({"eval/step": 8, "eval/addition": 0.75})
    assert [r["eval/step"] for r in read_jsonl(path)] == [4, 8]


# -- wandb, offline ---------------------------------------------------------------------------------
BLOCK = 32768  # the .wandb file is a LevelDB-style log: 7-byte header, then records in 32 KiB blocks


def wandb_records(path: Path) -> list[Any]:
    """Every protobuf record of an offline run's ``.wandb`` file (wandb 0.31 has no Python reader)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # block trailer padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        chunk, pos = data[pos : pos + length], pos + length
        if kind in (1, 2):  # full / first
            buf = chunk
        elif kind in (3, 4):  # middle / last
            buf += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
    return out


def finished_wandb_records(path: Path, timeout_s: float = 30.0) -> list[Any]:
    """:func:`wandb_records` once the run's ``exit`` record is there: wandb's writer may still be flushing
    the file after ``finish()`` returned (seen on a loaded machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"{path}: no exit record after {timeout_s:.0f}s")
        time.sleep(0.2)


def test_wandb_offline_eval_points_land_at_their_dispatch_step(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    sink = MetricsSink(tmp_path / "metrics.jsonl", init_wandb(tmp_path, "run-abc", {"x": 1}))
    for step in range(1, 6):
        sink.log_train(step, {"train/loss": 1.0 / step})
    sink.log_eval({"eval/step": 2, "eval/addition": 0.5, "eval/lag_steps": 3})  # lands late
    sink.close()

    (wandb_file,) = tmp_path.glob("wandb/offline-run-*/run-run-abc.wandb")
    records = finished_wandb_records(wandb_file)
    metrics = {(r.metric.name or r.metric.glob_name): r.metric.step_metric
               for r in records if r.WhichOneof("record_type") == "metric"}
    assert metrics["eval/*"] == "eval/step" and metrics["train/*"] == "train/step"
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    train = [h for h in history if "train/loss" in h]
    assert [h["train/step"] for h in train] == [1, 2, 3, 4, 5]
    (point,) = [h for h in history if "eval/addition" in h]
    assert point["eval/step"] == 2 and point["eval/lag_steps"] == 3


def no_login_env(home: Path) -> dict[str, str]:
    """A machine where wandb was never logged in: no WANDB_* setting, no key, an empty HOME (no .netrc, no
    ~/.config/wandb); the network is not reachable here either, so a wandb that tried it would hang."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    return {**env, "HOME": str(home), "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}"}


@pytest.mark.parametrize("argv", [
    ["train", "--steps", "2", "--no-eval", "--no-progress", "--wandb"],
    ["worker", "--watch", "ckpts", "--eval-config", "eval.json", "--wandb", "--wandb-run-id", "run-abc", "--once"],
], ids=["train", "service"])
def test_wandb_without_a_login_is_one_line_before_anything_is_written(tmp_path: Path, argv: list[str]) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "ckpts").mkdir()
    (tmp_path / "qa.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (tmp_path / "eval.json").write_text(json.dumps({"eval": {"datasets": [
        {"name": "qa", "path": "qa.jsonl", "n_prompts": 1, "scorer": "exact", "shard_size": 1, "max_new_tokens": 2}]}}))
    run = tmp_path / "run"
    proc = subprocess.run(["ckpteval", *argv, "--run-dir", str(run)], env=no_login_env(tmp_path / "home"),
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "wandb login" in proc.stderr and "WANDB_MODE=offline" in proc.stderr
    assert not run.exists()  # refused before run.json (or any dir) is written


@pytest.mark.parametrize("extra,refused", [({}, True), ({"WANDB_MODE": "offline"}, False),
                                            ({"WANDB_API_KEY": "k" * 40}, False)], ids=["none", "offline", "key"])
def test_wandb_login_check_reads_the_mode_and_the_key(tmp_path: Path, extra: dict[str, str], refused: bool) -> None:
    """In a fresh process each time: wandb reads its settings once per process."""
    proc = subprocess.run([sys.executable, "-c", "from ckpteval.jobs.metrics import check_wandb_login as c; c()"],
                          env={**no_login_env(tmp_path), **extra}, capture_output=True, text=True, timeout=120)
    assert (proc.returncode != 0) == refused, proc.stderr
    assert ("wandb login" in proc.stderr) == refused
