"""The reference trainer as users run it: subprocesses, SIGKILL + --resume, preemption, checkpoints."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.snapshot import read_marker, snapshot_dirname
from ckpteval.jobs.reference.model import ModelConfig, build_model, build_tokenizer
from ckpteval.jobs.reference.train.ckpt import (
    latest_train_checkpoint,
    load_train_checkpoint,
    save_train_checkpoint,
)
from ckpteval.jobs.reference.train.main import (
    PREEMPTED_EXIT,
    TrainConfig,
    main,
    prepare_run,
    training_batch,
)
from ckpteval.jobs.trainer.config import DispatchConfig
from tests.support.training import (
    InstantFleet,
    dispatched_steps,
    eval_lines,
    eval_step_counts,
    ledger_counts,
    make_train_run,
    read_jsonl,
)
from tests.support.workers import results

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
SMALL = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)


def _config(run_dir: Path, **settings) -> TrainConfig:
    """``TrainConfig`` from flat settings: the dispatch fields go to its nested ``DispatchConfig``."""
    names = {f.name for f in dataclasses.fields(DispatchConfig)}
    dispatch = DispatchConfig(**{k: settings.pop(k) for k in list(settings) if k in names})
    return TrainConfig(run_dir=Path(run_dir), dispatch=dispatch, **settings)


def _prepared(run_dir: Path, **overrides) -> tuple[RunDir, object]:
    """A run dir as ``ckpteval train`` prepares it (its own prepare_run; small eval set), and its eval config."""
    settings = {"eval_n_prompts": 4, "eval_shard_size": 2, "eval_interval": 2, "lease_duration": 5.0,
                "lease_heartbeat": 1.0, **overrides}
    cfg = _config(run_dir, **settings)
    dispatch = cfg.validate()
    return prepare_run(cfg, dispatch), dispatch


def _train_cmd(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ckpteval.jobs.cli", "train", "--run-dir", str(run_dir), "--batch-size", "16",
            "--eval-n-prompts", "8", "--eval-shard-size", "4", "--log-interval", "5", "--no-progress",
            "--eval-poll-interval", "0", "--eval-drain-timeout", "120", "--threads", "1", *extra]


def _wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited early ({proc.returncode}): {proc.stderr.read() if proc.stderr else ''}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.05)


def test_sigkilled_trainer_resumes_and_every_point_is_ingested_exactly_once(tmp_path: Path) -> None:
    """Step 0 (the initial weights, evaluated by default) included: logged once across SIGKILL + --resume."""
    run_dir = tmp_path / "run"
    args = ("--steps", "160", "--eval-interval", "10", "--ckpt-interval", "20", "--eval-max-in-flight", "4",
            "--eval-keep-snapshots", "4")
    fleet = subprocess.Popen([sys.executable, "-m", "tests.support.training", "consume", str(run_dir), "--until-done",
                              "--timeout", "240"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = subprocess.Popen(_train_cmd(run_dir, *args), cwd=ROOT, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = RunDir(run_dir)
    _wait_for(lambda: ledger_counts(run_dir, "ingested") and (run_dir / "train_ckpt" / snapshot_dirname(40)).exists(),
              120, first)
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    assert run.training_done() is None
    killed_at = max(dispatched_steps(run_dir))
    pending_at_kill = dispatched_steps(run_dir) - set(ledger_counts(run_dir, "ingested"))
    print(f"killed after dispatching {killed_at}; pending then: {sorted(pending_at_kill)}")

    second = subprocess.run(_train_cmd(run_dir, *args, "--resume"), cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["final_step"] == 160 and summary["steps_run"] < 160  # resumed, not restarted
    out, err = fleet.communicate(timeout=120)
    assert fleet.returncode == 0, err.decode()[-3000:]

    steps = list(range(0, 161, 10))
    assert eval_step_counts(run_dir) == {s: 1 for s in steps}, killed_at
    assert ledger_counts(run_dir, "dispatched")[0] >= 1 and eval_lines(run_dir)[0]["eval/step"] == 0
    assert ledger_counts(run_dir, "ingested") == {s: 1 for s in steps}
    crashed = []
    for point in eval_lines(run_dir):
        step = point["eval/step"]
        assert "eval/skipped_drain_timeout" not in point and "eval/skipped_busy" not in point
        if "eval/skipped_crashed" in point:  # killed mid-export of the checkpointed step: at most that one
            crashed.append(step)
            continue
        assert point["eval/addition/weight_version/mean"] == step
        assert point["eval/addition/weight_version/mixed_version_ratio"] == 0
        assert point["eval/lag_steps"] >= 0
    assert len(crashed) <= 1
    assert run.training_done() == 160


def _signal_after_step_10(run_dir: Path, sig: int) -> tuple[subprocess.Popen, str]:
    """Start a long training run, send ``sig`` once step 10 is logged; (the ended process, its stderr)."""
    proc = subprocess.Popen(_train_cmd(run_dir, "--steps", "100000", "--eval-interval", "50", "--ckpt-interval",
                                       "100000"), cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _wait_for(lambda: any(r.get("step", 0) >= 10 for r in read_jsonl(run_dir / "metrics.jsonl")), 120, proc)
    proc.send_signal(sig)
    _out, err = proc.communicate(timeout=60)
    return proc, err


def test_sigterm_saves_a_checkpoint_and_exits_for_requeue(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc, err = _signal_after_step_10(run_dir, signal.SIGTERM)
    assert proc.returncode == PREEMPTED_EXIT, err[-2000:]
    ckpt = latest_train_checkpoint(RunDir(run_dir))
    assert ckpt is not None and int(ckpt.name.split("-")[1]) >= 10
    assert RunDir(run_dir).training_done() is None and RunDir(run_dir).interrupted() is None  # requeued, not ended
    assert sorted(p.name for p in ckpt.iterdir()) == ["model.safetensors", "optimizer.safetensors", "state.json"]


def test_ctrl_c_saves_a_checkpoint_and_says_so_in_one_line(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) to ``ckpteval train``: the same checkpoint as SIGTERM, one line, exit 130, no traceback."""
    run_dir = tmp_path / "run"
    proc, err = _signal_after_step_10(run_dir, signal.SIGINT)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    assert [line for line in err.splitlines() if "ckpteval train" in line] == [err.strip().splitlines()[-1]]
    assert "interrupted at step" in err and "--resume" in err
    assert RunDir(run_dir).interrupted()["by"] == "ckpteval train"  # status: "training interrupted", not running
    ckpt = latest_train_checkpoint(RunDir(run_dir))
    assert ckpt is not None and int(ckpt.name.split("-")[1]) >= 10


def test_no_progress_bar_lands_in_a_log_file(tmp_path: Path) -> None:
    """A stderr that is no terminal (a log file, a SLURM ``.out``; here a pipe) gets no bar, without
    ``--no-progress`` (#31): neither the training bar nor transformers' "Writing model shards" (one per
    ``--save-hf`` checkpoint) — stderr holds no progress bar at all, as with ``--no-progress``."""
    run_dir = tmp_path / "run"
    cmd = [w for w in _train_cmd(run_dir, "--steps", "4", "--no-eval", "--save-hf", str(tmp_path / "hf"),
                                 "--save-interval", "2") if w != "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [f"checkpoint-{s}" for s in (2, 4)]
    assert "Writing model shards" not in proc.stderr and "it/s]" not in proc.stderr and "\r" not in proc.stderr, \
        proc.stderr[-2000:]


def test_training_checkpoint_round_trip_continues_identically(tmp_path: Path) -> None:
    run, _ = _prepared(tmp_path / "run", eval=False)
    cfg = TrainConfig(run_dir=run.path, batch_size=8, model=SMALL)
    tok = build_tokenizer()

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = build_model(SMALL, "llama", seed=0).train()
        return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    def steps(model: torch.nn.Module, opt: torch.optim.Optimizer, first: int, last: int) -> None:
        for step in range(first, last + 1):
            model(**training_batch(cfg, step, tok)).loss.backward()
            opt.step()
            opt.zero_grad()

    model, opt = fresh()
    steps(model, opt, 1, 2)
    path = save_train_checkpoint(run, 2, model, opt)
    steps(model, opt, 3, 4)
    resumed, opt2 = fresh()
    assert load_train_checkpoint(path, resumed, opt2) == 2
    steps(resumed, opt2, 3, 4)
    for (name, a), (_, b) in zip(model.state_dict().items(), resumed.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_no_eval_at_start_skips_step_zero(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run, _ = make_train_run(run_dir, eval_interval=2)
    fleet = InstantFleet(run)
    fleet.start()
    try:
        assert main(["--run-dir", str(run_dir), "--resume", "--steps", "2", "--batch-size", "8", "--no-progress",
                     "--eval-interval", "2", "--eval-poll-interval", "0", "--no-eval-at-start"]) == 0
    finally:
        fleet.stop.set()
    assert [r["eval/step"] for r in eval_lines(run_dir)] == [2]
    assert 0 not in ledger_counts(run_dir, "dispatched")


def test_bad_flags_fail_before_anything_is_written(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    assert main(["--run-dir", str(run_dir), "--save-hf", str(tmp_path / "hf"), "--save-interval", "3",
                 "--eval-interval", "4"]) == 2
    assert "multiple of --save-interval" in capsys.readouterr().err
    assert not run_dir.exists()
    _prepared(run_dir)
    assert main(["--run-dir", str(run_dir), "--steps", "2"]) == 2  # an existing run needs --resume
    assert "--resume" in capsys.readouterr().err


def test_reuse_mode_trainer_marks_its_hf_checkpoints(tmp_path: Path) -> None:
    run_dir, save = tmp_path / "run", tmp_path / "hf"
    flags = ["--save-hf", str(save), "--save-interval", "3", "--eval-interval", "3", "--eval-max-in-flight", "3",
             "--eval-keep-snapshots", "3"]
    run, _ = _prepared(run_dir, save_hf_dir=save, save_interval=3, eval_interval=3)
    fleet = InstantFleet(run)
    fleet.start()
    try:
        code = main(["--run-dir", str(run_dir), "--resume", "--steps", "7", "--batch-size", "8", "--no-progress",
                     "--eval-poll-interval", "0", "--eval-drain-timeout", "60", "--ckpt-interval", "100", *flags])
    finally:
        fleet.stop.set()
    assert code == 0
    # 0: the initial weights, saved as a checkpoint of their own; 7: the final point, saved whatever the interval
    assert sorted(p.name for p in save.iterdir()) == ["checkpoint-0", "checkpoint-3", "checkpoint-6", "checkpoint-7"]
    for step in (0, 3, 6, 7):
        assert read_marker(save / f"checkpoint-{step}").mode == "reuse"
    assert list(run.snapshots.iterdir()) == []  # nothing exported
    points = {r["eval/step"]: r for r in eval_lines(run_dir)}
    assert sorted(points) == [0, 3, 6, 7]
    assert all(p["eval/addition"] == 1.0 for p in points.values())


@pytest.mark.parametrize("arch", ["qwen2"])
def test_other_arch_trains_and_exports(tmp_path: Path, arch: str) -> None:
    run_dir = tmp_path / "run"
    run, _ = _prepared(run_dir, arch=arch, eval_interval=2)
    fleet = InstantFleet(run)
    fleet.start()
    try:
        assert main(["--run-dir", str(run_dir), "--resume", "--arch", arch, "--steps", "2", "--batch-size", "8",
                     "--no-progress", "--eval-interval", "2", "--eval-poll-interval", "0"]) == 0
    finally:
        fleet.stop.set()
    initial, point = eval_lines(run_dir)
    assert initial["eval/step"] == 0 and point["eval/step"] == 2 and point["eval/addition"] == 1.0


def test_resume_on_a_malformed_ledger_is_a_named_usage_error(tmp_path: Path) -> None:
    """--resume never trains over a ledger it cannot read: exit 2, the file and line named, nothing changed."""
    import subprocess
    import sys

    run = tmp_path / "run"
    base = [sys.executable, "-m", "ckpteval.jobs.cli", "train", "--run-dir", str(run), "--eval-interval", "5",
            "--eval-n-prompts", "8", "--no-progress", "--eval-drain-timeout", "0.5"]
    subprocess.run([*base, "--steps", "5"], capture_output=True, check=True, cwd=Path(__file__).parents[1])
    ledger = run / "ledger.jsonl"
    ledger.write_bytes(ledger.read_bytes() + b"garbage\n")
    before = ledger.read_bytes()
    proc = subprocess.run([*base, "--steps", "10", "--resume"], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1])
    assert proc.returncode == 2 and "ledger.jsonl:" in proc.stderr and "malformed ledger line" in proc.stderr
    assert "Traceback" not in proc.stderr and ledger.read_bytes() == before


# -- validation (moved from test_dispatcher: the trainer's flags map onto the dispatch config) ----------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eval_interval": 0}, "--eval-interval"),
        ({"save_hf_dir": "X", "save_interval": 3, "eval_interval": 4}, "multiple of --save-interval"),
        ({"keep_snapshots": 1, "max_in_flight": 2}, "--eval-keep-snapshots"),
        ({"overflow_policy": "drop"}, "--eval-overflow-policy"),
        ({"max_in_flight": 0}, "--eval-max-in-flight"),
        ({"save_hf_dir": "X"}, "--save-interval"),
        ({"staging_dir": "S", "save_hf_dir": "X", "save_interval": 2}, "choose"),
    ],
)
def test_validation_matrix_fails_at_construction(tmp_path: Path, kwargs: dict, message: str) -> None:
    for key in ("save_hf_dir", "staging_dir"):
        if key in kwargs:
            kwargs[key] = tmp_path / kwargs[key]
    with pytest.raises(ValueError, match=message):
        _config(tmp_path / "run", **kwargs).validate()


def test_the_eval_flags_are_the_dispatch_config_and_its_defaults_are_stated_once(tmp_path: Path) -> None:
    """``ckpteval train``'s ``--eval-*`` dispatch flags are DispatchConfig's fields (its nested Waits too):
    parsed into that one object, a flag not given is the dataclass default, the help text is the field's
    docstring, and a value outside a Literal is refused by the parser."""
    from ckpteval.jobs.reference.train.config import build_parser, parse_args
    from ckpteval.jobs.trainer.config import Waits

    run = str(tmp_path / "run")
    assert parse_args([run]).dispatch == DispatchConfig()
    cfg = parse_args([run, "--eval-interval", "4", "--save-hf", "X", "--save-interval", "2", "--eval-fleet", "none",
                      "--eval-poll-interval", "0.5", "--trainer-nodes", "n1,n2"])
    assert cfg.dispatch == DispatchConfig(eval_interval=4, save_hf_dir=Path("X"), save_interval=2, fleet="none",
                                          trainer_nodes=("n1", "n2"), waits=Waits(poll_interval_s=0.5))
    helps = {a.dest: a.help for a in build_parser()._actions}
    assert helps["drain_timeout_s"].startswith("longest wait at the end for outstanding points (default: 300.0)")
    with pytest.raises(SystemExit):
        parse_args([run, "--eval-overflow-policy", "drop"])


def _train_into(run_dir: Path, save: Path, seed: int) -> subprocess.CompletedProcess:
    """``ckpteval train`` writing marked checkpoints 0, 5, 10 into ``save`` (no fleet: the steps stay pending)."""
    cmd = [w for w in _train_cmd(run_dir, "--steps", "10", "--seed", str(seed), "--save-hf", str(save),
                                 "--save-interval", "5", "--eval-interval", "5", "--eval-fleet", "none")]
    cmd[cmd.index("--eval-drain-timeout") + 1] = "1"
    cmd += ["--lease-duration", "5", "--lease-heartbeat", "1"]  # a backfill gives up on an unfound step after one lease
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)


def test_a_save_hf_dir_holding_another_runs_checkpoints_is_refused_and_never_scored_as_this_run(tmp_path: Path) -> None:
    """Two runs given one --save-hf dir (#37): the second is refused before it overwrites anything; and where
    another run's checkpoints did land there (copied over, an older ckpteval), a backfill of the first run
    scores none of them as its own: each unit is ckpt_missing, naming the run that overwrote it."""
    save = tmp_path / "hf"
    first = _train_into(tmp_path / "A", save, seed=1)
    assert first.returncode == 0, first.stderr[-2000:]
    key_a = read_marker(save / "checkpoint-5").run
    refused = _train_into(tmp_path / "B", save, seed=2)
    assert refused.returncode != 0 and not (tmp_path / "B" / "run.json").exists()
    assert f"--save-hf {save} holds 3 checkpoint(s) of another run" in refused.stderr and key_a in refused.stderr
    assert read_marker(save / "checkpoint-5").run == key_a  # nothing overwritten
    resumed = subprocess.run([*_train_cmd(tmp_path / "A", "--resume", "--steps", "10", "--save-hf", str(save),
                                          "--save-interval", "5", "--eval-interval", "5", "--eval-fleet", "none")],
                             env=ENV, capture_output=True, text=True, timeout=300)
    assert "another run" not in resumed.stderr  # its own checkpoints are no other run's
    other = _train_into(tmp_path / "B", tmp_path / "hf-b", seed=2)
    assert other.returncode == 0, other.stderr[-2000:]
    key_b = read_marker(tmp_path / "hf-b" / "checkpoint-5").run
    for step in (0, 5, 10):  # B's checkpoints over A's, markers included
        shutil.rmtree(save / f"checkpoint-{step}")
        shutil.copytree(tmp_path / "hf-b" / f"checkpoint-{step}", save / f"checkpoint-{step}")
    out = subprocess.run([sys.executable, "-m", "ckpteval.jobs.cli", "backfill", str(tmp_path / "A")], env=ENV,
                         capture_output=True, text=True, timeout=300)
    got = results(RunDir.open(tmp_path / "A"))
    assert len(got) == 6 and {r.status for r in got.values()} == {"skipped"}, out.stdout[-2000:] + out.stderr[-2000:]
    assert {r.skip_reason for r in got.values()} == {"ckpt_missing"}
    assert all(f"names run {key_b}, not this run's {key_a}: overwritten" in r.message for r in got.values())
