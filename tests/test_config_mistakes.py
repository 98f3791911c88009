"""A configuration mistake never reads as a dead engine (issue #38): each path through the real ``ckpteval``
entry points on a real LoRA run of the reference model — a refusal is one line and exit 2, or a skip naming
the setting; never exit 4 (which the batch scripts read as "requeue")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckpteval.coord.results.files import ResultIndex
from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.lifecycle import EXIT_UNHEALTHY
from tests.support.sbatch import job_outcome

ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
QA = {"name": "qa", "path": "qa.jsonl", "n_prompts": 1, "scorer": "exact", "shard_size": 1, "max_new_tokens": 2}


def ckpteval(*argv: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ckpteval", *map(str, argv)], env=ENV, capture_output=True, text=True, timeout=300, cwd=cwd)


def write_config(path: Path, **dataset: object) -> Path:
    path.write_text(json.dumps({"eval": {"datasets": [{**QA, **dataset}]}}))
    return path


def train_argv(root: Path) -> list[str | Path]:
    """The guide's LoRA command line (trainer alone, no fleet)."""
    return ["train", "--run-dir", root / "lora", "--steps", "2", "--eval-interval", "2", "--eval-config",
            root / "plain.json", "--lora", "--eval-fleet", "none", "--save-hf", root / "lora" / "hf",
            "--save-interval", "2", "--no-progress"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished ``ckpteval train --lora --eval-config`` run (adapter snapshots at steps 0 and 2)."""
    root = tmp_path_factory.mktemp("lora")
    (root / "qa.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    write_config(root / "plain.json")
    proc = ckpteval(*train_argv(root))
    assert proc.returncode == 0, proc.stderr
    return root


def skips(run: Path) -> list[tuple[str | None, str | None]]:
    return [(r.skip_reason, r.message) for _, r in sorted(ResultIndex(RunDir(run).results).refresh().items())]


def test_a_lora_run_resumes_with_the_guides_command_line(lora_run: Path) -> None:
    proc = ckpteval(*train_argv(lora_run), "--resume")
    assert proc.returncode == 0, proc.stderr
    assert "holds a different eval" not in proc.stderr


def test_backfill_from_a_lora_run_carries_its_base_model(lora_run: Path) -> None:
    new = lora_run / "reeval-plain"
    proc = ckpteval("backfill", "--run-dir", new, "--from-run", lora_run / "lora", "--eval-config",
                    lora_run / "plain.json", "--engine", "hf")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert RunDir(new).manifest().eval.base_model == str((lora_run / "lora" / "base").resolve())
    assert [r[0] for r in skips(new)] == [None, None]  # both steps scored


def test_reasoning_end_tokenizer_without_a_pair_is_a_skip_naming_the_setting_not_a_dead_engine(lora_run: Path) -> None:
    """The reference tokenizer knows no think pair: each unit is a ``bad_config`` skip naming the setting,
    written at once; the engine is never reloaded and the backfill never exits 4."""
    base = str((lora_run / "lora" / "base").resolve())  # given: this test does not lean on the --from-run fix
    config = lora_run / "reasoning.json"
    config.write_text(json.dumps({"eval": {"base_model": base, "datasets": [{**QA, "reasoning": {"end": "tokenizer"}}]}}))
    new = lora_run / "reeval-reasoning"
    proc = ckpteval("backfill", "--run-dir", new, "--from-run", lora_run / "lora", "--eval-config", config,
                    "--engine", "hf")
    assert proc.returncode == 0 and proc.returncode != EXIT_UNHEALTHY, proc.stdout + proc.stderr
    found = skips(new)
    assert [r for r, _ in found] == ["bad_config", "bad_config"], found
    assert all("reasoning.end='tokenizer'" in str(m) and "name the delimiter" in str(m) for _, m in found)
    assert "restart" not in proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if "SKIP bad_config" in x)
    assert "name the delimiter in run.json instead" in line  # the console line keeps the fix


def test_a_trainer_learns_that_the_fleet_refused_the_config_and_skips_instead_of_waiting(tmp_path: Path) -> None:
    """A worker refusing the run's eval sets at start (exit 2) writes RUN/CONFIG_REFUSED; the trainer,
    under backpressure with a 600 s bound, skips its points ``config_refused`` at once and finishes."""
    from tests.support.workers import finish, spawn, wait_for

    run_dir = tmp_path / "run"
    argv = ["--run-dir", str(run_dir), "--steps", "6", "--batch-size", "8", "--threads", "1", "--no-progress",
            "--ckpt-interval", "1000", "--eval-interval", "2", "--save-hf", str(tmp_path / "hf"), "--save-interval", "2",
            "--eval-max-in-flight", "1", "--eval-n-prompts", "4", "--eval-shard-size", "2", "--eval-poll-interval",
            "0.05", "--no-eval-at-start", "--eval-backpressure-timeout", "600", "--eval-drain-timeout", "0.5"]
    trainer = spawn("train", *argv)
    wait_for(lambda: (run_dir / "run.json").is_file(), 60)
    for data in (run_dir / "data").glob("*.jsonl"):
        data.write_text("not json\n")  # the run's eval set, broken: no worker can evaluate it
    worker = ckpteval("worker", "--run-dir", run_dir, "--engine", "hf")
    assert worker.returncode == 2 and worker.returncode != EXIT_UNHEALTHY, worker.stderr
    assert RunDir(run_dir).config_refused() is not None
    code, out = finish(trainer, 120)
    assert code == 0, out
    skipped = {r.skip_reason for r in ResultIndex(RunDir(run_dir).results).refresh().values()}
    assert skipped == {"config_refused"}, skipped


@pytest.mark.parametrize("form", ["adapters without base_model", "full model with base_model"])
def test_snapshots_the_config_cannot_load_exit_2_and_the_batch_job_does_not_requeue(
        lora_run: Path, form: str, tmp_path: Path) -> None:
    """Adapter snapshots in a run without ``eval.base_model`` (a PEFT trainer's checkpoints watched with a
    plain config), or full-model snapshots in a run with one: one line naming the snapshot and the setting,
    exit 2 (was: "engine dead after restart", exit 4), RUN/CONFIG_REFUSED; and sbatch/common.sh, given that
    exit code, neither restarts the worker nor requeues the job."""
    if form == "adapters without base_model":
        watch, config, setting = lora_run / "lora" / "hf", lora_run / "plain.json", "names no eval.base_model"
    else:
        watch = tmp_path / "full"
        shutil.copytree(lora_run / "lora" / "base", watch / "checkpoint-5")
        base = str((lora_run / "lora" / "base").resolve())
        config = tmp_path / "based.json"
        config.write_text(json.dumps({"eval": {"base_model": base, "datasets": [{**QA, "path": str(lora_run / "qa.jsonl")}]}}))
        setting = "names eval.base_model"
    run = tmp_path / "run"
    proc = ckpteval("backfill", "--run-dir", run, "--watch", watch, "--eval-config", config, "--engine", "hf",
                    "--quiescence", "0.5", "--max-unhealthy", "1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and setting in lines[0] and "checkpoint-" in lines[0], proc.stderr
    assert "restart" not in proc.stdout + proc.stderr
    assert RunDir(run).config_refused() is not None
    job = job_outcome(proc.returncode, tmp_path / "job")
    assert not job.requeued and job.starts == 1 and job.exit_code == 2, job.log


def test_an_adapter_the_engine_cannot_load_is_a_skip_naming_the_file_not_a_dead_engine(
        lora_run: Path, tmp_path: Path) -> None:
    """A DoRA adapter (``use_dora`` in adapter_config.json) on the hf engine: each unit is an ``unsupported``
    skip naming the file, written at once; no restart, exit 0 (was: "engine dead after restart", exit 4)."""
    snapshot = tmp_path / "dora" / "checkpoint-0"
    shutil.copytree(lora_run / "lora" / "hf" / "checkpoint-0", snapshot)
    (snapshot / ".complete").unlink()
    adapter = json.loads((snapshot / "adapter_config.json").read_text())
    (snapshot / "adapter_config.json").write_text(json.dumps({**adapter, "use_dora": True}))
    config = tmp_path / "based.json"
    config.write_text(json.dumps({"eval": {"base_model": str((lora_run / "lora" / "base").resolve()),
                                           "datasets": [{**QA, "path": str(lora_run / "qa.jsonl")}]}}))
    run = tmp_path / "run"
    proc = ckpteval("backfill", "--run-dir", run, "--watch", snapshot.parent, "--eval-config", config,
                    "--engine", "hf", "--quiescence", "0.5", "--max-unhealthy", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "restart" not in proc.stdout + proc.stderr
    [(reason, message)] = skips(run)
    assert reason == "unsupported" and "adapter_config.json" in str(message) and "DoRA" in str(message), message


def test_an_attached_server_without_lora_routes_is_a_config_refusal_not_a_dead_engine(
        lora_run: Path, tmp_path: Path) -> None:
    """Adapter snapshots against an attached ``ckpteval serve`` (no LoRA routes: ``POST /load_lora_adapter``
    answers 404): one line naming the route and what the server lacks, exit 2, RUN/CONFIG_REFUSED, and the
    batch job does not requeue (was: "...HTTP 404; then engine dead after restart: cannot restart", exit 4)."""
    from tests.support.workers import kill_all, start_serve

    base = (lora_run / "lora" / "base").resolve()
    url, server = start_serve(base, "base", tmp_path / "serve.log")
    try:
        config = tmp_path / "based.json"
        config.write_text(json.dumps({"eval": {"base_model": str(base),
                                               "datasets": [{**QA, "path": str(lora_run / "qa.jsonl")}]}}))
        run = tmp_path / "run"
        proc = ckpteval("backfill", "--run-dir", run, "--watch", lora_run / "lora" / "hf", "--eval-config", config,
                        "--engine", f"http:{url}", "--quiescence", "0.5", "--max-unhealthy", "1")
    finally:
        kill_all([server])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "/load_lora_adapter" in lines[0] and "404" in lines[0], proc.stderr
    assert "has no such route" in lines[0] and "--enable-lora" in lines[0], lines[0]
    assert "restart" not in proc.stdout + proc.stderr
    assert RunDir(run).config_refused() is not None
    job = job_outcome(proc.returncode, tmp_path / "job")
    assert not job.requeued and job.starts == 1 and job.exit_code == 2, job.log
