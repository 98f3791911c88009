"""The walk-through's defects a new user meets on the command line, each through the real ``ckpteval``
entry points: a judged set with no judge in an offline backfill, the backfill's own error prefix, its
progress in a log file (no tqdm bar redrawn into a ``.out``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from ckpteval.jobs.eval.worker.backfill import Progress

ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}


def _service_run(tmp_path: Path, scorer: str = "judge", options: dict | None = None) -> Path:
    (tmp_path / "out").mkdir()
    (tmp_path / "qa.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    cfg = tmp_path / "eval.json"
    cfg.write_text(json.dumps({"eval": {"datasets": [{"name": "qa", "path": "qa.jsonl", "n_prompts": 1, "scorer": scorer,
                                                      "scorer_options": options or {}, "shard_size": 1,
                                                      "max_new_tokens": 2}]}}))
    from ckpteval.jobs.eval.worker.evalconfig import create_run_from_config

    return create_run_from_config(tmp_path / "run", cfg, (tmp_path / "out",)).path


def _backfill(run: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ckpteval", "backfill", "--run-dir", str(run), "--engine", "hf", *extra], env=ENV,
                          capture_output=True, text=True, timeout=120)


def test_offline_backfill_of_a_judged_set_without_a_judge_fails_fast_and_says_why(tmp_path: Path) -> None:
    proc = _backfill(_service_run(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("ckpteval backfill: ") and "qa" in line and "--judge-url" in line
    assert not list((tmp_path / "run" / "results").rglob("*.json"))  # nothing claimed, nothing written


def test_a_judged_set_with_its_own_url_is_not_refused(tmp_path: Path) -> None:
    proc = _backfill(_service_run(tmp_path, options={"url": "http://127.0.0.1:9/v1"}))
    assert proc.returncode == 0 and "no judge is known" not in proc.stderr, proc.stderr


def test_backfill_errors_are_prefixed_backfill_not_worker(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    proc = _backfill(tmp_path / "empty")  # no run.json: a usage error raised inside the worker
    assert proc.returncode == 2 and proc.stderr.startswith("ckpteval backfill: "), proc.stderr
    assert "ckpteval worker:" not in proc.stderr


def test_backfill_progress_in_a_log_file_is_lines_not_a_bar(capsys) -> None:  # noqa: ANN001
    progress = Progress(tty=False)
    for outstanding in (10, 10, 7, 5, 0):
        progress(outstanding)
    progress.close()
    out, err = capsys.readouterr()
    assert "\r" not in out + err and "|" not in err  # no tqdm bar
    assert out.splitlines() == ["backfill: 3/10 units", "backfill: 5/10 units", "backfill: 10/10 units"]
    grown = Progress(tty=False)
    grown(2)
    grown(3)  # a new snapshot appeared: the total grows, nothing counted twice
    grown(0)
    assert (grown.total, grown.done) == (3, 3)


def _train_words(script: str) -> list[str]:
    """The words the job runs as its trainer: the script's settings block, then its own split of
    ``CKPTEVAL_TRAIN_CMD`` (the sbatch's ``if [[ $(declare -p CKPTEVAL_TRAIN_CMD) ...`` block), in bash."""
    settings = script.split("# >>> ckpteval settings", 1)[1].split("# <<< ckpteval settings", 1)[0]
    select = re.search(r"\n( *if \[\[ \$\(declare -p CKPTEVAL_TRAIN_CMD\).*?\n *fi\n)", script, re.S)
    assert select is not None
    body = settings.split("\n", 1)[1] + select.group(1) + 'printf "%s\\0" "${_train[@]}"\n'
    out = subprocess.run(["bash", "-uc", body], capture_output=True, text=True, check=True).stdout
    return out.split("\0")[:-1]


def test_train_cmd_keeps_quoted_arguments_one_word(tmp_path: Path) -> None:
    proc = subprocess.run(["ckpteval", "submit", "train-eval", "--run-dir", str(tmp_path / "r"), "--dry-run",
                           "--train-cmd", "python my_train.py --config 'cfg a.yaml' --name \"x y\""],
                          env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert _train_words(proc.stdout) == ["python", "my_train.py", "--config", "cfg a.yaml", "--name", "x y"]
    bad = subprocess.run(["ckpteval", "submit", "train-eval", "--run-dir", str(tmp_path / "r"), "--dry-run",
                          "--train-cmd", "python t.py 'unbalanced"], env=ENV, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--train-cmd" in bad.stderr and "quotation" in bad.stderr


def test_readmes_own_trainer_example_renders_and_the_docs_show_its_settings(tmp_path: Path) -> None:
    """#31: README's ``--train-cmd`` example (its own trainer, quoted config path), rendered as written, keeps
    the quoted argument one word; README and guide both show ``--trainer-gpus``, ``CKPTEVAL_RUN_DIR``, the
    resume and the 600 s wait for run.json (before, their examples submitted only the toy trainer)."""
    root = Path(__file__).parents[1]
    readme, guide = (root / "README.md").read_text(), (root / "docs" / "USER_GUIDE.md").read_text()
    example = re.search(r"^ckpteval submit train-eval --run-dir \S+ (--trainer-gpus.*?--train-cmd \"[^\"]+\")$", readme,
                        re.S | re.M)
    assert example is not None
    words = shlex.split(example.group(1).replace("\\\n", " "))
    proc = subprocess.run(["ckpteval", "submit", "train-eval", "--run-dir", str(tmp_path / "r"), "--dry-run", *words],
                          env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert _train_words(proc.stdout)[-2:] == ["--config", "configs/my run.yaml"]
    for doc in (readme, guide):
        for shown in ("--train-cmd", "--trainer-gpus", "CKPTEVAL_RUN_DIR", "run.json\").exists()", "600 s"):
            assert shown in doc, shown


def test_resume_with_another_eval_interval_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    base = ["ckpteval", "train", "--run-dir", str(run), "--steps", "2", "--eval-n-prompts", "4", "--eval-fleet", "none",
            "--no-progress", "--save-hf", str(tmp_path / "hf"), "--save-interval", "1"]
    first = subprocess.run([*base, "--eval-interval", "1"], env=ENV, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    again = subprocess.run([*base, "--eval-interval", "2", "--resume"], env=ENV, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 2, again.stdout + again.stderr
    assert "created with --eval-interval 1, not 2" in again.stderr and len(again.stderr.strip().splitlines()) == 1


def _watch_config(tmp_path: Path, rows: str, extra: dict | None = None) -> Path:
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "set.jsonl").write_text(rows)
    cfg = tmp_path / "eval.json"
    cfg.write_text(json.dumps({"eval": {"datasets": [{"name": "s", "path": "set.jsonl", **(extra or {})}]}}))
    return cfg


def _once(tmp_path: Path, cfg: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ckpteval", "worker", "--run-dir", str(tmp_path / "run"), "--watch", str(tmp_path / "out"),
                           "--eval-config", str(cfg), "--once", "--engine", "hf"], env=ENV, capture_output=True,
                          text=True, timeout=120)


def test_empty_jsonl_is_named_as_empty(tmp_path: Path) -> None:
    proc = _once(tmp_path, _watch_config(tmp_path, ""))
    assert proc.returncode == 2 and "set.jsonl is empty (no JSONL rows)" in proc.stderr, proc.stderr
    assert "n_prompts must be >= 1" not in proc.stderr


def test_worker_once_says_when_there_is_nothing_to_do(tmp_path: Path) -> None:
    proc = _once(tmp_path, _watch_config(tmp_path, json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n"))
    assert proc.returncode == 0 and "--once: nothing to do: no complete snapshot found" in proc.stdout, proc.stderr


def test_n_samples_at_temperature_0_is_warned(tmp_path: Path) -> None:
    rows = json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n"
    proc = _once(tmp_path, _watch_config(tmp_path, rows, {"n_samples": 4, "pass_k": [1, 4]}))
    assert proc.returncode == 0 and "n_samples=4 at temperature 0" in proc.stderr, proc.stderr


def test_backfill_help_is_true_and_its_doc_references_exist() -> None:
    """``--eval-config`` works with ``--from-run`` in backfill (not only ``--watch``), and the PROTOCOL
    section ``--trust-run-code`` names is there."""
    out = subprocess.run(["ckpteval", "backfill", "--help"], env={**ENV, "COLUMNS": "2000"}, capture_output=True,
                         text=True, timeout=60).stdout
    line = next(x for x in out.splitlines() if x.strip().startswith("--eval-config FILE"))
    assert "--from-run" in line and "--watch" in line
    section = re.search(r"'([^']+)'\)", next(x for x in out.splitlines() if x.strip().startswith("--trust-run-code")))
    protocol = (Path(__file__).parents[1] / "docs" / "PROTOCOL.md").read_text()
    assert section is not None and f"### {section.group(1)}" in protocol


def test_submit_refuses_what_train_refuses(tmp_path: Path) -> None:
    """``submit train-eval -- --eval-interval 7 --save-interval 5``: refused on the submit host with train's
    own line, not queued to fail in the job."""
    proc = subprocess.run(["ckpteval", "submit", "train-eval", "--run-dir", str(tmp_path / "r"), "--dry-run", "--",
                           "--steps", "20", "--eval-interval", "7", "--save-hf", str(tmp_path / "hf"),
                           "--save-interval", "5"], env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "must be a multiple of --save-interval 5" in proc.stderr, proc.stderr
    assert not (tmp_path / "r").exists() and "#SBATCH" not in proc.stdout


def test_backfill_tally_counts_a_retried_unit_once_and_says_when_nothing_scored() -> None:
    """The judge down: a unit skipped judge_failed, retried in the same backfill and skipped again, is one
    unit in the summary (before: two), and a backfill that scored nothing says so."""
    from ckpteval.coord.results.files import ok_result, skip_result
    from ckpteval.coord.work.units import WorkUnit
    from ckpteval.jobs.eval.worker.backfill import Tally

    tally = Tally()
    unit = WorkUnit(10, "qa", 0)
    tally(skip_result(unit, "judge_failed", "judge at http://h:1/v1 refused the connection"))
    tally(skip_result(unit, "judge_failed", "judge at http://h:1/v1 refused the connection"))
    tally(skip_result(WorkUnit(10, "qa", 1), "judge_failed", "refused"))
    assert (tally.results, tally.ok, tally.skipped["judge_failed"][0]) == (2, 0, 2)
    assert tally.summary().startswith("2 evaluated here: 0 scored, 2 skipped") and "NOTHING SCORED" in tally.summary()
    tally(ok_result(unit, [1.0], ["10"]))  # a later retry of the same unit scored
    assert (tally.results, tally.ok) == (2, 1) and "NOTHING SCORED" not in tally.summary()


def test_a_backfill_whose_judge_was_down_exits_non_zero_and_says_so(tmp_path: Path) -> None:
    """The judge down for a whole backfill (connection refused, no wait): every unit is skipped
    ``judge_failed``; the backfill says nothing was scored and exits 1, not 0 (was: exit 0, a job marked
    done); nor 4 (no fresh node brings a judge back: the batch scripts must not requeue it)."""
    run = _service_run(tmp_path, options={"url": "http://127.0.0.1:9/v1", "retries": 0, "wait_s": 0, "timeout_s": 2})
    _checkpoint(tmp_path / "out" / "checkpoint-5")
    proc = _backfill(run, "--layout", "hf-trainer", "--quiescence", "0.5")
    assert "judge_failed" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "NOTHING SCORED" in proc.stdout and "run backfill again" in proc.stdout
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("ckpteval backfill: ") and "judge_failed" in line and "run backfill again" in line, line


def _checkpoint(ckpt: Path) -> None:
    """A Trainer checkpoint of the reference model, with its tokenizer."""
    from ckpteval.jobs.reference.model import build_model, save_tokenizer
    from tests.conftest import TINY_CFG

    build_model(TINY_CFG).save_pretrained(ckpt, safe_serialization=True)
    save_tokenizer(ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 5}))


def test_n_samples_above_1_at_temperature_0_is_warned_once_at_start(tmp_path: Path) -> None:
    """A set drawing ``n_samples=3`` greedily (temperature 0): the worker says once, at start, that the samples
    are identical and what to set; the run still scores (legal, almost always a mistake)."""
    run = _service_run(tmp_path, scorer="exact")
    manifest = json.loads((run / "run.json").read_text())
    manifest["eval"]["datasets"][0]["n_samples"] = 3
    (run / "run.json").write_text(json.dumps(manifest))
    _checkpoint(tmp_path / "out" / "checkpoint-5")
    proc = _backfill(run, "--layout", "hf-trainer", "--quiescence", "0.5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "n_samples=3 at temperature 0" in line]
    assert len(warned) == 1 and "identical" in warned[0] and "temperature > 0" in warned[0], proc.stderr
