"""Service mode: ``ckpteval worker --watch DIR`` evaluates another trainer's marker-less checkpoints.

Real processes; the first run uses the real HF engine on HF Trainer style ``checkpoint-N/`` dirs
(model files + ``trainer_state.json``, no ``.complete`` marker) written by this test as a trainer
would. Restarts use the fn backend (the point there is idempotence, not the engine).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.kinds.generate.evalsets import write_jsonl
from ckpteval.jobs.lifecycle import EXIT_DONE, EXIT_USAGE
from ckpteval.jobs.reference.model import make_addition_examples
from tests.support.workers import (
    claimed_at,
    finish,
    kill_all,
    results,
    spawn,
    version,
    wait_for,
    write_foreign_checkpoint,
)

QUIESCENCE = 2.0


def _eval_config(tmp: Path) -> Path:
    (tmp / "cfg").mkdir()
    write_jsonl(tmp / "cfg" / "addition.jsonl", make_addition_examples(4, seed=7))
    cfg = {
        "run_id": "svc",
        "eval": {"datasets": [{"name": "addition", "path": "addition.jsonl", "n_prompts": 4, "shard_size": 2,
                               "max_new_tokens": 4}]},
        "lease": {"duration_s": 10, "heartbeat_s": 2},
    }
    (tmp / "cfg" / "eval.json").write_text(json.dumps(cfg))
    return tmp / "cfg" / "eval.json"


def test_service_admits_markerless_checkpoint_after_quiescence(tmp_path: Path) -> None:
    watch, run_dir = tmp_path / "hf-trainer-out", tmp_path / "svc-run"
    watch.mkdir()
    ckpt = write_foreign_checkpoint(tmp_path, watch / "checkpoint-30", 30)
    (watch / "runs").mkdir()  # HF Trainer's tensorboard dir: no step, never a checkpoint
    proc = spawn("worker", "--run-dir", str(run_dir), "--watch", str(watch), "--eval-config",
                 str(_eval_config(tmp_path)), "--quiescence", str(QUIESCENCE), "--engine", "hf", "--layout", "plain",
                 "--max-units", "2", "--poll-interval", "0.2")
    try:
        wait_for(lambda: (run_dir / "run.json").exists(), 30, what="the service to create the run")
        for i in range(3):  # the trainer is still writing: each change restarts the quiet period
            time.sleep(0.6)
            (ckpt / "rng_state.json").write_text(json.dumps({"i": i}))
        last_change = time.time()
        code, out = finish(proc, timeout=90)
    finally:
        kill_all([proc])
    assert code == EXIT_DONE, out
    run = RunDir.open(run_dir)
    manifest = run.manifest()
    assert manifest.snapshot_roots == (str(watch.resolve()),) and manifest.entry("addition").n_prompts == 4
    got = results(run)
    assert sorted(got) == [WorkUnit(30, "addition", 0), WorkUnit(30, "addition", 1)]
    assert all(r.ok and r.weight_versions == (version(run, 30),) * 2 for r in got.values()), out
    assert min(claimed_at(r) for r in got.values()) - last_change >= QUIESCENCE
    assert not (ckpt / ".complete").exists()  # the foreign dir is never written to
    assert (run.adopted / f"{30:010d}.json").exists()

    # restart (same command, one pass): nothing is evaluated again
    again = spawn("worker", "--run-dir", str(run_dir), "--watch", str(watch), "--eval-config",
                  str(tmp_path / "cfg" / "eval.json"), "--engine", "fn:tests.support.workers:SumBackend", "--once",
                  "--quiescence", str(QUIESCENCE), "--poll-interval", "0.2")
    code, out = finish(again, timeout=30)
    assert code == EXIT_DONE and "step=" not in out, out
    assert results(run) == got

    # a new checkpoint after the restart: a one-pass worker waits for its quiescence, then evaluates it
    write_foreign_checkpoint(tmp_path, watch / "checkpoint-60", 60)
    once = spawn("worker", "--run-dir", str(run_dir), "--watch", str(watch), "--engine",
                 "fn:tests.support.workers:SumBackend", "--once", "--quiescence", str(QUIESCENCE), "--poll-interval", "0.2")
    code, out = finish(once, timeout=30)
    assert code == EXIT_DONE, out
    steps = sorted({u.step for u in results(run)})
    assert steps == [30, 60] and len(results(run)) == 4


def test_eval_config_must_match_an_existing_run(tmp_path: Path) -> None:
    watch, run_dir = tmp_path / "w", tmp_path / "r"
    watch.mkdir()
    cfg_path = _eval_config(tmp_path)
    args = ["--run-dir", str(run_dir), "--watch", str(watch), "--engine", "fn:tests.support.workers:SumBackend",
            "--once", "--quiescence", "0", "--poll-interval", "0.1"]
    code, out = finish(spawn("worker", *args, "--eval-config", str(cfg_path)), timeout=30)
    assert code == EXIT_DONE, out
    cfg = json.loads(cfg_path.read_text())
    cfg["eval"]["datasets"][0]["shard_size"] = 1
    cfg_path.write_text(json.dumps(cfg))
    code, out = finish(spawn("worker", *args, "--eval-config", str(cfg_path)), timeout=30)
    assert code == EXIT_USAGE and "different eval config" in out
    code, out = finish(spawn("worker", "--run-dir", str(tmp_path / "x"), "--eval-config", str(cfg_path)), 30)
    assert code == EXIT_USAGE and "--watch" in out


def test_discovery_reports_dirs_awaiting_quiescence(tmp_path: Path) -> None:
    """ckpteval.coord.snapshots.discovery.SnapshotDiscovery.awaiting_quiescence (added for --once over --watch dirs)."""
    from ckpteval.coord.snapshots.discovery import SnapshotDiscovery

    now = [0.0]
    watch = tmp_path / "w"
    watch.mkdir()
    write_foreign_checkpoint(tmp_path, watch / "checkpoint-5", 5)
    d = SnapshotDiscovery(watch, admit_foreign=True, quiescence_s=10, adoption_dir=tmp_path / "adopted",
                          clock=lambda: now[0])
    assert d.poll() == [] and d.awaiting_quiescence == ["checkpoint-5"]
    now[0] = 10.0
    assert [r.step for r in d.poll()] == [5] and d.awaiting_quiescence == []


def test_status_of_a_watch_run_says_what_it_watches_and_when_it_last_saved(tmp_path: Path) -> None:
    """A --watch run's trainer is another program whose end nothing signals: status says what it knows (the
    watched dir, the newest save's age), never 'training running' forever."""
    watch, run_dir = tmp_path / "ckpts", tmp_path / "svc"
    watch.mkdir()
    write_foreign_checkpoint(tmp_path, watch / "checkpoint-10", 10)
    worker = spawn("worker", "--run-dir", str(run_dir), "--watch", str(watch), "--eval-config", str(_eval_config(tmp_path)),
                   "--engine", "fn:tests.support.workers:SumBackend", "--once", "--quiescence", "0.5",
                   "--poll-interval", "0.2")
    code, out = finish(worker, timeout=90)
    assert code == EXIT_DONE, out
    code, text = finish(spawn("status", str(run_dir), env={"COLUMNS": "400"}), timeout=60)
    assert code == 0, text
    health = text.rstrip().splitlines()[-1]
    assert health.startswith(f"watching {watch}: last save 0 min ago (its trainer's end is not signalled to "
                             "ckpteval) | units done 2"), text
    code, raw = finish(spawn("status", "--json", str(run_dir)), timeout=60)
    watching = json.loads(raw)["watching"]
    assert watching["roots"] == [str(watch)] and watching["last_save_at"] <= time.time()
