"""The judge and reward-model scorers against a real HTTP judge: ``ckpteval serve --judge MODE`` (the judge
stand-in, a real server process) answering a verdict the test can compute, or failing in each way a judge
fails (connection refused: a killed server; 5xx; a timeout; an unreadable verdict)."""

from __future__ import annotations

import json
import shutil
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.results.verdicts import VerdictCache, cache_key, publish_judge
from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.eval.scorers import Sample, ScorerContext, ScorerInfraError
from ckpteval.jobs.eval.scorers.judge.scorer import JudgeOptions, JudgeScorer, RewardModelScorer, read_verdict
from tests.support.workers import start_judge

pytest.importorskip("openai")


@pytest.fixture(scope="module")
def exact_judge(tmp_path_factory: pytest.TempPathFactory) -> Any:
    log = tmp_path_factory.mktemp("judge") / "judge.log"
    url, proc = start_judge("exact", log, "--served-model-name", "judge-a")
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


def stats(url: str) -> dict[str, int]:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/judge_stats", timeout=10) as r:
        return json.loads(r.read())


def scorer(tmp: Path, options: dict[str, Any], cls: type = JudgeScorer, **ctx: Any) -> JudgeScorer:
    run = RunDir.create(tmp / "run")
    spec = GenerateEntry(name="qa", path="data/qa.jsonl", n_prompts=4, scorer="judge",
                       scorer_options={"retries": 0, "timeout_s": 5.0, **options})
    return cls(spec, ScorerContext(run_dir=run.path, options=ctx))


def samples(pairs: list[tuple[str, str]]) -> list[Sample]:
    return [Sample(completion=c, row={"prompt": f"what is {a}?", "answer": a}, prompt=f"what is {a}?")
            for c, a in pairs]


PAIRS = [("4", "4"), ("5", "4"), (" 7 ", "7"), ("x", "9")]
EXPECTED = [1.0, 0.0, 1.0, 0.0]  # the stand-in's exact rule: stripped response == reference


def test_verdicts_are_the_judges_and_identity_is_read_from_the_judge(tmp_path: Path, exact_judge: str) -> None:
    s = scorer(tmp_path, {"url": exact_judge})
    scored = s.score(samples(PAIRS))
    assert [x.score for x in scored] == EXPECTED
    assert all(x.counters == {"judge_cache_hits": 0, "judge_unparsed": 0, "judge_cache_errors": 0,
                              "judge_planted": 0, "judge_model_mismatch": 0} for x in scored)
    assert all(x.extras == {"judge_cache_hit_rate": 0.0} for x in scored)
    ident = s.identity()
    assert ident["model"] == "judge-a"  # from /v1/models, not from config (the dataset names no model)
    assert ident["answered_by"] == ["judge-a"]  # what each reply said answered it
    assert ident["template_sha256"] and ident["sampling"]["temperature"] == 0.0


def test_cache_pays_each_distinct_question_once(tmp_path: Path, exact_judge: str) -> None:
    """A second unit (a retry, a backfill) and identical completions are answered from RUN/judge_cache."""
    before = stats(exact_judge)["chat_completions"]
    s = scorer(tmp_path, {"url": exact_judge})
    first = s.score(samples(PAIRS + [("4", "4")]))  # the last repeats the first: not paid twice
    assert stats(exact_judge)["chat_completions"] - before == 4
    assert [x.counters["judge_cache_hits"] for x in first] == [0, 0, 0, 0, 1]
    again = scorer(tmp_path, {"url": exact_judge}).score(samples(PAIRS))  # a fresh scorer: same run dir
    assert stats(exact_judge)["chat_completions"] - before == 4
    assert [x.score for x in again] == EXPECTED and all(x.counters["judge_cache_hits"] == 1 for x in again)
    entries = sorted((tmp_path / "run" / "judge_cache").glob("*/*.json"))
    assert len(entries) == 4


def test_a_changed_template_is_a_different_judge(tmp_path: Path, exact_judge: str) -> None:
    template = "Grade this.\n<response>{response}</response>\n<reference>{reference}</reference>"
    a = scorer(tmp_path, {"url": exact_judge})
    b = scorer(tmp_path, {"url": exact_judge, "template": template})
    a.score(samples(PAIRS[:1]))
    before = stats(exact_judge)["chat_completions"]
    assert [x.score for x in b.score(samples(PAIRS[:1]))] == [1.0]
    assert stats(exact_judge)["chat_completions"] == before + 1
    assert a.identity()["template_sha256"] != b.identity()["template_sha256"]


def test_a_killed_judge_is_judge_failed(tmp_path: Path) -> None:
    """Connection refused (the server process killed with SIGKILL) is an infra skip, never a score."""
    url, proc = start_judge("exact", tmp_path / "j.log")
    s = scorer(tmp_path, {"url": url, "retries": 1})
    assert [x.score for x in s.score(samples(PAIRS[:1]))] == [1.0]
    proc.kill()
    proc.wait(timeout=30)
    with pytest.raises(ScorerInfraError) as e:
        s.score(samples(PAIRS[1:]))
    assert e.value.reason == "judge_failed" and "Connection error" in str(e.value)


@pytest.mark.parametrize(("mode", "options", "says"), [
    ("error", {}, "HTTP 500"),
    ("slow", {"timeout_s": 0.5}, "timed out"),
    ("garbage", {}, "unreadable by the verdict rule (judge_unparsed=2:"),
])
def test_each_judge_failure_is_judge_failed_with_its_message(
    tmp_path: Path, mode: str, options: dict[str, Any], says: str
) -> None:
    url, proc = start_judge(mode, tmp_path / "j.log", "--judge-delay", "5")
    try:
        with pytest.raises(ScorerInfraError) as e:
            scorer(tmp_path, {"url": url, **options}).score(samples(PAIRS[:2]))
        assert e.value.reason == "judge_failed" and says in str(e.value)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_an_unreadable_reply_is_not_cached_so_a_retry_asks_again(tmp_path: Path, exact_judge: str) -> None:
    url, proc = start_judge("garbage", tmp_path / "j.log", "--served-model-name", "judge-a")
    try:
        with pytest.raises(ScorerInfraError, match="judge_unparsed=1"):
            scorer(tmp_path, {"url": url}).score(samples(PAIRS[:1]))
    finally:
        proc.kill()
        proc.wait()
    assert not list((tmp_path / "run" / "judge_cache").glob("*/*.json"))
    before = stats(exact_judge)["chat_completions"]  # the same judge model, now answering usably
    assert [x.score for x in scorer(tmp_path, {"url": exact_judge}).score(samples(PAIRS[:1]))] == [1.0]
    assert stats(exact_judge)["chat_completions"] == before + 1


def test_unparsed_zero_scores_and_counts_instead_of_skipping(tmp_path: Path) -> None:
    url, proc = start_judge("garbage", tmp_path / "j.log")
    try:
        scored = scorer(tmp_path, {"url": url, "on_unparsed": "zero"}).score(samples(PAIRS[:2]))
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert [x.score for x in scored] == [0.0, 0.0]
    assert [x.counters["judge_unparsed"] for x in scored] == [1, 1]


def test_the_url_comes_from_the_flag_then_the_published_file(tmp_path: Path, exact_judge: str, capsys) -> None:  # noqa: ANN001
    s = scorer(tmp_path, {"wait_s": 0.2})
    with pytest.raises(ScorerInfraError, match="no judge URL"):
        s.score(samples(PAIRS[:1]))
    said = capsys.readouterr().err  # #31: the wait is said at its start, not 0% in silence for wait_s
    assert said.count("waits up to 0.2s for a judge") == 1 and "judge.json" in said and "--judge-url" in said, said
    publish_judge(RunDir(tmp_path / "run").judge_path, exact_judge, "judge-a")
    assert [x.score for x in s.score(samples(PAIRS[:1]))] == [1.0]
    flagged = scorer(tmp_path, {}, judge_url="http://127.0.0.1:9/v1")  # the worker's --judge-url wins
    with pytest.raises(ScorerInfraError, match="127.0.0.1:9"):
        flagged.score(samples(PAIRS[:1]))


def test_a_model_the_judge_does_not_serve_is_judge_failed(tmp_path: Path, exact_judge: str) -> None:
    with pytest.raises(ScorerInfraError, match=r"serves \['judge-a'\], not the model 'gpt-x'"):
        scorer(tmp_path, {"url": exact_judge, "model": "gpt-x"}).score(samples(PAIRS[:1]))


def test_reward_model_scores_what_classify_answers(tmp_path: Path, exact_judge: str) -> None:
    """sglang's /classify answers {"embedding": [reward]} per text; the stand-in's reward is len(text)/1000."""
    rows = samples([("abc", "x"), ("abcdef", "y")])
    rm = scorer(tmp_path, {"url": exact_judge, "template": "{question}|{response}"}, RewardModelScorer)
    assert [x.score for x in rm.score(rows)] == [len(f"{r.row['prompt']}|{r.completion}") / 1000 for r in rows]
    binary = scorer(tmp_path, {"url": exact_judge, "template": "{response}", "threshold": 0.005}, RewardModelScorer)
    assert [x.score for x in binary.score(rows)] == [0.0, 1.0]
    assert binary.identity()["kind"] == "reward_model" and binary.identity()["threshold"] == 0.005


@pytest.mark.parametrize(("options", "reply", "want"), [
    ({}, "reasoning... VERDICT: 0 ... no wait. VERDICT: 1", 1.0),  # the last match
    ({}, "no verdict here", None),
    ({"verdict_regex": r"Grade:\s*(\w+)", "verdict_values": {"Correct": 1, "wrong": 0}}, "Grade: CORRECT", 1.0),
    ({"verdict_regex": None, "verdict_json_field": "result.score", "structured": False},
     'ok ```json\n{"result": {"score": 0.5}}\n```', 0.5),
    ({"verdict_regex": None, "verdict_json_field": "correct"}, '{"correct": true}', 1.0),
    ({"verdict_regex": None, "verdict_json_field": "correct"}, '{"correct": "maybe"}', None),
    # structured (the default with a JSON field): the whole reply is the object, nothing around it
    ({"verdict_regex": None, "verdict_json_field": "result.score"}, 'ok ```json\n{"result": {"score": 0.5}}\n```', None),
    ({"verdict_regex": None, "verdict_json_field": "result.score"}, ' {"result": {"score": 0.5}}\n', 0.5),
])
def test_verdict_rules(options: dict[str, Any], reply: str, want: float | None) -> None:
    assert read_verdict(JudgeOptions(**options), reply) == want


def test_cache_entries_are_first_writer_wins(tmp_path: Path) -> None:
    cache = VerdictCache(tmp_path / "judge_cache")
    key = cache_key({"q": 1})
    assert cache.put(key, {"reply": "VERDICT: 1"}, {"q": 1}) is True
    assert cache.put(key, {"reply": "VERDICT: 0"}, {"q": 1}) is False
    assert cache.get(key) == {"reply": "VERDICT: 1"} and cache.get(cache_key({"q": 2})) is None


def test_what_judged_goes_into_the_wandb_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """wandb offline (read back from its own .wandb file): ingesting a judged point records the judge's
    identity, as its units recorded it, under ``eval/scorer/<ds>`` in the run's config."""
    pytest.importorskip("wandb")
    from ckpteval.coord.results.files import ok_result
    from ckpteval.coord.run.ledger import Ledger
    from ckpteval.coord.run.manifest import EvalSpec, RunManifest
    from ckpteval.coord.work.units import units_for_step
    from ckpteval.jobs.ingest import ingest_point
    from ckpteval.jobs.metrics import MetricsSink, init_wandb
    from tests.test_metrics import finished_wandb_records

    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(k, v)
    spec = GenerateEntry(name="qa", path="data/qa.jsonl", n_prompts=2, scorer="judge", shard_size=1)
    manifest = RunManifest(run_id="judged", eval=EvalSpec(entries=(spec,)), snapshot_roots=())
    ident = {"kind": "judge", "model": "judge-a", "template_sha256": "ab" * 32}
    results = {u: ok_result(u, [1.0], [f"{u.step}"], scorer=ident) for u in units_for_step(manifest, 0)}
    sink = MetricsSink(tmp_path / "metrics.jsonl", init_wandb(tmp_path, "run-judged", {"x": 1}))
    ingest_point(manifest, 0, results, sink=sink, ledger=Ledger(tmp_path / "ledger.jsonl"), lag_steps=0)
    sink.close()
    (wandb_file,) = tmp_path.glob("wandb/offline-run-*/run-run-judged.wandb")
    config = {i.key: json.loads(i.value_json) for r in finished_wandb_records(wandb_file)
              if r.WhichOneof("record_type") == "config" for i in r.config.update}
    assert config["eval/scorer/qa"] == ident


@pytest.mark.parametrize(("options", "says"), [
    ({"temprature": 0}, "temprature is not a setting of scorer 'judge' (did you mean 'temperature'?"),
    ({"template": "{question} {answer}"}, "template names ['answer']"),
    ({"template": "no response here"}, "template must contain {response}"),
    ({"verdict_regex": "VERDICT: (1"}, "verdict_regex 'VERDICT: (1' does not compile"),
    ({"verdict_regex": "VERDICT"}, "needs a group"),
    ({"on_unparsed": "ignore"}, "on_unparsed 'ignore' must be one of skip, zero"),
    ({"url": "judge:8000"}, "url 'judge:8000' must start with http"),
    ({"timeout_s": 0}, "timeout_s"),
])
def test_judge_settings_are_checked_where_run_json_is_parsed(
    tmp_path: Path, options: dict[str, Any], says: str
) -> None:
    from ckpteval.jobs.eval.worker.evalconfig import read_eval_config

    (tmp_path / "qa.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = tmp_path / "eval.json"
    cfg.write_text(json.dumps({"eval": {"datasets": [
        {"name": "qa", "path": "qa.jsonl", "n_prompts": 1, "scorer": "judge", "scorer_options": options}]}}))
    with pytest.raises(ValueError) as e:
        read_eval_config(cfg)
    assert str(e.value).startswith(str(cfg)) and says in str(e.value)


def test_a_reward_model_template_has_no_reference(tmp_path: Path) -> None:
    from ckpteval.coord.run.manifest import Fields
    from ckpteval.jobs.eval.scorers import scorer_class

    fields = Fields(tmp_path / "run.json", {"template": "{question}{response}{reference}"}, "scorer_options")
    with pytest.raises(ValueError, match=r"names \['reference'\]"):
        scorer_class("reward_model").parse_options(fields)


@pytest.mark.parametrize("name", ["judged.eval.json", "reward_model.eval.json"])
def test_example_judge_configs_are_valid(name: str) -> None:
    from ckpteval.jobs.eval.worker.evalconfig import read_eval_config

    config = read_eval_config(Path(__file__).resolve().parents[1] / "examples" / "judge" / name)
    assert [d.scorer for d in config.spec.entries] == [name.split(".")[0].replace("judged", "judge")]


def test_units_judged_by_two_judge_models_are_never_pooled(tmp_path: Path, exact_judge: str) -> None:
    """Two real judges serving different models score the two shards of one point: each unit records the
    model its judge reported, and the point logs no eval/qa for the mix (eval/qa/scorer_mixed instead)."""
    from ckpteval.coord.results.files import ok_result
    from ckpteval.coord.results.points import derive_point, point_metrics
    from ckpteval.coord.run.manifest import EvalSpec, RunManifest
    from ckpteval.coord.work.units import units_for_step

    other_url, other = start_judge("exact", tmp_path / "other.log", "--served-model-name", "judge-b")
    try:
        spec = GenerateEntry(name="qa", path="data/qa.jsonl", n_prompts=4, shard_size=2, scorer="judge")
        manifest = RunManifest(run_id="r", eval=EvalSpec(entries=(spec,)), snapshot_roots=())
        results = {}
        for unit, url, pairs in zip(units_for_step(manifest, 0), (exact_judge, other_url), (PAIRS[:2], PAIRS[2:]),
                                    strict=True):
            s = scorer(tmp_path, {"url": url})
            scored = s.score(samples(pairs))
            results[unit] = ok_result(unit, [x.score for x in scored], ["0", "0"], scorer=s.identity())
    finally:
        other.kill()
        other.wait()
    assert [r.scorer["model"] for r in results.values()] == ["judge-a", "judge-b"]
    metrics = point_metrics(derive_point(manifest, 0, results))
    assert "eval/qa" not in metrics and metrics["eval/qa/scorer_mixed"] == 1.0


def test_an_infra_skip_is_superseded_by_the_next_generation_never_overwritten(tmp_path: Path) -> None:
    from ckpteval.coord.results.files import ResultIndex, ok_result, skip_result, write_result
    from ckpteval.coord.run.manifest import LeaseSettings
    from ckpteval.coord.work.claims import UnitClaimer
    from ckpteval.coord.work.units import WorkUnit

    results = tmp_path / "results"
    results.mkdir()
    unit = WorkUnit(10, "qa", 0)
    assert write_result(results, skip_result(unit, "judge_failed", "judge at ...: Connection error."))
    claimer = UnitClaimer(tmp_path / "leases", LeaseSettings(30.0, 5.0), results_dir=results)
    (tmp_path / "leases").mkdir()
    assert claimer.try_claim(unit) is None  # generation 0 is done
    claim = claimer.try_claim(unit, generation=1)
    assert claim is not None and claim.generation == 1
    assert write_result(results, ok_result(unit, [1.0], ["10"]), generation=1)
    claim.release()
    assert not write_result(results, ok_result(unit, [0.0], ["10"]), generation=1)  # first writer won
    index = ResultIndex(results)
    assert index.refresh()[unit].ok and index.generation(unit) == 1
    assert sorted(p.name for p in results.glob("step-*/*.json")) == [unit.result_name, unit.result_name_at(1)]
    assert ResultIndex(results).refresh()[unit].scores == (1.0,)


def _boundaries(run: Path) -> list[str]:
    return sorted(json.loads(p.read_text())["answer"]["boundary"] for p in (run / "judge_cache").glob("*/*.json"))


def test_a_rejudged_sample_sends_the_same_prompt_and_another_run_a_different_one(tmp_path: Path,
                                                                                 exact_judge: str) -> None:
    """The boundary around each graded answer is derived from the run's secret and the sample (#37): a
    re-judge (its cache entry gone) quotes it identically; another run, with its own secret, differently."""
    scorer(tmp_path, {"url": exact_judge}).score(samples(PAIRS))
    first = _boundaries(tmp_path / "run")
    assert len(set(first)) == 4 and all(len(b) == 32 for b in first)
    shutil.rmtree(tmp_path / "run" / "judge_cache")
    again = JudgeScorer(scorer(tmp_path / "x", {"url": exact_judge}).spec,
                        ScorerContext(run_dir=tmp_path / "run", options={}))  # a fresh scorer of the same run
    assert [x.score for x in again.score(samples(PAIRS))] == EXPECTED
    assert _boundaries(tmp_path / "run") == first
    scorer(tmp_path / "other", {"url": exact_judge}).score(samples(PAIRS))
    assert not set(_boundaries(tmp_path / "other" / "run")) & set(first)
