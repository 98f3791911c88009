"""The ``math`` scorer: math-verify equivalences, extracted answers, and a deadline that a pathological
answer cannot get past (real spawned grading processes, a real sympy blow-up)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.results.files import ResultIndex, ok_result, write_result
from ckpteval.coord.results.points import derive_point, point_metrics
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import units_for_step
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.kinds.generate.evalsets import write_jsonl
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache, score_unit
from ckpteval.jobs.eval.scorers import Sample, ScorerContext, make_scorer
from ckpteval.jobs.eval.scorers.grader import GraderPool, grade_math

# sympy tries to evaluate a power tower this tall and never comes back
PATHOLOGICAL = r"\boxed{9^{9^{9^{9}}}}"


@pytest.mark.parametrize(
    ("completion", "gold", "key"),
    [
        ("0.5", r"\frac{1}{2}", "0.5"),
        (r"so it is $\frac{1}{2}$", "0.5", "0.5"),
        (r"Thus the answer is \boxed{42}.", "42", "42"),
        ("48 + 24 = 72.\n#### 72\n\nQuestion: Tom has 9 apples", "72", "72"),  # first '####', not last number
        ("50%", "0.5", "0.5"),
        ("The answer is 1,000.", "1000", "1000"),
    ],
)
def test_math_verify_equivalences(completion: str, gold: str, key: str) -> None:
    assert grade_math(completion, gold) == (1.0, key)


def test_math_verify_rejects_wrong_answers_and_extracts_nothing_from_prose() -> None:
    assert grade_math(r"\boxed{41}", "42") == (0.0, "41")
    assert grade_math("#### 71", "72") == (0.0, "71")
    assert grade_math("no idea", "3") == (0.0, None)


def test_math_scorer_grades_in_the_pool_from_a_non_main_thread() -> None:
    """math-verify's own timeouts need the main thread; the pool works from the worker's unit thread."""
    out: dict[str, object] = {}
    scorer = make_scorer(GenerateEntry("m", "m.jsonl", n_prompts=2, scorer="math"), ScorerContext(Path(".")))
    samples = [Sample(r"\boxed{\frac{1}{2}}", {"answer": "0.5"}, ""), Sample("7", {"answer": "8"}, "")]
    thread = threading.Thread(target=lambda: out.update(r=scorer.score(samples)))
    thread.start()
    thread.join(120)
    assert [(s.score, s.answer, s.timed_out) for s in out["r"]] == [(1.0, "0.5", False), (0.0, "7", False)]


@pytest.mark.timeout(120)
def test_a_grader_timeout_neither_hangs_nor_crashes_and_the_rest_is_still_graded() -> None:
    pool = GraderPool(processes=2, timeout_s=2.0)
    try:
        graded = pool.grade([("3", PATHOLOGICAL), (r"\boxed{3}", "3"), ("5", "5"), ("6", PATHOLOGICAL), ("1", "2")])
        assert [g.timed_out for g in graded] == [True, False, False, True, False]
        assert [g.score for g in graded] == [0.0, 1.0, 1.0, 0.0, 0.0]
        assert pool.timeouts == 2
        assert pool.grade([("4", "4")])[0].score == 1.0  # a fresh pool after the kills
    finally:
        pool.close()


@pytest.mark.timeout(240)
def test_grader_timeouts_are_counted_in_the_result_and_the_point(tmp_path: Path, tiny_snapshot: Path) -> None:
    """A unit whose gold answers blow up the grader still finishes: 0 for those, and the count is a metric."""
    spec = GenerateEntry("mathy", "data/mathy.jsonl", n_prompts=3, shard_size=3, scorer="math", max_new_tokens=3,
                       grader_timeout_s=2.0)
    manifest = RunManifest(run_id="g", eval=EvalSpec(entries=(spec,)), snapshot_roots=(str(tmp_path / "snaps"),),
                           lease=LeaseSettings(30.0, 5.0))
    run = RunDir.create(tmp_path / "run", manifest)
    # prompts the tiny untrained model answers with digits ("966", "584"), so the grader must compare them
    write_jsonl(run.data / "mathy.jsonl", [{"prompt": "83+48=", "answer": PATHOLOGICAL},
                                           {"prompt": "01+01=", "answer": "2"},
                                           {"prompt": "62+03=", "answer": PATHOLOGICAL}])
    engine = HFEngine()
    engine.load(str(tiny_snapshot), "4")
    try:
        (unit,) = units_for_step(manifest, 4)
        scored = score_unit(engine, DatasetCache(run, manifest), unit, str(tiny_snapshot))
    finally:
        engine.close()
    assert any(c.isdigit() for c in scored.completions[0] + scored.completions[2]), scored.completions
    assert scored.tally.grader_timeouts == 2 and scored.scores[0] == scored.scores[2] == 0.0
    write_result(run.results, ok_result(unit, scored.scores, scored.weight_versions, scored.answers,
                                        **scored.result_fields()))
    metrics = point_metrics(derive_point(manifest, 4, ResultIndex(run.results).refresh()))
    assert metrics["eval/mathy/grader_timeouts"] == 2
