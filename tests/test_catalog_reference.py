"""The step-0 check against published scores (#41): a scripted engine of known accuracy, scored by a real
worker through the catalog entry, is recovered within its stderr; every setting that differs from the source's
is named, and one that moves the score refuses the comparison before any z-score."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ckpteval.jobs.eval.catalog.expand import expand_entry
from ckpteval.jobs.eval.catalog.reference import differences, reference_for, references
from ckpteval.jobs.eval.kinds.evaluate import install_checks
from ckpteval.jobs.eval.worker.evalconfig import create_run_from_config
from ckpteval.jobs.eval.worker.options import WorkerOptions
from ckpteval.jobs.lifecycle import EXIT_DONE
from ckpteval.jobs.reference.model import save_tokenizer
from ckpteval.jobs.views.status.data import collect_status
from ckpteval.jobs.views.status.text import render
from tests.support.workers import base_dir, publish_model, run_inprocess

MODEL = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
AS_PUBLISHED = {"catalog": "aime24", "model": MODEL, "template": "deepseek-r1", "max_new_tokens": 32768,
                "temperature": 0.6, "top_p": 0.95, "n_samples": 64, "reasoning": {"end": "</think>"}}
WRONG = {"max_new_tokens": 2048, "reasoning": None, "template": "qwen25-math-cot", "temperature": 0.0, "top_p": 1.0,
         "n_samples": 1}


def _entry(**over):
    from ckpteval.coord.run.manifest import Fields, parse_entry

    install_checks()
    ds = expand_entry({**AS_PUBLISHED, **over}, "test")
    ds.setdefault("n_prompts", ds.get("subset") or 30)
    return parse_entry(Fields(Path("eval.json"), ds, "eval.datasets[0]"))


def test_the_published_scores_cite_their_source_and_settings() -> None:
    refs = references("aime24") + references("math500")
    assert {(r.model, r.score) for r in refs} >= {(MODEL, 0.289), (MODEL, 0.839)}
    assert all(r.url.startswith("https://") and r.read_via and r.n_samples == 64 for r in refs)
    assert reference_for(_entry()) == next(r for r in references("aime24") if r.model == MODEL)
    assert differences(_entry(), reference_for(_entry())) == []  # the catalog can state the source's settings


@pytest.mark.parametrize(("over", "setting"), [
    ({"max_new_tokens": 4096}, "max_new_tokens"), ({"reasoning": None}, "think opener"),
    ({"template": "qwen25-math-cot"}, "template"), ({"system_prompt": "Be brief."}, "system_prompt"),
    ({"temperature": 0.0}, "temperature"), ({"top_p": 1.0}, "top_p"), ({"subset": 10}, "subset"),
])
def test_each_wrong_setting_is_named_and_refuses_the_comparison(over: dict, setting: str) -> None:
    entry = _entry(**over)
    found = differences(entry, reference_for(entry))
    assert [(d.setting, d.refuses) for d in found] == [(setting, True)]


def test_another_few_shot_count_refuses_and_fewer_samples_or_a_larger_budget_only_warn() -> None:
    ref = reference_for(_entry())
    assert [(d.setting, d.refuses) for d in differences(_entry(), dataclasses.replace(ref, few_shot=4))] == [
        ("few-shot count", True)]
    assert [(d.setting, d.refuses) for d in differences(_entry(n_samples=8, max_new_tokens=40000), ref)] == [
        ("max_new_tokens", False), ("n_samples", False)]


def test_status_recovers_a_known_accuracy_at_step_0_and_refuses_wrong_settings_first(tmp_path: Path) -> None:
    """Step 0, and a later snapshot with step 0's weights (not one with other weights), against the source."""
    install_checks()
    published = reference_for(_entry()).score
    accuracy = {"aime24": published, "aime24_other": published - 0.15, "aime24_wrong": published, "aime24_unlisted": 0.5}
    config = tmp_path / "eval.json"
    config.write_text(json.dumps({"eval": {
        "engine": {"fn": {"accuracy": accuracy}},
        "datasets": [AS_PUBLISHED, {**AS_PUBLISHED, "name": "aime24_other"},
                     {**AS_PUBLISHED, **WRONG, "name": "aime24_wrong"},
                     {**AS_PUBLISHED, "name": "aime24_unlisted", "model": "my-org/my-base", "n_samples": 1}]}}))
    run = create_run_from_config(tmp_path / "run", config, (tmp_path / "run" / "snapshots",))
    save_tokenizer(base_dir(tmp_path), 64, chat=True)  # the snapshot's tokenizer renders the chat rows
    publish_model(tmp_path, run.snapshots, 0)
    publish_model(tmp_path, run.snapshots, 5, seed=0)  # the base again (step 0's weights): checked too
    publish_model(tmp_path, run.snapshots, 10)  # trained weights: not the base
    opts = WorkerOptions(run_dir=run.path, engines=("fn:tests.support.known_accuracy:KnownAccuracyBackend",),
                         once=True, poll_interval_s=0.1)
    code, _ = run_inprocess(opts, out=lambda _line: None)
    assert code == EXIT_DONE
    status = collect_status(run.path)
    same, other, wrong = (status["reference"][n] for n in ("aime24", "aime24_other", "aime24_wrong"))
    assert abs(same["score"] - published) <= 2 * same["stderr"] and abs(same["z"]) <= 2  # recovered within its stderr
    assert [b["step"] for b in same["base_points"]] == [0, 5] and abs(same["base_points"][1]["z"]) <= 3
    assert other["z"] < -3  # a base 15 points below the source's is told apart
    assert wrong["z"] is None and wrong["score"] is None and len(wrong["differences"]) == 5
    text = "\n".join(str(line) for line in render(status))
    line = next(x for x in text.splitlines() if x.startswith("reference aime24_wrong"))
    for setting in ("max_new_tokens 2048", "think opener 'none'", "template 'qwen25-math-cot'", "temperature 0.0",
                    "top_p 1.0"):
        assert setting in line, (setting, line)
    assert "no published score of my-org/my-base on aime24" in text  # a model the catalog has no score for is said
    same_line = next(x for x in text.splitlines() if x.startswith("reference aime24:"))
    assert "z =" not in line and "z = " in same_line and "step 5 (step 0's weights)" in same_line
    assert "step 10" not in same_line


def test_creating_a_run_warns_once_naming_each_setting_that_differs_from_the_source(tmp_path: Path, capsys) -> None:
    install_checks()
    config = tmp_path / "eval.json"
    config.write_text(json.dumps({"eval": {"datasets": [
        {**AS_PUBLISHED, **WRONG, "name": "aime24_wrong"}, {**AS_PUBLISHED, "name": "aime24_same"},
        {**AS_PUBLISHED, "name": "aime24_fewer", "n_samples": 8}, {"catalog": "math500"}]}}))
    create_run_from_config(tmp_path / "run", config, ())
    err = capsys.readouterr().err.splitlines()
    wrong = [x for x in err if "'aime24_wrong'" in x]
    assert len(wrong) == 1 and wrong[0].startswith("ckpteval: warning: ")
    for setting in ("max_new_tokens 2048", "think opener 'none'", "template 'qwen25-math-cot'", "temperature 0.0",
                    "top_p 1.0"):
        assert setting in wrong[0], (setting, wrong[0])
    assert "will not compare" in wrong[0]
    fewer = [x for x in err if "'aime24_fewer'" in x]  # a warning-only difference is said, and not as a refusal
    assert len(fewer) == 1 and "n_samples 8" in fewer[0] and "will not compare" not in fewer[0]
    assert not [x for x in err if "aime24_same" in x or "math500" in x]  # as published, or no model: nothing
    create_run_from_config(tmp_path / "run", config, ())  # the run exists: said once, when it was created
    assert "warning" not in capsys.readouterr().err
