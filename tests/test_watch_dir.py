"""A ``--watch`` dir that does not exist is refused at start, in one line naming it, by every program that
takes one: ``ckpteval worker``, ``ckpteval backfill`` and ``ckpteval submit service`` (even ``--dry-run``).
Before, the worker polled it forever in silence, backfill said "nothing to do" and exited 0, and submit
rendered the job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}


@pytest.fixture()
def eval_config(tmp_path: Path) -> Path:
    (tmp_path / "sums.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    cfg = tmp_path / "eval.json"
    cfg.write_text(json.dumps({"eval": {"datasets": [{"name": "sums", "path": "sums.jsonl", "n_prompts": 1,
                                                      "scorer": "exact", "shard_size": 1, "max_new_tokens": 2}]}}))
    return cfg


@pytest.mark.parametrize("argv", [
    ["worker", "--once", "--engine", "hf"],
    ["backfill", "--engine", "hf"],
    ["submit", "service", "--dry-run", "--engine", "hf"],
])
def test_missing_watch_dir_is_refused(tmp_path: Path, eval_config: Path, argv: list[str]) -> None:
    missing = tmp_path / "no-such-output"
    proc = subprocess.run(["ckpteval", *argv, "--run-dir", str(tmp_path / "run"), "--watch", str(missing),
                           "--eval-config", str(eval_config)], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--watch {missing}: no such directory" in lines[0] and "mkdir -p" in lines[0]
    assert not (tmp_path / "run" / "run.json").exists()  # nothing created for a dir that is not there
