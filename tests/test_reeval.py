"""Re-evaluating a finished run on a new benchmark (issue 10 §7): ``ckpteval backfill --from-run``.

Real processes (``python -m ckpteval.jobs.cli backfill``), real tiny-model snapshots of an existing run, the fn
backend (``SumBackend``, scores from the snapshot's own safetensors) for speed, and wandb offline. The
old run's directory is fingerprinted (every path, size, mtime and content hash) before and after.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from ckpteval.coord.run.identity import run_key
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.snapshot import publish_snapshot
from ckpteval.coord.work.steps import parse_steps
from ckpteval.jobs.eval.kinds.generate.evalsets import write_jsonl
from ckpteval.jobs.reference.model import make_addition_examples
from ckpteval.jobs.views.status.main import collect_status
from tests.support.workers import finish, make_eval_run, model_writer, publish_model, results, spawn

FN = ("--engine", "fn:tests.support.workers:SumBackend", "--poll-interval", "0.2")


def fingerprint(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: kind, size, mtime and content hash (dirs: their listing's mtime)."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        st = os.stat(dirpath)
        out[os.path.relpath(dirpath, root)] = ("dir", st.st_mtime_ns, tuple(sorted(dirnames + filenames)))
        for name in filenames:
            path = Path(dirpath) / name
            st = path.stat()
            out[str(path.relative_to(root))] = ("file", st.st_size, st.st_mtime_ns,
                                                hashlib.sha256(path.read_bytes()).hexdigest())
    return out


@pytest.fixture
def old_run(tmp_path: Path) -> RunDir:
    run = make_eval_run(tmp_path, name="old")
    for step in (10, 20, 30, 40):
        publish_model(tmp_path, run.snapshots, step)
    run.mark_training_done(40)
    return run


def eval_config(tmp: Path, name: str = "bench", n: int = 4) -> Path:
    d = tmp / f"cfg-{name}"
    d.mkdir()
    write_jsonl(d / "bench.jsonl", make_addition_examples(n, seed=99))
    (d / "eval.json").write_text(json.dumps({"eval": {"datasets": [
        {"name": name, "path": "bench.jsonl", "n_prompts": n, "shard_size": 2, "max_new_tokens": 4}]}}))
    return d / "eval.json"


def backfill(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, str]:
    return finish(spawn("backfill", *args, *FN, env=env), timeout=timeout)


def test_reevaluating_a_steps_subset_writes_only_into_the_new_run(tmp_path: Path, old_run: RunDir) -> None:
    before = fingerprint(old_run.path)
    new = tmp_path / "new"
    cfg = eval_config(tmp_path)
    code, out = backfill("--run-dir", str(new), "--from-run", str(old_run.path), "--eval-config", str(cfg),
                         "--steps", "20:40:20")
    assert code == 0, out
    assert "re-evaluating 2 step(s)" in out
    assert fingerprint(old_run.path) == before  # not one byte, name or mtime changed in the old run
    got = results(RunDir(new))
    assert sorted({u.step for u in got}) == [20, 40] and all(r.ok for r in got.values())
    assert {u.dataset for u in got} == {"bench"}
    assert all(Path(r.snapshot).parent == old_run.snapshots for r in got.values())  # OLD's weights
    manifest = RunDir.open(new).manifest()
    assert manifest.trainer["kind"] == "reeval" and manifest.trainer["from_run"] == str(old_run.path)
    assert manifest.trainer["steps"] == "20:40:20"
    status = collect_status(new)  # status shows the selected steps only, complete
    assert [p["step"] for p in status["points"]] == [20, 40] and all(p["complete"] for p in status["points"])

    # the same command again: idempotent, nothing evaluated twice, the old run still untouched
    code, out = backfill("--run-dir", str(new), "--from-run", str(old_run.path), "--eval-config", str(cfg),
                         "--steps", "20:40:20")
    assert code == 0 and "nothing to do" in out, out
    assert fingerprint(old_run.path) == before


def test_only_the_old_runs_own_snapshots_are_reevaluated(tmp_path: Path, old_run: RunDir) -> None:
    """OLD's snapshot dir also holds a marker without a run key (step 50) and another run's marker (step 60):
    neither is OLD's snapshot, so neither is counted, adopted or evaluated (a point on other weights)."""
    publish_snapshot(old_run.snapshots, 50, model_writer(tmp_path, 50))
    publish_snapshot(old_run.snapshots, 60, model_writer(tmp_path, 60), run="another-run-0000beef")
    new = tmp_path / "new"
    code, out = backfill("--run-dir", str(new), "--from-run", str(old_run.path), "--eval-config", str(eval_config(tmp_path)))
    assert code == 0, out
    assert "re-evaluating 4 step(s)" in out, out
    assert sorted({u.step for u in results(RunDir(new))}) == [10, 20, 30, 40]
    assert sorted(p.name for p in RunDir(new).adopted.glob("*.json")) == [f"{s:010d}.json" for s in (10, 20, 30, 40)]
    assert RunDir.open(new).manifest().trainer["from_run_key"] == run_key(old_run.manifest())
    assert [s["step"] for s in collect_status(new)["snapshots"]] == [10, 20, 30, 40]


def test_steps_latest_is_resolved_once_and_stored(tmp_path: Path, old_run: RunDir) -> None:
    new = tmp_path / "new"
    code, out = backfill("--run-dir", str(new), "--from-run", str(old_run.path), "--eval-config",
                         str(eval_config(tmp_path)), "--steps", "latest")
    assert code == 0, out
    assert RunDir.open(new).manifest().trainer["steps"] == "40"
    assert sorted({u.step for u in results(RunDir(new))}) == [40]


@pytest.mark.parametrize(
    "steps, why",
    [
        ("40:20", "STOP 20 is below START 40"),
        ("a:b", "START 'a' is not a non-negative integer"),
        ("0:40:0", "EVERY must be >= 1"),
        ("", "empty selection"),
        ("10,,20", "empty item"),
        ("all,10", "'all' cannot be combined"),
        ("1:2:3:4", "more than START:STOP:EVERY"),
        ("-5", "is not a non-negative integer"),
        ("1000:2000", "selects none of the steps with a snapshot"),
    ],
)
def test_bad_steps_are_one_clear_error_and_nothing_is_written(tmp_path: Path, old_run: RunDir, steps: str,
                                                              why: str) -> None:
    new = tmp_path / "new"
    code, out = backfill("--run-dir", str(new), "--from-run", str(old_run.path), "--eval-config",
                         str(eval_config(tmp_path)), "--steps", steps, timeout=60)
    assert code == 2, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ckpteval backfill: ") and why in lines[0], out
    assert not new.exists()


def test_a_new_run_dir_inside_the_old_run_or_a_different_existing_run_is_refused(tmp_path: Path,
                                                                                  old_run: RunDir) -> None:
    before = fingerprint(old_run.path)
    cfg = eval_config(tmp_path)
    code, out = backfill("--run-dir", str(old_run.path / "reeval"), "--from-run", str(old_run.path),
                         "--eval-config", str(cfg), timeout=60)
    assert code == 2 and "is inside --from-run" in out, out
    code, out = backfill("--run-dir", str(old_run.path), "--from-run", str(old_run.path), "--eval-config",
                         str(cfg), timeout=60)
    assert code == 2 and "is inside --from-run" in out, out
    assert fingerprint(old_run.path) == before
    new = tmp_path / "new"
    assert backfill("--run-dir", str(new), "--from-run", str(old_run.path), "--eval-config", str(cfg),
                    "--steps", "10")[0] == 0
    code, out = backfill("--run-dir", str(new), "--from-run", str(old_run.path), "--eval-config",
                         str(eval_config(tmp_path, name="other")), "--steps", "10", timeout=60)
    assert code == 2 and "is not this re-evaluation" in out, out


def test_from_run_flags_need_each_other(tmp_path: Path, old_run: RunDir) -> None:
    new = str(tmp_path / "new")
    for args, why in (
        (("--from-run", str(old_run.path)), "--from-run needs --eval-config"),
        (("--steps", "10"), "--steps selects steps of another run"),
        (("--eval-config", str(eval_config(tmp_path))), "--eval-config needs --from-run"),
    ):
        code, out = backfill("--run-dir", new, *args, timeout=60)
        assert code == 2 and why in out, out


def test_reevaluation_points_go_into_the_old_runs_wandb_run(tmp_path: Path, old_run: RunDir) -> None:
    from tests.test_metrics import wandb_records

    new = tmp_path / "new"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    code, out = backfill("--run-dir", str(new), "--from-run", str(old_run.path), "--eval-config",
                         str(eval_config(tmp_path)), "--steps", "10,30", "--wandb", "--wandb-mode", "resume",
                         env=env, timeout=180)
    assert code == 0, out
    run_id = old_run.manifest().run_id
    assert f"logged to wandb run {run_id}" in out
    (wandb_file,) = new.glob(f"wandb/offline-run-*/run-{run_id}.wandb")  # under NEW, never OLD
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in wandb_records(wandb_file) if r.WhichOneof("record_type") == "history"]
    assert sorted(h["eval/step"] for h in history if "eval/bench" in h) == [10, 30]
    assert not (old_run.path / "wandb").exists()


def test_step_selection_grammar() -> None:
    sel = parse_steps("0:5000:500")
    assert [s for s in range(0, 6001, 250) if s in sel] == list(range(0, 5001, 500))
    assert parse_steps(sel.text) == sel
    assert 7 in parse_steps("all") and 7 not in parse_steps("1:6")
    assert [s for s in range(20) if s in parse_steps("3,10:")] == [3, *range(10, 20)]
    assert parse_steps("latest").resolve([5, 40, 10]).text == "40"
    assert parse_steps("latest,0").select([0, 5, 9]) == [0, 9]


def test_submit_backfill_from_run_validates_on_dry_run_and_creates_the_new_run_before_sbatch(
    tmp_path: Path, old_run: RunDir, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sbatch`` is a stand-in script here (the real SLURM cluster tests live in tests/slurm/)."""
    from ckpteval.jobs.launch import submit

    before = fingerprint(old_run.path)
    new, cfg = tmp_path / "new", eval_config(tmp_path)
    argv = ["backfill", "--run-dir", str(new), "--from-run", str(old_run.path), "--eval-config", str(cfg),
            "--steps", "0:40:20", "--tasks", "4"]
    assert submit.main([*argv[:-2], "--steps", "5:1", "--dry-run"]) == 2
    assert "STOP 1 is below START 5" in capsys.readouterr().err
    assert submit.main([*argv, "--dry-run"]) == 0
    assert f"CKPTEVAL_RUN_DIRS=({new})" in capsys.readouterr().out
    assert not new.exists()  # a dry run writes nothing
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text('#!/bin/bash\necho 77\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    assert submit.main(argv) == 0
    manifest = RunDir.open(new).manifest()  # the array tasks find run.json ready
    assert manifest.trainer["steps"] == "0:40:20" and manifest.eval.entries[0].name == "bench"
    assert fingerprint(old_run.path) == before
