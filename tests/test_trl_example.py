"""The TRL example (``examples/trl/grpo.py``: TRL's ``GRPOTrainer`` with ``EvalDispatchCallback``) scores
every point end to end: a real ``ckpteval worker`` process, the example as a user runs it (a second
process), a tiny model built from a config, the prompts and eval set from the repo, nothing downloaded
(``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` set: a download attempt fails the run).

Skipped with its reason when trl is not installed (it is in the ``test`` extra).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.training import eval_lines

ROOT = Path(__file__).parents[1]
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT),
       "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.timeout(900)  # ~15 s on an idle machine; the slack is for a loaded one
def test_trl_grpo_example_scores_every_point(tmp_path: Path) -> None:
    pytest.importorskip("trl", reason="trl is not installed (pip install -e '.[test]' brings it)")
    worker = subprocess.Popen(["ckpteval", "worker", "--run-dir", "runs/trl", "--wait-for-run", "600", "--engine", "hf",
                               "--poll-interval", "0.2"], cwd=tmp_path, env=ENV, stderr=subprocess.PIPE, text=True)
    try:
        trainer = subprocess.run([sys.executable, str(ROOT / "examples" / "trl" / "grpo.py"), "--run-dir", "runs/trl",
                                  "--output-dir", "trl-out"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                                 timeout=600)
        _, err = worker.communicate(timeout=240)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate()
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    assert worker.returncode == 0, err[-2000:]
    assert sorted((tmp_path / "trl-out").glob("checkpoint-*/trainer_state.json"))  # TRL's own saves were the snapshots
    points = {int(r["eval/step"]): r for r in eval_lines(tmp_path / "runs" / "trl") if "eval/sums" in r}
    assert sorted(points) == [0, 2, 4], err[-2000:]
    for step, point in points.items():  # each point measured exactly the checkpoint of its step
        assert point["eval/sums/weight_version/mean"] == step
        assert point["eval/sums/weight_version/mixed_version_ratio"] == 0
