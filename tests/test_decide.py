"""Decisions from points (ckpteval.jobs.decide): paired intervals, the best step, ``ckpteval compare`` / ``best``.

The statistics are checked against simulations where the truth is known (fixed seeds): the paired
interval covers the true difference at its nominal rate, and the best step's "not distinguishable"
set keeps every truly-best step at the family level. The commands run on real run dirs with results
files written as workers write them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ckpteval.coord.results.files import ok_result, write_result
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import shard_range, units_for_step
from ckpteval.jobs.decide.stats import best_step, paired_interval, t_quantile
from tests.support.runs import make_run
from tests.support.workers import finish, spawn


def test_t_quantile_matches_tables() -> None:
    for df, want in ((5, 2.570582), (10, 2.228139), (30, 2.042272), (200, 1.971896)):
        assert t_quantile(0.975, df) == pytest.approx(want, abs=2e-3)


def _paired_draw(rng: np.random.Generator, n_prompts: int, n_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-prompt means of two steps on prompts drawn from a population: step B's success probability is
    step A's plus d_i ~ U(-0.05, 0.15), so the true mean difference is exactly 0.05."""
    p = rng.uniform(0.1, 0.8, n_prompts)
    q = p + rng.uniform(-0.05, 0.15, n_prompts)
    return rng.binomial(n_samples, p) / n_samples, rng.binomial(n_samples, q) / n_samples


@pytest.mark.parametrize("level", [0.9, 0.95])
def test_paired_interval_covers_the_true_difference_at_its_nominal_rate(level: float) -> None:
    rng = np.random.default_rng(21)
    reps = 4000
    hits = 0
    for _ in range(reps):
        iv = paired_interval(*_paired_draw(rng, 150, 4), level=level)
        hits += iv.low <= 0.05 <= iv.high
    assert abs(hits / reps - level) < 0.015, f"coverage {hits / reps:.3f} at nominal {level}"


def test_paired_interval_is_narrower_than_unpaired_and_says_noise() -> None:
    rng = np.random.default_rng(3)
    a, b = _paired_draw(rng, 300, 4)
    iv = paired_interval(a, b)
    unpaired_half = 1.96 * np.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
    assert iv.high - iv.low < 2 * unpaired_half  # pairing removes the prompt-difficulty variance
    same = paired_interval(a, a + rng.normal(0, 0.01, a.size))
    assert not same.distinguishable


def test_best_set_keeps_every_truly_best_step_at_the_family_level() -> None:
    """Five steps, steps 3 and 4 equally best: both stay in the set in >= 95% of replicates (Bonferroni)."""
    rng = np.random.default_rng(5)
    shift = {0: -0.15, 1: -0.08, 2: -0.04, 3: 0.0, 4: 0.0}
    reps, kept, found_best = 600, 0, 0
    for _ in range(reps):
        p = rng.uniform(0.2, 0.7, 120)
        values = {s: rng.binomial(4, np.clip(p + d, 0, 1)) / 4 for s, d in shift.items()}
        best = best_step(values)
        kept += {3, 4} <= set(best.tied)
        found_best += best.step in (3, 4)
    assert kept / reps >= 0.94 and found_best / reps > 0.8


def _write_step(run: RunDir, step: int, per_prompt: np.ndarray) -> None:
    """Results of every unit of ``step``, prompt ``i`` scoring ``per_prompt[i]`` (one sample per prompt)."""
    manifest = run.manifest()
    for unit in units_for_step(manifest, step):
        idx = list(shard_range(manifest, unit))
        write_result(run.results, ok_result(unit, [float(per_prompt[i]) for i in idx], [str(step)] * len(idx)))


@pytest.fixture
def decided_run(tmp_path: Path) -> RunDir:
    """Steps 100 (p=0.3), 200 and 300 (both p=0.8, 300 = 200 with two prompts flipped), 40 prompts."""
    run = make_run(tmp_path / "a", n_prompts=40, shard_size=10)
    rng = np.random.default_rng(7)
    _write_step(run, 100, (rng.random(40) < 0.3).astype(float))
    s200 = (rng.random(40) < 0.8).astype(float)
    _write_step(run, 200, s200)
    s300 = s200.copy()
    s300[[0, 1]] = 1 - s300[[0, 1]]
    _write_step(run, 300, s300)
    return run


def test_compare_two_steps_says_better_and_noise(decided_run: RunDir) -> None:
    code, out = finish(spawn("compare", str(decided_run.path), "--steps", "100", "200", "--json"), 60)
    assert code == 0, out
    (row,) = json.loads(out.strip().splitlines()[-1])["datasets"]
    assert row["verdict"] == "B better" and row["low"] > 0 and row["n_prompts"] == 40
    code, out = finish(spawn("compare", str(decided_run.path), "--steps", "200", "300"), 60)
    assert code == 0 and "not distinguishable from noise" in out and "paired t interval" in out, out


def test_compare_two_runs_pairs_prompt_by_prompt(decided_run: RunDir, tmp_path: Path) -> None:
    other = make_run(tmp_path / "b", n_prompts=40, shard_size=10)
    _write_step(other, 200, np.zeros(40))
    code, out = finish(spawn("compare", str(decided_run.path), str(other.path), "--json"), 60)
    assert code == 0, out
    rec = json.loads(out.strip().splitlines()[-1])
    assert rec["a"].endswith("step 200") and rec["datasets"][0]["verdict"] == "A better"


def test_best_writes_best_json_with_the_indistinguishable_steps(decided_run: RunDir) -> None:
    code, out = finish(spawn("best", str(decided_run.path), "--metric", "eval/add"), 60)
    assert code == 0, out
    rec = json.loads(decided_run.best_path("eval/add").read_text())
    assert rec["best_step"] in (200, 300) and rec["not_distinguishable"] == [200, 300]
    assert "Bonferroni" in rec["correction"] and rec["steps"]["100"]["diff_to_best"]["high"] < 0
    assert f"highest mean (no single winner) by eval/add (higher is better): {rec['best_step']}" in out
    code, out = finish(spawn("best", str(decided_run.path), "--metric", "eval/add", "--lower-is-better", "--json"), 60)
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["best_step"] == 100


def test_a_decision_by_one_metric_never_overwrites_another_metrics(decided_run: RunDir) -> None:
    """#31: ``best`` writes one file per metric (before: one ``RUN/best.json`` whatever the metric)."""
    other = decided_run.best_path("eval/add/pass@4")
    assert other != decided_run.best_path("eval/add") and other.name == "eval__add__pass@4.json"
    other.parent.mkdir()
    other.write_text('{"metric": "eval/add/pass@4", "best_step": 100}')
    code, out = finish(spawn("best", str(decided_run.path), "--metric", "eval/add"), 60)
    assert code == 0, out
    assert json.loads(other.read_text())["best_step"] == 100  # untouched
    assert json.loads(decided_run.best_path("eval/add").read_text())["metric"] == "eval/add"


@pytest.mark.parametrize("argv, says", [
    (["compare", "{run}", "--steps", "100", "999"], "no dataset has a complete point at step 100"),
    (["compare", "{run}"], "give --steps A B"),
    (["best", "{run}", "--metric", "eval/nope"], "no dataset 'nope'"),
    (["best", "{run}", "--metric", "eval/add/pass@3"], "is not logged for add"),
    (["best", "{run}", "--metric", "eval/add/pass^1"], "pass^1 is pass@1"),
    (["compare", "{run}", "--steps", "100", "200", "--metric", "eval/add/pass^x"], "'pass^x' is not logged for add"),
    (["best", "{missing}", "--metric", "eval/add"], "no run.json"),
])
def test_bad_input_is_one_line(decided_run: RunDir, tmp_path: Path, argv: list[str], says: str) -> None:
    args = [a.format(run=decided_run.path, missing=tmp_path / "nope") for a in argv]
    code, out = finish(spawn(*args), 60)
    assert code == 2 and says in out and "Traceback" not in out and len(out.strip().splitlines()) == 1, out


def test_best_writes_the_wandb_summary(decided_run: RunDir) -> None:
    """wandb offline (``WANDB_MODE=offline``), read back from wandb's own ``.wandb`` file."""
    import os

    from tests.test_metrics import wandb_records

    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    code, out = finish(spawn("best", str(decided_run.path), "--metric", "eval/add", "--wandb-run-id", "train-7",
                             env=env), 120)
    assert code == 0, out
    (wandb_file,) = decided_run.path.glob("wandb/offline-run-*/run-train-7.wandb")
    summary = {i.key: json.loads(i.value_json) for r in wandb_records(wandb_file)
               if r.WhichOneof("record_type") == "summary" for i in r.summary.update}
    rec = json.loads(decided_run.best_path("eval/add").read_text())
    assert summary["best/step"] == rec["best_step"] and summary["best/not_distinguishable"] == [200, 300]
    assert summary["best/metric"] == "eval/add"


def test_intervals_of_scores_stay_in_range_and_zero_spread_is_not_certainty() -> None:
    """Scores in [0, 1]: a mean near 1 is not given an upper end above 1; four prompts that all improved by
    exactly 1 do not make a zero-width interval (a fifth prompt could differ).
    Before: width 0 and intervals past the score's range."""
    from ckpteval.jobs.decide.stats import mean_interval

    near_one = np.array([1.0] * 9 + [0.0])
    iv = paired_interval(np.zeros(10), near_one)
    assert -1.0 <= iv.low and iv.high <= 1.0
    own = best_step({1: near_one}).interval
    assert 0.0 <= own.low and own.high == 1.0  # clipped, not 1.2
    same = paired_interval(np.zeros(10), np.ones(10))
    assert same.high - same.low > 0.2 and same.high == 1.0 and same.distinguishable  # wide, still B better
    assert not paired_interval(np.zeros(4), np.ones(4)).distinguishable  # 4 of 4 is 1/16 under a coin: noise
    flat = paired_interval(np.full(4, 0.5), np.full(4, 0.5))
    assert flat.low < 0 < flat.high  # no difference seen: noise, with a width
    unbounded = mean_interval(np.array([3.0, 3.0, 3.0]))  # a reward model's scores: no range to assume
    assert unbounded.low == unbounded.high == 3.0


def test_compare_metric_is_the_metric_compared(decided_run: RunDir) -> None:
    code, out = finish(spawn("compare", str(decided_run.path), "--steps", "100", "200", "--metric", "eval/add",
                             "--json"), 60)
    assert code == 0, out
    (row,) = json.loads(out.strip().splitlines()[-1])["datasets"]
    assert row["dataset"] == "eval/add"
    code, out = finish(spawn("compare", str(decided_run.path), "--steps", "100", "200", "--metric", "eval/nope"), 60)
    assert code == 2 and "no dataset 'nope'" in out, out  # before: --metric was ignored, any name accepted


def test_best_defaults_to_the_first_datasets_mean(decided_run: RunDir) -> None:
    code, out = finish(spawn("best", str(decided_run.path)), 60)
    assert code == 0 and "by eval/add" in out, out


def _too_wide(out: str) -> list[str]:
    """Lines over 80 columns that are not one unbreakable word (a path)."""
    return [line for line in out.splitlines() if len(line) > 80 and len(line.split()) > 1]


def test_compare_and_best_fit_80_columns_and_use_the_width_they_have(decided_run: RunDir) -> None:
    """#31: ``compare`` rows were 107 wide whatever ``COLUMNS``; at 80 each dataset takes two lines."""
    code, out = finish(spawn("compare", str(decided_run.path), "--steps", "200", "300", env={"COLUMNS": "80"}), 60)
    assert code == 0 and not _too_wide(out) and "over 40 prompts: not distinguishable from noise" in out, out
    code, wide = finish(spawn("compare", str(decided_run.path), "--steps", "200", "300", env={"COLUMNS": "160"}), 60)
    assert code == 0 and any(len(line) > 80 and line.endswith("not distinguishable from noise")
                             for line in wide.splitlines()), wide  # one row per dataset when it fits
    code, out = finish(spawn("best", str(decided_run.path), env={"COLUMNS": "80"}), 60)
    rec = json.loads(decided_run.best_path("eval/add").read_text())
    assert code == 0 and not _too_wide(out) and f"by eval/add (higher is better): {rec['best_step']}" in out, out


# -- pass^k: all k samples right ----------------------------------------------------------------------
@pytest.fixture
def sampled_run(tmp_path: Path) -> RunDir:
    """40 prompts x 4 samples: step 100 gets 2 of 4 right on every prompt (pass@2 5/6, pass^2 1/6); step 200
    all 4 on the first 20 prompts and none on the rest (pass@2 = pass^2 = 1/2): pass^2 and pass@2 disagree."""
    from ckpteval.coord.entries.generate import GenerateEntry
    from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest

    spec = GenerateEntry(name="add", path="data/add.jsonl", n_prompts=40, shard_size=10, n_samples=4,
                       temperature=1.0, pass_k=(1, 2, 4))
    run = RunDir.create(tmp_path / "run", RunManifest(run_id="sampled", eval=EvalSpec(entries=(spec,)),
                                                      snapshot_roots=(str(tmp_path / "snaps"),),
                                                      lease=LeaseSettings(30.0, 5.0)))
    per_prompt = {100: [[1.0, 0.0, 1.0, 0.0]] * 40, 200: [[1.0] * 4] * 20 + [[0.0] * 4] * 20}
    for step, samples in per_prompt.items():
        for unit in units_for_step(run.manifest(), step):
            scores = [x for i in shard_range(run.manifest(), unit) for x in samples[i]]
            write_result(run.results, ok_result(unit, scores, [str(step)] * len(scores)))
    return run


def test_pass_hat_k_per_prompt_values_are_the_points_own(sampled_run: RunDir) -> None:
    """``eval/<ds>/pass^k``'s per-prompt values are C(c, k) / C(n, k) (coord.points.pass_hat_k), their mean
    the logged point; pass@k's stay pass@k's."""
    from ckpteval.coord.results.points import derive_point
    from ckpteval.jobs.decide.data import RunValues, parse_metric

    values, manifest = RunValues(sampled_run), sampled_run.manifest()
    hat, at = parse_metric("eval/add/pass^2", manifest), parse_metric("eval/add/pass@2", manifest)
    assert hat.name == "eval/add/pass^2" and at.name == "eval/add/pass@2"
    assert values.values(100, hat) == pytest.approx([1 / 6] * 40) and values.values(100, at) == pytest.approx([5 / 6] * 40)
    assert values.values(200, hat).tolist() == [1.0] * 20 + [0.0] * 20
    for step in (100, 200):
        logged = derive_point(manifest, step, values.results).datasets["add"].derived["pass^2"]
        assert values.values(step, hat).mean() == pytest.approx(logged)


def test_compare_and_best_decide_by_pass_hat_k(sampled_run: RunDir) -> None:
    code, out = finish(spawn("compare", str(sampled_run.path), "--steps", "100", "200", "--metric", "eval/add/pass^2",
                             "--json"), 60)
    assert code == 0, out
    (row,) = json.loads(out.strip().splitlines()[-1])["datasets"]
    assert row["dataset"] == "eval/add/pass^2" and row["verdict"] == "B better"  # by pass@2, A is better
    assert (row["a"], row["b"], row["diff"]) == pytest.approx((1 / 6, 1 / 2, 1 / 3))
    code, out = finish(spawn("best", str(sampled_run.path), "--metric", "eval/add/pass^2"), 60)
    assert code == 0 and "by eval/add/pass^2" in out, out
    rec = json.loads(sampled_run.best_path("eval/add/pass^2").read_text())
    assert rec["metric"] == "eval/add/pass^2" and rec["best_step"] == 200


def test_per_prompt_pass_counts_a_sample_passed_from_the_entrys_pass_threshold(tmp_path: Path) -> None:
    """An env entry with ``pass_threshold`` 0.5: the per-prompt pass@k / pass^k that compare and best pair are
    the logged point's (a reward of 0.5 passes), not a full-credit count."""
    from ckpteval.coord.entries.env import EnvEntry
    from ckpteval.coord.results.points import derive_point
    from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest
    from ckpteval.jobs.decide.data import RunValues, parse_metric

    spec = EnvEntry(name="g", path="data/g.jsonl", n_prompts=2, shard_size=2, n_samples=2, temperature=1.0,
                   env="guess", pass_k=(1, 2), pass_threshold=0.5)
    run = RunDir.create(tmp_path / "run", RunManifest(run_id="env", eval=EvalSpec(entries=(spec,)),
                                                      snapshot_roots=(str(tmp_path / "snaps"),),
                                                      lease=LeaseSettings(30.0, 5.0)))
    (unit,) = units_for_step(run.manifest(), 7)
    write_result(run.results, ok_result(unit, [1.0, 0.5, 0.25, 0.0], ["7"] * 4))
    values = RunValues(run)
    derived = derive_point(run.manifest(), 7, values.results).datasets["g"].derived
    assert derived["pass@1"] == 0.5 and derived["pass^2"] == 0.5
    for name in ("pass@1", "pass^2"):
        assert values.values(7, parse_metric(f"eval/g/{name}", run.manifest())).tolist() == [1.0, 0.0]


# -- scorer identities (compare / best refuse points scored differently) --------------------------------------
EXACT = {"name": "exact_match"}
THINKING = {"name": "exact_match", "chat_template_kwargs": {"enable_thinking": True}}


@pytest.fixture
def rescored_run(tmp_path: Path) -> RunDir:
    """Steps 100 and 200 scored by one scorer identity; step 300 with thinking switched on in the template;
    step 400's results recorded no identity (as results from before identities)."""
    run = make_run(tmp_path, n_prompts=20, shard_size=10)
    manifest, rng = run.manifest(), np.random.default_rng(11)
    for step, scorer in ((100, EXACT), (200, EXACT), (300, THINKING), (400, {})):
        per_prompt = (rng.random(20) < 0.5).astype(float)
        for unit in units_for_step(manifest, step):
            idx = list(shard_range(manifest, unit))
            write_result(run.results, ok_result(unit, [float(per_prompt[i]) for i in idx], [str(step)] * len(idx),
                                                scorer=scorer))
    return run


def test_compare_refuses_points_of_different_scorers_naming_the_fields_unless_told(
    rescored_run: RunDir, capsys: pytest.CaptureFixture[str]
) -> None:
    from ckpteval.jobs.decide import compare

    path = str(rescored_run.path)
    assert compare.main([path, "--steps", "100", "200"]) == 0  # one identity
    capsys.readouterr()
    assert compare.main([path, "--steps", "200", "300"]) == 2
    err = capsys.readouterr().err
    assert ("A step 200 and B step 300 were scored by different scorers (chat_template_kwargs: chat_template_kwargs "
            'none vs {"enable_thinking": true})') in err, err
    assert "--allow-scorer-mismatch" in err and "ckpteval rescore" in err, err
    assert compare.main([path, "--steps", "100", "400"]) == 2  # an identity vs none recorded
    assert "one recorded no scorer identity" in capsys.readouterr().err
    assert compare.main([path, "--steps", "200", "300", "--allow-scorer-mismatch", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["datasets"]
    assert "chat_template_kwargs" in row["scorer_notes"][0] and "engine_notes" not in row
    assert compare.main([path, "--steps", "200", "300", "--allow-scorer-mismatch"]) == 0
    assert "warning: add: A step 200 and B step 300 were scored by different scorers" in capsys.readouterr().out


def test_best_refuses_steps_of_different_scorers_unless_told(rescored_run: RunDir,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from ckpteval.jobs.decide import best

    assert best.main([str(rescored_run.path)]) == 2
    err = capsys.readouterr().err
    assert "step 100 and step 300 were scored by different scorers" in err and "--allow-scorer-mismatch" in err, err
    assert not rescored_run.best_path("eval/add").exists()
    assert best.main([str(rescored_run.path), "--allow-scorer-mismatch"]) == 0
    rec = json.loads(rescored_run.best_path("eval/add").read_text())
    assert [n.split(" were ")[0] for n in rec["scorer_notes"]] == ["step 100 and step 300", "step 100 and step 400"]
