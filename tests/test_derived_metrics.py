"""Metrics derived from per-sample results: pass@k, maj@n, stderr, grader timeouts, cadence, old results.

All on real result files in a real run dir (coord only: no engine needed to derive a point).
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.results.files import ResultIndex, ok_result, write_result
from ckpteval.coord.results.points import derive_point, majority_score, pass_at_k, point_metrics
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest, parse_manifest
from ckpteval.coord.run.rundir import RunDir, unit_dir
from ckpteval.coord.work.units import shard_range, units_for_step


def brute_pass_at_k(correct: list[bool], k: int) -> float:
    """The fraction of k-subsets of the samples holding at least one correct sample."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_brute_force_enumeration_of_subsets() -> None:
    rng = random.Random(0)
    for n in range(1, 8):
        for c in range(n + 1):
            correct = [True] * c + [False] * (n - c)
            rng.shuffle(correct)
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(correct, k), abs=1e-12), (n, c, k)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_maj_at_n_ties_go_to_the_answer_seen_first_and_none_does_not_vote() -> None:
    assert majority_score(["7", "8", "8", "7"], [1, 0, 0, 1]) == 1.0  # 2-2 tie: "7" appeared first
    assert majority_score(["8", "7", "7", "8"], [0, 1, 1, 0]) == 0.0  # 2-2 tie: "8" appeared first
    assert majority_score([None, None, "8", "7", "7"], [1, 1, 0, 1, 1]) == 1.0  # "7" wins 2-1; None abstains
    assert majority_score([None, None], [1, 1]) == 0.0  # nobody voted
    assert majority_score(["7", "7", "8"], [0.0, 1.0, 1.0]) == 0.0  # the majority scores its first sample


def _run(tmp: Path, *specs: GenerateEntry) -> tuple[RunDir, RunManifest]:
    manifest = RunManifest(
        run_id="metrics", eval=EvalSpec(entries=specs), snapshot_roots=(str(tmp / "run" / "snapshots"),),
        lease=LeaseSettings(30.0, 5.0),
    )
    return RunDir.create(tmp / "run", manifest), manifest


def _fill(run: RunDir, manifest: RunManifest, step: int, scores: list[float], answers: list[str | None] | None,
          timeouts: int = 0) -> None:
    """Results for every unit of ``step`` of the first dataset, cut from prompt-major per-sample lists."""
    spec = manifest.eval.entries[0]
    for unit in units_for_step(manifest, step):
        rows = shard_range(manifest, unit)
        lo, hi = rows.start * spec.n_samples, rows.stop * spec.n_samples
        write_result(run.results, ok_result(
            unit, scores[lo:hi], [str(step)] * (hi - lo), None if answers is None else answers[lo:hi],
            grader_timeouts=timeouts if unit.shard == 0 else 0,
        ))


def _metrics(run: RunDir, manifest: RunManifest, step: int) -> dict[str, float]:
    return point_metrics(derive_point(manifest, step, ResultIndex(run.results).refresh()))


def _samples(n_prompts: int, n: int, seed: int) -> tuple[list[float], list[str]]:
    rng = random.Random(seed)
    answers = [rng.choice("1234") for _ in range(n_prompts * n)]
    return [float(a == "1") for a in answers], answers


def test_point_metrics_pass_at_k_maj_and_stderr_from_per_sample_results(tmp_path: Path) -> None:
    spec = GenerateEntry("gsm", "data/gsm.jsonl", n_prompts=6, shard_size=4, n_samples=4, temperature=1.0,
                       pass_k=(1, 2, 4))
    run, manifest = _run(tmp_path, spec)
    scores, answers = _samples(6, 4, seed=1)
    _fill(run, manifest, 10, scores, answers, timeouts=2)
    m = _metrics(run, manifest, 10)
    prompts = [scores[i : i + 4] for i in range(0, 24, 4)]
    for k in (1, 2, 4):
        want = sum(brute_pass_at_k([s == 1.0 for s in p], k) for p in prompts) / 6
        assert m[f"eval/gsm/pass@{k}"] == pytest.approx(want)
    assert m["eval/gsm"] == pytest.approx(sum(scores) / 24)
    assert m["eval/gsm/pass@1"] == pytest.approx(m["eval/gsm"])  # pass@1 is the mean for 0/1 scores
    votes = [majority_score(answers[i : i + 4], scores[i : i + 4]) for i in range(0, 24, 4)]
    assert m["eval/gsm/maj@4"] == pytest.approx(sum(votes) / 6)
    means = [sum(p) / 4 for p in prompts]
    mu = sum(means) / 6
    assert m["eval/gsm/stderr"] == pytest.approx(math.sqrt(sum((x - mu) ** 2 for x in means) / 5 / 6))
    assert m["eval/gsm/grader_timeouts"] == 2


@pytest.mark.parametrize("shard_size", [1, 2, 5])
def test_sharding_leaves_every_metric_unchanged(tmp_path: Path, shard_size: int) -> None:
    spec = GenerateEntry("gsm", "data/gsm.jsonl", n_prompts=10, shard_size=10, n_samples=3, temperature=1.0,
                       pass_k=(1, 3))
    scores, answers = _samples(10, 3, seed=2)
    run, manifest = _run(tmp_path / "one", spec)
    _fill(run, manifest, 5, scores, answers)
    sharded_run, sharded = _run(tmp_path / "many", replace(spec, shard_size=shard_size))
    _fill(sharded_run, sharded, 5, scores, answers)
    assert len(units_for_step(sharded, 5)) == -(-10 // shard_size)
    assert _metrics(sharded_run, sharded, 5) == _metrics(run, manifest, 5)


def test_old_results_without_extracted_answers_derive_the_same_points(tmp_path: Path) -> None:
    """A result file as written before answers/grader_timeouts existed parses and derives the same point."""
    spec = GenerateEntry("add", "data/add.jsonl", n_prompts=4, shard_size=2, n_samples=2, temperature=1.0,
                       pass_k=(2,))
    run, manifest = _run(tmp_path, spec)
    scores, answers = _samples(4, 2, seed=3)
    new_run, _ = _run(tmp_path / "new", spec)
    _fill(new_run, manifest, 7, scores, answers)
    for unit in units_for_step(manifest, 7):  # the old writer's exact field set
        lo, hi = unit.shard * 4, unit.shard * 4 + 4
        old = {"protocol": 1, "unit": unit.to_json(), "status": "ok", "n": 4, "score_sum": sum(scores[lo:hi]),
               "scores": scores[lo:hi], "weight_versions": ["7"] * 4, "skip_reason": None, "message": "",
               "timings": {}, "worker": {"host": "h", "pid": 1}, "lease_token": "t", "attempt": 1,
               "snapshot": "/s", "written_at": 1.0}
        unit_dir(run.results, unit.step).mkdir(exist_ok=True)
        (unit_dir(run.results, unit.step) / unit.result_name).write_text(json.dumps(old))
    old_metrics, new_metrics = _metrics(run, manifest, 7), _metrics(new_run, manifest, 7)
    assert "eval/add/maj@2" not in old_metrics  # nothing to vote on: not invented
    assert {k: v for k, v in new_metrics.items() if k != "eval/add/maj@2"} == old_metrics
    for key in ("eval/add", "eval/add/weight_version/mean", "eval/add/weight_version/mixed_version_ratio"):
        assert old_metrics[key] == pytest.approx(new_metrics[key])
    assert old_metrics["eval/add/grader_timeouts"] == 0


def test_cadence_a_dataset_every_second_point_has_units_exactly_there(tmp_path: Path) -> None:
    cheap = GenerateEntry("cheap", "data/cheap.jsonl", n_prompts=2, shard_size=2)
    heavy = GenerateEntry("heavy", "data/heavy.jsonl", n_prompts=4, shard_size=2, every=20)
    run, manifest = _run(tmp_path, cheap, heavy)
    for step in (0, 10, 20, 30, 40):
        datasets = {u.dataset for u in units_for_step(manifest, step)}
        assert datasets == ({"cheap", "heavy"} if step % 20 == 0 else {"cheap"}), step
        for unit in units_for_step(manifest, step):
            n = len(shard_range(manifest, unit))
            write_result(run.results, ok_result(unit, [1.0] * n, [str(step)] * n, ["1"] * n))
    results = ResultIndex(run.results).refresh()
    for step in (10, 20, 30):
        point = derive_point(manifest, step, results)
        assert point.complete and set(point.datasets) == ({"cheap", "heavy"} if step == 20 else {"cheap"})
        assert ("eval/heavy" in point_metrics(point)) == (step == 20)


def test_manifest_validates_the_new_dataset_fields(tmp_path: Path) -> None:
    base = {"run_id": "r", "snapshot_roots": ["/abs"],
            "eval": {"datasets": [{"name": "d", "path": "d.jsonl", "n_prompts": 2}]}}

    def parse(**fields: object) -> RunManifest:
        obj = json.loads(json.dumps(base))
        obj["eval"]["datasets"][0].update(fields)
        return parse_manifest(obj, tmp_path / "run.json")

    ds = parse(n_samples=4, pass_k=[1, 4], every=3, prompt_format="chat", system_prompt="be brief").eval.entries[0]
    assert (ds.pass_k, ds.every, ds.prompt_format, ds.system_prompt) == ((1, 4), 3, "chat", "be brief")
    assert parse().eval.entries[0].prompt_format == "raw"  # old manifests: today's behaviour
    assert parse(generate_timeout_s=60).eval.entries[0].generate_timeout_s == 60.0
    assert parse().to_json()["eval"]["datasets"][0]["generate_timeout_s"] is None  # unset: written as null
    assert parse_manifest(parse().to_json(), tmp_path / "run.json") == parse()  # and read back the same
    for bad, match in [({"pass_k": [2]}, "pass_k has k=2"), ({"n_samples": 2, "pass_k": [1, 1]}, "twice"),
                       ({"every": 0}, "every must be >= 1"), ({"prompt_format": "xml"}, "prompt_format"),
                       ({"system_prompt": "x"}, "needs prompt_format 'chat'"),
                       ({"grader_timeout_s": 0}, "grader_timeout_s"), ({"pass_k": ["1"]}, r"pass_k\[0\]"),
                       ({"generate_timeout_s": 0}, r"datasets\[0\]\.generate_timeout_s must be a finite number"),
                       ({"generate_timeout_s": "60"}, "generate_timeout_s")]:
        with pytest.raises(ValueError, match=match):
            parse(**bad)
