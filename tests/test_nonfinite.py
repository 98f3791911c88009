"""No NaN or Infinity in any JSON ckpteval writes, and no score a scorer can forge by overflowing (#26 §4).

Real parts: real scorer modules imported by name, real result files, a real ingestion writing a real step
summary, ``status --json`` as the CLI prints it. Every JSON file read here is parsed strictly (a bare
``NaN``/``Infinity`` fails the test).
"""

from __future__ import annotations

import io
import json
import math
import re
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from ckpteval.coord.atomic import dumps, tag_nonfinite, untag_nonfinite, write_json_atomic
from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.results.files import ResultIndex, ok_result, parse_result, write_result
from ckpteval.coord.results.summary import read_step_facts
from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.run.rundir import STEP_SUMMARY, step_dir_name
from ckpteval.coord.work.units import units_for_step
from ckpteval.jobs.eval.engines.fn import parse_output
from ckpteval.jobs.eval.kinds.lm_eval import flatten_metrics
from ckpteval.jobs.eval.scorers import (
    Sample,
    Scored,
    ScorerContext,
    ScorerCrashed,
    make_scorer,
    score_samples,
)
from ckpteval.jobs.ingest import ingest_point
from ckpteval.jobs.metrics import MetricsSink
from ckpteval.jobs.views.status.main import collect_status, show
from tests.support.runs import make_run

HOSTILE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "1e308": 1e308, "-1e16": -1e16}


def hostile(completion: str, answer: str) -> float:
    """A user scorer (``tests.test_nonfinite:hostile``) returning what the completion names."""
    return HOSTILE.get(completion, float(completion))


def strict(text: str | bytes) -> Any:
    def refuse(name: str) -> None:
        raise AssertionError(f"a bare {name} in JSON")
    return json.loads(text, parse_constant=refuse)


def _samples(completions: list[str]) -> list[Sample]:
    return [Sample(completion=c, row={"prompt": "p", "answer": "1"}, prompt="p") for c in completions]


@pytest.mark.parametrize("value", list(HOSTILE))
def test_a_user_scorer_returning_a_non_finite_or_huge_score_is_its_units_crashed_skip(tmp_path: Path, value: str) -> None:
    """nan, ±inf, 1e308 (whose sum overflows to inf) and -1e16 (beyond ±1e15): the unit's ``crashed`` skip,
    naming the scorer and the sample, never a score; honest scores beside them (0.5, the bound) are kept."""
    spec = GenerateEntry(name="d", path="data/d.jsonl", n_prompts=3, scorer="tests.test_nonfinite:hostile")
    scorer = make_scorer(spec, ScorerContext(run_dir=tmp_path))
    assert [s.score for s in score_samples(scorer, _samples(["0.5", "1e15", "-1e15"]))] == [0.5, 1e15, -1e15]
    with pytest.raises(ScorerCrashed, match=r"scorer 'tests.test_nonfinite:hostile' (raised|returned).*"
                                            r"(finite number|sample 1)") as e:
        score_samples(scorer, _samples(["0.5", value]))
    assert e.value.reason == "crashed" and e.value.blame == "scorer"


class _PluginScorer:
    """A scorer class (the Scorer protocol) whose per-sample numbers are set by the test."""

    def __init__(self, scored: Scored) -> None:
        self.scored = scored

    def score(self, samples: list[Sample]) -> list[Scored]:
        return [self.scored for _ in samples]


@pytest.mark.parametrize(("scored", "says"), [
    (Scored(math.nan, None), "returned score nan for sample 0"),
    (Scored(1.0, None, extras={"len": math.inf}), "returned extra 'len' inf"),
    (Scored(1.0, None, extras={"len": 1e300}), "returned extra 'len' 1e+300"),
    (Scored(1.0, None, counters={"hits": 1.5}), "returned counter 'hits' = 1.5"),  # type: ignore[dict-item]
])
def test_a_scorer_class_cannot_put_a_non_finite_number_in_a_score_extra_or_counter(scored: Scored, says: str) -> None:
    with pytest.raises(ScorerCrashed, match=re.escape(f"scorer '_PluginScorer' {says}")):
        score_samples(_PluginScorer(scored), _samples(["x"]))  # type: ignore[arg-type]


def test_backends_and_lm_eval_metrics_carry_no_non_finite_number() -> None:
    with pytest.raises(ValueError, match=r"finite numbers within ±1e\+15"):
        parse_output({"scores": [1e308]}, 1, "v")
    assert parse_output({"scores": [1e15]}, 1, "v").scores == [1e15]
    assert flatten_metrics({"acc,none": 0.5, "acc_stderr,none": math.nan, "ppl,none": math.inf}) == {"acc": 0.5}


def test_protocol_json_refuses_nan_and_infinity_and_writes_nothing(tmp_path: Path) -> None:
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match="not JSON compliant"):
            dumps({"x": [1.0, bad]})
        with pytest.raises(ValueError, match=f"{tmp_path / 'f.json'}: not written"):
            write_json_atomic(tmp_path / "f.json", {"x": bad})
        with pytest.raises(ValueError, match="not JSON compliant"):
            Ledger(tmp_path / "ledger.jsonl").append("dispatched", 1, wait=bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no file, no temp left, no ledger line
    nested = {"a": [math.nan, {"b": -math.inf}], "c": (math.inf, 1.5), "d": {"nonfinite": "x"}}
    tagged = tag_nonfinite(nested)
    back = untag_nonfinite(strict(dumps(tagged)))
    assert math.isnan(back["a"][0]) and back["a"][1] == {"b": -math.inf} and back["c"] == [math.inf, 1.5]
    assert back["d"] == {"nonfinite": "x"}  # not a tag: left as it is


def test_a_canary_over_other_token_ids_is_written_null_and_read_back_infinite(tmp_path: Path) -> None:
    run = make_run(tmp_path, n_prompts=1, shard_size=1)
    unit = units_for_step(run.manifest(), 10)[0]
    write_result(run.results, ok_result(unit, [1.0], ["10"], fidelity={"max_abs_logprob_diff": math.inf, "tokens": 0.0}))
    path = run.results / step_dir_name(10) / unit.result_name_at(0)
    assert strict(path.read_text())["fidelity"] == {"max_abs_logprob_diff": None, "tokens": 0.0}
    assert parse_result(json.loads(path.read_text()), path).fidelity == {"max_abs_logprob_diff": math.inf, "tokens": 0.0}


def test_a_step_summary_with_no_variance_is_strict_json_and_status_json_parses_strictly(tmp_path: Path) -> None:
    """One prompt per dataset: the stderr is NaN, no attestation (NaN), a canary over other token ids (inf).
    The summary holds none of them bare, reads back to the same facts as the results, and ``status --json``
    (from the summary) parses with a strict parser."""
    run = make_run(tmp_path, n_prompts=1, shard_size=1)
    manifest = run.manifest()
    ledger, sink, index = Ledger(run.ledger_path), MetricsSink(run.metrics_path), ResultIndex(run.results)
    ledger.append("dispatched", 10)
    for unit in units_for_step(manifest, 10):
        fidelity = {"max_abs_logprob_diff": math.inf, "argmax_agreement": 0.0, "tokens": 0.0, "flagged": 1.0}
        write_result(run.results, ok_result(unit, [0.5], ["10"], fidelity=fidelity))
    index.refresh(only_steps={10})
    assert ingest_point(manifest, 10, index.for_step(10), sink=sink, ledger=ledger, lag_steps=5, index=index)
    summary = run.results / step_dir_name(10) / STEP_SUMMARY
    facts = strict(summary.read_text())["facts"]
    assert facts["point"]["datasets"]["add"]["stderr"] == {"nonfinite": "nan"}
    assert facts["point"]["fidelity"]["max_abs_logprob_diff"] == {"nonfinite": "inf"}
    from_summary = read_step_facts(run.results, manifest)[0][10]
    assert math.isnan(from_summary.point["datasets"]["add"]["stderr"])
    assert from_summary.point["fidelity"]["max_abs_logprob_diff"] == math.inf
    out = io.StringIO()
    with redirect_stdout(out):
        show(None, [collect_status(run.path)], True)
    point = strict(out.getvalue())["points"][0]
    assert point["datasets"]["add"]["score"] == 0.5 and point["datasets"]["add"]["stderr"] is None
    summary.unlink()
    from_results = read_step_facts(run.results, manifest)[0][10]
    assert json.dumps(tag_nonfinite(from_results.point)) == json.dumps(tag_nonfinite(from_summary.point))
    for line in run.metrics_path.read_text().splitlines():
        strict(line)
