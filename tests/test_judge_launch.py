"""The judge on SLURM, without SLURM: ``ckpteval submit`` renders the judge component (``--judge-model`` /
``--judge-cmd``) and hands ``--judge-url`` to the workers; ``python -m ckpteval.jobs.launch.judge_server`` runs a real
judge server (``ckpteval serve --judge exact``), publishes its URL in ``RUN/judge.json`` once it answers,
and stops it on USR1. The real cluster runs it in tests/slurm/test_jobs_judge.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ckpteval.coord.results.verdicts import read_judge
from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.launch import submit
from tests.support.workers import PYTHON, REPO, worker_env
from tests.test_submit import bash_n, sbatch_lines


def test_train_eval_dry_run_renders_the_judge_component(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    argv = ["train-eval", "--run-dir", str(run), "--partition", "gpu", "--judge-model", "/models/judge-7b",
            "--judge-gpus", "2", "--judge-partition", "big", "--judge-mem", "200G", "--dry-run", "--", "--steps", "10"]
    assert submit.main(argv) == 0
    script = capsys.readouterr().out
    lines = sbatch_lines(script)
    assert lines.count("hetjob") == 2
    judge = lines[len(lines) - lines[::-1].index("hetjob"):]
    assert {"--partition=big", "--gpus-per-node=2", "--mem=200G", "--nodes=1"} <= set(judge)
    assert (f"CKPTEVAL_JUDGE_CMD=({sys.executable} -m sglang.launch_server --model-path /models/judge-7b "
            "--host 0.0.0.0 --port '{port}' --tp 2)") in script
    assert "ckpteval_start_judge 2" in script and "ckpteval_stop_judge" in script
    bash_n(script, tmp_path)
    assert not run.exists()


def test_no_judge_no_component(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert submit.main(["train-eval", "--run-dir", str(tmp_path / "r"), "--dry-run"]) == 0
    script = capsys.readouterr().out
    assert sbatch_lines(script).count("hetjob") == 1 and "CKPTEVAL_JUDGE_CMD=" not in script


@pytest.mark.parametrize("kind", ["backfill", "service"])
def test_backfill_and_service_attach_to_a_judge_url(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    extra = ["--watch", str(tmp_path)] if kind == "service" else []
    argv = [kind, "--run-dir", str(run), *extra, "--judge-url", "http://judge:8000/v1", "--dry-run"]
    assert submit.main(argv) == 0
    assert "CKPTEVAL_WORKER_ARGV=(--judge-url http://judge:8000/v1)" in capsys.readouterr().out


@pytest.mark.parametrize(("flags", "says"), [
    (["--judge-cmd", "serve --port 80"], "must listen on {port}"),
    (["--judge-model", "/m", "--judge-cmd", "x {port}"], "give one"),
    (["--judge-model", "/m", "--judge-url", "http://j/v1"], "give one"),
])
def test_conflicting_judge_flags_are_usage_errors(
    flags: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert submit.main(["train-eval", "--run-dir", str(tmp_path / "r"), *flags, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


def test_judge_server_publishes_its_url_once_it_answers_and_stops_on_usr1(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path / "run")
    cmd = [PYTHON, "-m", "ckpteval.jobs.launch.judge_server", "--run-dir", str(run.path), "--host", "127.0.0.1", "--grace",
           "10", "--", PYTHON, "-m", "ckpteval.jobs.cli", "serve", "--judge", "exact", "--served-model-name", "j1",
           "--port", "{port}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=worker_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while (published := read_judge(run.judge_path)) is None:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.2)
        assert published["model"] == "j1" and published["url"].startswith("http://127.0.0.1:")
        with urllib.request.urlopen(f"{published['url']}/models", timeout=10) as r:
            assert json.loads(r.read())["data"][0]["id"] == "j1"
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=30) == 0
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{published['url']}/models", timeout=5)
    finally:
        proc.kill()
        proc.wait()


def test_judge_server_that_never_answers_fails_without_publishing(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path / "run")
    cmd = [PYTHON, "-m", "ckpteval.jobs.launch.judge_server", "--run-dir", str(run.path), "--ready-timeout", "2", "--",
           PYTHON, "-c", "import sys, time; time.sleep(60)  # {port}"]
    proc = subprocess.run(cmd, cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "did not answer" in proc.stderr
    assert read_judge(run.judge_path) is None


@pytest.mark.parametrize(("argv", "says"), [
    (["-m", "ckpteval.jobs.cli", "serve"], "--model DIR is required (unless --judge MODE)"),
    (["-m", "ckpteval.jobs.cli", "serve", "--judge", "nope"], "invalid choice: 'nope'"),
    (["-m", "ckpteval.jobs.cli", "worker", "--run-dir", "RUN", "--judge-url", "judge:80"], "--judge-url: 'judge:80': expected an http(s) URL"),
    (["-m", "ckpteval.jobs.launch.judge_server", "--run-dir", "RUN"], "give the server command after --"),
])
def test_bad_judge_flags_are_one_line_exit_2(argv: list[str], says: str, tmp_path: Path) -> None:
    argv = [str(tmp_path) if a == "RUN" else a for a in argv]
    proc = subprocess.run([PYTHON, *argv], cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
