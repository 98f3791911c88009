"""The example eval sets in ``examples/`` and the reference trainer's ``--eval-config`` (issue 10 §7).

Real processes: the reference trainer (``ckpteval train``) runs as a subprocess with an eval-config
file naming the shipped GSM8K-format example set and an lm-eval task over ``tests/lmeval_task/``; its
shared posture evaluates both on its own engine. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.eval.kinds.generate.evalsets import load_rows
from ckpteval.jobs.eval.scorers import scorer_class
from ckpteval.jobs.eval.worker.evalconfig import read_eval_config
from tests.support.training import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckpteval.jobs.cli", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def test_the_generator_reproduces_the_committed_example_sets(tmp_path: Path) -> None:
    copy = tmp_path / "evalsets"
    shutil.copytree(EXAMPLES / "evalsets", copy)
    subprocess.run([sys.executable, str(copy / "generate.py")], check=True, capture_output=True, timeout=60)
    for name in ("gsm8k_style.jsonl", "latex_answers.jsonl", "chat.jsonl", "code.jsonl", "code_tiny.jsonl"):
        assert (copy / name).read_bytes() == (EXAMPLES / "evalsets" / name).read_bytes(), name


def test_example_sets_have_the_formats_they_claim() -> None:
    gsm = load_rows(EXAMPLES / "evalsets" / "gsm8k_style.jsonl")
    assert len(gsm) == 32 and all(r["answer"].rsplit("\n", 1)[-1].startswith("#### ") for r in gsm)
    latex = load_rows(EXAMPLES / "evalsets" / "latex_answers.jsonl")
    assert any("\\frac{" in r["answer"] for r in latex) and any("\\sqrt{" in r["answer"] for r in latex)
    assert any("\\pi" in r["answer"] for r in latex)
    chat = [json.loads(line) for line in (EXAMPLES / "evalsets" / "chat.jsonl").read_text().splitlines()]
    assert all(isinstance(r["messages"], list) and r["messages"][-1]["role"] == "user" for r in chat)
    assert any(len(r["messages"]) > 1 for r in chat)


def test_example_code_set_has_both_test_formats_and_a_valid_config() -> None:
    """20 problems: assert-style (MBPP lists and HumanEval check/entry_point) and stdin/stdout cases;
    that their reference solutions pass is tests/test_code_scorer.py's."""
    config = read_eval_config(EXAMPLES / "evalsets" / "code.eval.json")
    (spec,) = config.spec.entries
    assert (spec.scorer, spec.n_prompts, spec.pass_k) == ("code", 20, (1, 4))
    rows = load_rows(EXAMPLES / "evalsets" / "code.jsonl", scorer_class("code"))
    assert sum(isinstance(r.get("tests"), list) for r in rows) >= 5
    assert sum(isinstance(r.get("tests"), str) and "entry_point" in r for r in rows) >= 3
    assert sum(len(r.get("inputs", ())) == len(r.get("outputs", ())) > 0 for r in rows) == 10


@pytest.mark.parametrize("name", ["gsm8k_style.eval.json", "latex_answers.eval.json", "chat.eval.json"])
def test_example_eval_configs_are_valid_eval_configs(name: str) -> None:
    config = read_eval_config(EXAMPLES / "evalsets" / name)
    assert [d.n_prompts for d in config.spec.entries] == [32]
    assert all(src.is_file() for src in config.sources.values())


def _demo_fit(config_name: str) -> str | None:
    """Why the example does not fit the demo's tiny model (64 positions, no chat template), or None."""
    from ckpteval.jobs.eval.engines.base import context_problem
    from ckpteval.jobs.reference.model import build_tokenizer

    tokenizer = build_tokenizer()
    config = read_eval_config(EXAMPLES / "evalsets" / config_name)
    for spec in config.spec.entries:
        rows = load_rows(config.sources[spec.name])
        if spec.prompt_format == "chat":
            return "chat prompts need a chat template"
        longest = max(len(tokenizer(r["prompt"])["input_ids"]) for r in rows)
        if (why := context_problem(longest, spec.max_new_tokens, tokenizer.model_max_length)) is not None:
            return why
    return None


@pytest.mark.parametrize("name", ["gsm8k_style.eval.json", "latex_answers.eval.json", "chat.eval.json"])
def test_each_example_fits_the_demo_model_or_says_it_needs_a_real_one(name: str) -> None:
    """Run on the demo's 64-token model, an example that does not fit would be skipped ``rejected`` (or
    ``no_chat_template``) unit by unit: its README entry must say it needs a real model."""
    readme = (EXAMPLES / "evalsets" / "README.md").read_text()
    needs_real = {line.split("`")[1] for line in readme.splitlines() if line.startswith("- `") and "real model" in line}
    if _demo_fit(name) is not None:
        assert name in needs_real, f"{name} does not fit the demo model ({_demo_fit(name)}): say so in README.md"
    else:
        assert name not in needs_real


def test_the_demos_own_eval_set_fits_its_model(tmp_path: Path) -> None:
    from ckpteval.jobs.eval.engines.base import context_problem
    from ckpteval.jobs.eval.kinds.generate.evalsets import write_addition_dataset
    from ckpteval.jobs.reference.model import build_tokenizer

    run = RunDir.create(tmp_path / "run")
    spec = write_addition_dataset(run, n=128)
    tokenizer = build_tokenizer()
    longest = max(len(tokenizer(r["prompt"])["input_ids"]) for r in load_rows(run.resolve_data_path(spec.path)))
    assert context_problem(longest, spec.max_new_tokens, tokenizer.model_max_length) is None


def test_example_lm_eval_config_names_a_task_in_its_include_path() -> None:
    pytest.importorskip("lm_eval", reason="the harness extra (lm-eval) is not installed")
    from ckpteval.jobs.eval.kinds.lm_eval import check_harness

    config = read_eval_config(EXAMPLES / "lmeval" / "eval.json")
    lm_eval = tuple(e for e in config.spec.entries if e.kind == "lm_eval")
    assert lm_eval[0].include_path == str((EXAMPLES / "lmeval").resolve())
    run = RunDir(ROOT)  # include_path is absolute: the run dir does not matter
    check_harness(run, lm_eval)


def test_trainer_eval_config_replaces_the_builtin_set_and_logs_every_dataset_and_task(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval", reason="the harness extra (lm-eval) is not installed")
    config = tmp_path / "eval.json"
    config.write_text(json.dumps({
        "run_id": "from-config",
        "eval": {"datasets": [
            {"name": "gsm", "path": str(EXAMPLES / "evalsets" / "gsm8k_style.jsonl"), "n_prompts": 32,
             "shard_size": 16, "scorer": "math", "max_new_tokens": 4},
            {"kind": "lm_eval", "name": "harness", "tasks": ["ckpteval_addition_mc"],
             "include_path": str(ROOT / "tests" / "lmeval_task"), "include_defaults": False},
        ]},
        "lease": {"duration_s": 20, "heartbeat_s": 4},
    }))
    run_dir = tmp_path / "run"
    proc = cli("train", "--run-dir", str(run_dir), "--steps", "20", "--eval-interval", "10", "--no-progress",
               "--eval-posture", "shared", "--eval-config", str(config), "--threads", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = RunDir.open(run_dir).manifest()
    assert manifest.run_id == "from-config" and manifest.lease.duration_s == 20
    assert [d.name for d in manifest.eval.entries] == ["gsm", "harness"]  # the built-in addition set is not there
    assert (run_dir / "data" / "gsm.jsonl").read_bytes() == (EXAMPLES / "evalsets" / "gsm8k_style.jsonl").read_bytes()
    points = {m["eval/step"]: m for m in read_jsonl(run_dir / "metrics.jsonl") if "eval/step" in m}
    assert sorted(points) == [0, 10, 20]  # step 0: the initial weights (on by default)
    for m in points.values():
        # GSM8K prompts (105-120 tokens) do not fit the tiny model's 64 positions: both units of the set are
        # skipped `rejected`, as `ckpteval serve` and the fleet's hf engine skip them; the task still scores
        assert "eval/gsm" not in m and m["eval/skipped_rejected"] == 2, m
        assert 0.0 <= m["eval/ckpteval_addition_mc/acc"] <= 1.0
        assert m["eval/ckpteval_addition_mc/weight_version/mean"] == m["eval/step"]


def test_trainer_rejects_a_bad_eval_config_before_writing_anything(tmp_path: Path) -> None:
    config = tmp_path / "eval.json"
    config.write_text(json.dumps({"eval": {"datasets": [{"name": "gsm", "path": "missing.jsonl", "n_prompts": 3}]}}))
    run_dir = tmp_path / "run"
    proc = cli("train", "--run-dir", str(run_dir), "--steps", "5", "--eval-config", str(config))
    assert proc.returncode == 2
    assert "missing.jsonl not found" in proc.stderr and "Traceback" not in proc.stderr
    assert not run_dir.exists()
