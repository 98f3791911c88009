"""The user guide's HF Trainer snippet, copied from docs/USER_GUIDE.md as written, scores every point.

The snippet (the ```python block starting ``# guide: hf-trainer``) and the set-up it relies on (the
plain-loop block's first heredoc: ``eval.json``, ``sums.jsonl``, ``base-model/``) are extracted from the
guide here, so the doc and this test cannot drift. A real ``ckpteval worker`` process scores the points.
Also: the same snippet without ``processing_class`` (checkpoints without tokenizer files) still scores
every point with the run's tokenizer, and a watched checkpoint with no tokenizer anywhere is a
``no_tokenizer`` skip naming the files and the fix — never exit 4.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpteval.coord.results.files import ResultIndex
from ckpteval.jobs.reference.model import build_model, save_tokenizer
from tests.conftest import TINY_CFG
from tests.support.training import eval_lines

ROOT = Path(__file__).parents[1]
GUIDE = (ROOT / "docs" / "USER_GUIDE.md").read_text()
SNIPPET = re.search(r"```python\n(# guide: hf-trainer\n.*?)```", GUIDE, re.S)
SETUP = re.search(r"python - <<'PY'\n(.*?save_base_model_dir\(.*?)\nPY\n", GUIDE, re.S)
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
       "PYTHONPATH": str(ROOT)}


def test_guide_has_the_snippet_and_its_setup() -> None:
    assert SNIPPET is not None and "processing_class=tok" in SNIPPET.group(1)
    assert SETUP is not None and "eval.json" in SETUP.group(1)


def _run_snippet(tmp_path: Path, snippet: str) -> tuple[int, float, str]:
    """Set-up, worker, snippet (all real processes); returns the worker's exit code, the seconds from the
    snippet's start to its first scored point, and the worker's stderr."""
    subprocess.run([sys.executable, "-c", SETUP.group(1)], cwd=tmp_path, env=ENV, check=True, timeout=120)
    worker = subprocess.Popen(["ckpteval", "worker", "--run-dir", "runs/hf", "--wait-for-run", "600", "--engine", "hf",
                               "--poll-interval", "0.2"], cwd=tmp_path, env=ENV, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    trainer = subprocess.Popen([sys.executable, "-c", snippet], cwd=tmp_path, env=ENV)
    first = None
    metrics = tmp_path / "runs" / "hf" / "metrics.jsonl"
    while trainer.poll() is None:
        if first is None and metrics.is_file() and eval_lines(metrics.parent):
            first = time.monotonic() - t0
        time.sleep(0.2)
    try:
        _, err = worker.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        worker.kill()
        _, err = worker.communicate()
    assert trainer.returncode == 0, err[-2000:]
    return worker.returncode, first if first is not None else time.monotonic() - t0, err


def _scored_points(run: Path) -> dict[int, float]:
    return {int(r["eval/step"]): r["eval/sums"] for r in eval_lines(run) if "eval/sums" in r}


@pytest.mark.timeout(400)
def test_guide_hf_trainer_snippet_scores_every_point(tmp_path: Path) -> None:
    code, first_s, err = _run_snippet(tmp_path, SNIPPET.group(1))
    assert code == 0, err[-2000:]
    assert sorted(_scored_points(tmp_path / "runs" / "hf")) == [0, 10, 20], err[-2000:]
    print(f"HF Trainer snippet: first point {first_s:.1f}s after the snippet started")


@pytest.mark.timeout(400)
def test_snippet_without_processing_class_uses_the_runs_tokenizer(tmp_path: Path) -> None:
    """The old snippet (no ``processing_class``): checkpoints without tokenizer files score with RUN/base's."""
    snippet = SNIPPET.group(1).replace("processing_class=tok,", "")
    assert snippet != SNIPPET.group(1)
    code, _, err = _run_snippet(tmp_path, snippet)
    out = tmp_path / "hf-out"
    assert not (out / "checkpoint-10" / "tokenizer.json").exists()  # really saved without a tokenizer
    assert code == 0, err[-2000:]
    assert sorted(_scored_points(tmp_path / "runs" / "hf")) == [0, 10, 20], err[-2000:]


def test_watched_checkpoint_without_any_tokenizer_is_a_named_skip(tmp_path: Path) -> None:
    """``--watch`` of a plain Trainer output without tokenizer, no run tokenizer: a skip that names the
    missing files and the fix, written at once; the worker exits 0 (not 4: nothing is wrong with it)."""
    watch = tmp_path / "out"
    ckpt = watch / "checkpoint-5"
    build_model(TINY_CFG).save_pretrained(ckpt, safe_serialization=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 5}))
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4)))
    cfg = tmp_path / "eval.json"
    cfg.write_text(json.dumps({"eval": {"datasets": [{"name": "sums", "path": "sums.jsonl", "n_prompts": 4,
                                                      "scorer": "exact", "shard_size": 4, "max_new_tokens": 2}]}}))
    argv = ["ckpteval", "worker", "--run-dir", str(tmp_path / "run"), "--watch", str(watch),
            "--eval-config", str(cfg), "--layout", "hf-trainer", "--once", "--engine", "hf"]
    proc = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = list(ResultIndex(tmp_path / "run" / "results").refresh().values())
    assert [r.skip_reason for r in results] == ["no_tokenizer"], proc.stderr[-2000:]
    assert "tokenizer.json" in results[0].message and "processing_class" in results[0].message
    assert "RUN/base/" in results[0].message and "run the worker again" in results[0].message
    save_tokenizer(tmp_path / "run" / "base")  # the fix the message names: the run's tokenizer, then a rerun
    again = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "nothing to do" not in again.stdout, again.stdout  # was: the skip stood, "nothing to do"
    index = ResultIndex(tmp_path / "run" / "results")
    [(unit, result)] = index.refresh().items()
    assert result.skip_reason is None and len(result.scores) == 4, (result.skip_reason, result.message)
    assert index.generation(unit) == 1  # superseded, the skip's file kept as the record
    third = subprocess.run(argv, env=ENV, capture_output=True, text=True, timeout=300)  # nothing left to redo
    assert third.returncode == 0 and "nothing to do" in third.stdout, third.stdout + third.stderr[-2000:]


def test_prime_rl_broadcast_scored_after_the_trainer_deleted_it(tmp_path: Path) -> None:
    """A current prime-rl run dir (``broadcasts/step_N`` weights only + STABLE) watched by a real worker with
    the model's config and tokenizer in RUN/base: the broadcast is captured, the trainer's cleanup deletes
    the source, and the point is still scored from the capture; the point final, the worker collects the
    capture (RUN/captured/ is not kept forever) and the adoption record keeps it from being captured again."""
    import shutil

    out = tmp_path / "prime"
    src = out / "broadcasts" / "step_4"
    build_model(TINY_CFG).save_pretrained(src, safe_serialization=True)
    (src / "config.json").unlink()  # a broadcast has weights only
    (src / "generation_config.json").unlink(missing_ok=True)
    (src / "STABLE").touch()
    run = tmp_path / "run"
    (run / "base").mkdir(parents=True)
    build_model(TINY_CFG).config.save_pretrained(run / "base")
    save_tokenizer(run / "base")
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4)))
    cfg = tmp_path / "eval.json"
    cfg.write_text(json.dumps({"eval": {"datasets": [{"name": "sums", "path": "sums.jsonl", "n_prompts": 4,
                                                      "scorer": "exact", "shard_size": 4, "max_new_tokens": 2}]}}))
    from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
    from ckpteval.jobs.eval.worker.evalconfig import create_run_from_config

    create_run_from_config(run, cfg, (out,))
    disc = SnapshotDiscovery(out, admit_foreign=True, adoption_dir=run / "adopted", layout="auto")
    [ref] = disc.poll()  # captured now, as a worker's poll would
    shutil.rmtree(src)  # the trainer's cleanup of step_4 (maybe_clean, two steps later)
    proc = subprocess.run(["ckpteval", "worker", "--run-dir", str(run), "--watch", str(out), "--once", "--engine", "hf"],
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = list(ResultIndex(run / "results").refresh().values())
    assert [(r.unit.step, r.ok) for r in results] == [(4, True)], [r.message for r in results]
    assert ref.path.parent == run / "captured"
    assert not ref.path.exists() and (run / "adopted" / "0000000004.json").is_file()  # final: capture collected
    assert disc.poll() == [] and not (run / "captured" / "step_0000000004").exists()  # gone, not re-captured
