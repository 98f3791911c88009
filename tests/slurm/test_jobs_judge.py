"""The judge component of the heterogeneous train+eval job on the real test cluster, on CPU: the reference
trainer (component 0) evaluates a judged set with two ``hf`` workers (component 1); the judge server is
component 2, launched by ``ckpteval submit train-eval --judge-cmd`` — ``ckpteval serve --judge exact`` (the
judge stand-in; a real run launches sglang with ``--judge-model``) under ``ckpteval.jobs.launch.judge_server``, which
publishes its URL in ``RUN/judge.json`` for the workers. Every point lands pinned, judged by the model id
the judge reported, with the score the judge's verdicts give."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import pytest

from ckpteval.coord.results.files import ResultIndex
from ckpteval.coord.results.verdicts import read_judge
from tests.slurm.test_jobs_helpers import completed_job_log, submit_job
from tests.slurm.test_jobs_train_eval import _eval_points

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

ROWS = [{"prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"} for a, b in [(12, 30), (7, 7), (45, 45), (3, 9)]]


def test_het_job_with_a_judge_component(slurm_cluster, tmp_path: Path) -> None:
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "judged.json").write_text(json.dumps({"eval": {"datasets": [
        {"name": "qa", "path": "qa.jsonl", "n_prompts": len(ROWS), "shard_size": 2, "max_new_tokens": 4,
         "scorer": "judge", "scorer_options": {"retries": 2, "timeout_s": 30}}]}}))
    judge_cmd = shlex.join([sys.executable, "-m", "ckpteval.jobs.cli", "serve", "--judge", "exact", "--served-model-name",
                            "judge-on-slurm", "--host", "0.0.0.0", "--port", "{port}"])
    run = tmp_path / "run"
    t0 = time.monotonic()
    job, prepared = submit_job(
        "train-eval", "--run-dir", str(run), "--time", "10", "--trainer-cpus", "1", "--cpus", "2", "--workers", "2",
        "--gpus-per-worker", "1", "--device", "cpu", "--judge-cmd", judge_cmd, "--judge-cpus", "1",
        "--", "--steps", "20", "--eval-interval", "10", "--eval-config", str(tmp_path / "judged.json"),
        "--threads", "1", "--no-progress", "--lease-duration", "20", "--lease-heartbeat", "4")
    assert prepared.script.splitlines().count("#SBATCH hetjob") == 2  # three components
    log = completed_job_log(slurm_cluster, job, run, 200, "het job + judge", t0)
    assert "judge_server:" in log and "published" in log and "stopping the judge server" in log, log[-4000:]
    published = read_judge(run / "judge.json")
    assert published is not None and published["model"] == "judge-on-slurm"

    results = ResultIndex(run / "results").refresh()
    assert len(results) == 6 and all(r.ok for r in results.values()), [r.message for r in results.values()]
    points = _eval_points(run)
    assert sorted(points) == [0, 10, 20], log[-3000:]
    for step, row in points.items():
        units = [r for r in results.values() if r.unit.step == step]
        assert {r.scorer["model"] for r in units} == {"judge-on-slurm"}  # read from the judge's /v1/models
        # the stand-in's verdict: the completion equals the reference; each result keeps the completion's
        # stripped text as its answer, so the point's score is recomputable from the results
        verdicts = [float(a == ROWS[i]["answer"]) for r in sorted(units, key=lambda r: r.unit.shard)
                    for i, a in zip(range(2 * r.unit.shard, 2 * r.unit.shard + 2), r.answers, strict=True)]
        assert row["eval/qa"] == pytest.approx(sum(verdicts) / len(verdicts))
        assert row["eval/qa/weight_version/mean"] == step and row["eval/qa/weight_version/mixed_version_ratio"] == 0
