"""Censoring-aware points and length-budget curves (#40), on a real run: a real worker (``--engine http:``) against a
scripted stand-in server whose answers lengthen past the cap while accuracy on the finished ones rises, real
snapshots of the tiny model (its tokenizer cuts the budgets), real results, ``status``, ``best``, ``compare``,
``rescore --budget``. The intervals are checked by simulation against their nominal rate."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ckpteval.coord.results import censoring
from ckpteval.coord.results.completions import completions_path, read_completions
from ckpteval.coord.results.points import derive_point, point_metrics
from ckpteval.coord.results.scorings import budget_scorings, scoring_results
from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.decide.best import main as best_main
from ckpteval.jobs.decide.compare import main as compare_main
from ckpteval.jobs.decide.stats import mean_interval, paired_interval
from ckpteval.jobs.eval.kinds.generate.budget import cut_text
from ckpteval.jobs.eval.kinds.generate.prompts import snapshot_tokenizer
from ckpteval.jobs.eval.worker.rescore import main as rescore_main
from ckpteval.jobs.views.status.main import collect_status
from tests.support.canned_engine import ScriptedEngine
from tests.support.workers import results, scripted_run

CAP = 40
# per step: (samples of 4 cut off, finished samples right, reasoning words of a finished sample) for even / odd prompts
PLAN = {0: ((0, 2, 4), (0, 2, 4)), 10: ((1, 2, 12), (1, 3, 12)), 20: ((3, 1, 30), (2, 2, 30))}


def policy(text: str, engine: ScriptedEngine) -> tuple[str, str] | str:
    step = int(engine.label.rsplit("@", 1)[1])
    prompt = text.strip()
    a, b = prompt.rstrip("=").split("+")
    key = (engine.label, prompt)
    j = engine.seen[key]
    engine.seen[key] += 1
    cut, right, words = PLAN[step][int(a) % 2]
    if j < cut:  # thinking past the cap: cut off inside its reasoning
        return "<think>" + " w" * (CAP - 1), "length"
    answer = f"{int(a) + int(b):03d}" if j < cut + right else "999"
    return "<think>" + " w" * words + "</think>" + answer


@pytest.fixture(scope="module")
def drifting(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    return scripted_run(tmp_path_factory.mktemp("drift"), policy, tuple(PLAN), reasoning={"end": "</think>", "start": "<think>"},
                        n_prompts=60, shard_size=30, n_samples=4, max_new_tokens=CAP)

def test_each_point_reports_lower_bound_completed_score_and_censored_share(drifting: RunDir) -> None:
    manifest, got = drifting.manifest(), results(drifting)
    assert all(len(r.truncated) == len(r.scores) for r in got.values())
    c = {s: derive_point(manifest, s, got).datasets["addition"] for s in PLAN}
    rows = [json.loads(line) for line in (drifting.path / "data" / "addition.jsonl").read_text().splitlines()]
    odd = sum(int(r["prompt"].split("+")[0]) % 2 for r in rows) / len(rows)  # the exact numbers of PLAN:
    assert c[0].censoring["lower"] == 0.5 and c[0].censoring["completed"] == 0.5 and c[0].censoring["censored"] == 0
    assert c[20].censoring["lower"] == pytest.approx((1 - odd) / 4 + odd / 2) and c[20].censoring["completed"] == 1.0
    assert c[20].censoring["censored"] == pytest.approx((1 - odd) * 3 / 4 + odd / 2)
    assert c[10].censoring["completed"] == pytest.approx((1 - odd) * 2 / 3 + odd)
    for s in PLAN:  # a reasoning trace cut off has no answer: the lower bound is the score as always read
        assert c[s].censoring["lower"] == pytest.approx(c[s].score)
    assert c[0].censoring["lower"] > c[20].censoring["lower"] and c[0].censoring["completed"] < c[20].censoring["completed"]
    metrics = point_metrics(derive_point(manifest, 20, got))
    assert metrics["eval/addition/completed"] == 1.0 and metrics["eval/addition/censored"] == c[20].censoring["censored"]
    assert metrics["eval/addition/censored/stderr"] > 0
    status = collect_status(drifting.path)
    shown = {p["step"]: p["datasets"]["addition"]["censoring"] for p in status["points"]}
    assert shown[20]["completed"] == 1.0 and shown[0]["censored"] == 0.0


def test_best_and_compare_say_the_drop_is_within_what_censoring_explains(
        drifting: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    assert best_main([str(drifting.path), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["best_step"] in (0, 10)  # by the lower bound
    assert rec["censoring"]["best_completed"] == 20
    assert "flips" in rec["censoring"]["within_censoring"]["20"]
    assert best_main([str(drifting.path)]) == 0
    text = capsys.readouterr().out
    assert "on completed answers step 20 scores highest" in text and "step 20 trails" in text
    assert compare_main([str(drifting.path), "--steps", "0", "20", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["datasets"]
    assert row["verdict"] == "A better" and row["censoring"]["within_censoring"]
    assert row["censoring"]["completed"]["estimate"] == pytest.approx(0.5)  # 0.5 -> 1.0 on completed answers
    assert set(row["censoring"]["why"]) == {"flips", "share"}


def test_budget_curves_rescore_kept_text_cut_by_the_snapshot_tokenizer(
        drifting: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    assert rescore_main([str(drifting.path), "--budget", "8,20,40"]) == 0
    names = budget_scorings(drifting)
    assert sorted(names) == [8, 20, 40]
    manifest, got = drifting.manifest(), results(drifting)
    curve: dict[int, dict[int, float]] = {}
    for budget, name in names.items():
        view, errors = scoring_results(drifting, name)
        assert not errors
        for step in PLAN:
            ds = derive_point(manifest, step, view).datasets["addition"]
            curve.setdefault(step, {})[budget] = ds.score
            kept = [(n, f) for u in manifest.eval.entries[0].units(step)
                    for k in [read_completions(completions_path(drifting.results, u))]
                    for n, f in zip(k.n_tokens, k.finish_reason, strict=True)]  # cut before, or longer than the budget
            assert ds.censoring["censored"] == pytest.approx(sum(n > budget or f == "length" for n, f in kept) / len(kept))
    original = {s: derive_point(manifest, s, got).datasets["addition"].score for s in PLAN}
    for step in PLAN:  # more budget never scores less; at the cap, the point as generated
        assert curve[step][8] <= curve[step][20] <= curve[step][40] == original[step]
    # the engine's count (here: words) decides what a budget cuts: step 0's 5 fit in 8, step 10's 13 do not, step 20's 31
    assert curve[0][8] == original[0] and curve[10][8] == 0 and curve[10][20] == original[10] and curve[20][20] == 0
    tokenizer = snapshot_tokenizer(results(drifting)[next(iter(results(drifting)))].snapshot)  # one char a token
    assert cut_text("<think> w</think>042", 9, tokenizer) == "<think> w" and cut_text("042", 9, tokenizer) == "042"
    capsys.readouterr()
    assert compare_main([str(drifting.path), "--steps", "0", "20", "--budget", "20", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["datasets"]
    assert (row["a"], row["b"]) == (curve[0][20], curve[20][20])
    assert compare_main([str(drifting.path), "--steps", "0", "20", "--budget", "16"]) == 2
    assert "ckpteval rescore" in (err := capsys.readouterr().err) and "--budget 16" in err


@pytest.mark.parametrize("name", ["lower", "completed", "censored"])
def test_the_three_intervals_cover_at_their_nominal_rate(name: str) -> None:
    """Prompts of varying difficulty and length; each prompt's 4 samples cut off with a prompt-dependent chance
    (harder prompts think longer) — the 95% interval of each number covers its population value ~95% of the time."""
    rng = np.random.default_rng(0)
    prompts, n, sims = 60, 4, 1500
    p_right = rng.beta(2, 2, 20_000)
    p_cut = np.clip(0.6 - 0.5 * p_right + rng.normal(0, 0.1, p_right.size), 0.02, 0.95)
    truth = {"lower": float(np.mean(p_right * (1 - p_cut))), "censored": float(np.mean(p_cut)),
             "completed": float(np.sum(p_right * (1 - p_cut)) / np.sum(1 - p_cut))}
    hits = 0
    for _ in range(sims):
        pick = rng.integers(0, p_right.size, prompts)
        cut = rng.random((prompts, n)) < p_cut[pick, None]
        right = (rng.random((prompts, n)) < p_right[pick, None]).astype(float)
        pp = censoring.per_prompt(right.ravel().tolist(), cut.ravel().astype(float).tolist(), n)
        values = {"lower": pp.lower, "censored": pp.censored, "completed": censoring.completed_values(pp)}[name]
        iv = mean_interval(np.array(values), 0.95)
        hits += iv.low <= truth[name] <= iv.high
    assert 0.93 <= hits / sims <= 0.97, hits / sims


def test_the_paired_completed_difference_covers_at_its_nominal_rate() -> None:
    rng = np.random.default_rng(1)
    prompts, n, sims, hits = 60, 4, 1000, 0
    for _ in range(sims):
        p = rng.beta(2, 2, prompts)  # the same prompts at two steps; step B thinks longer, equally right
        a = censoring.per_prompt((rng.random((prompts, n)) < p[:, None]).astype(float).ravel().tolist(),
                                 (rng.random((prompts, n)) < 0.1).astype(float).ravel().tolist(), n)
        b = censoring.per_prompt((rng.random((prompts, n)) < p[:, None]).astype(float).ravel().tolist(),
                                 (rng.random((prompts, n)) < 0.5).astype(float).ravel().tolist(), n)
        iv = paired_interval(np.array(censoring.completed_values(a)), np.array(censoring.completed_values(b)), 0.95)
        hits += iv.low <= 0.0 <= iv.high
    assert 0.93 <= hits / sims <= 0.97, hits / sims


def test_plot_draws_the_budget_curves_and_logs_them_to_wandb(drifting: RunDir, tmp_path: Path) -> None:
    """``ckpteval plot``: each step's score at every rescored budget and at the cap (the point as generated),
    drawn into ``curve.budget.png`` and logged (offline) to wandb as a table and its line chart."""
    import os

    from ckpteval.jobs.views.budget_curve import budget_path
    from ckpteval.jobs.views.plot import plot_run
    from tests.support.workers import finish, spawn
    from tests.test_metrics import wandb_records

    if sorted(budget_scorings(drifting)) != [8, 20, 40]:
        assert rescore_main([str(drifting.path), "--budget", "8,20,40"]) == 0
    manifest, got = drifting.manifest(), results(drifting)
    curves = plot_run(drifting.path, tmp_path / "curve.png")["budget"]
    assert budget_path(tmp_path / "curve.png").stat().st_size > 0
    for step in PLAN:
        cut = {b: derive_point(manifest, step, scoring_results(drifting, n)[0]).datasets["addition"].score
               for b, n in budget_scorings(drifting).items()}
        assert curves["addition"][step] == [(8, cut[8]), (20, cut[20]),
                                            (CAP, derive_point(manifest, step, got).datasets["addition"].score)]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    code, out = finish(spawn("plot", str(drifting.path), "-o", str(tmp_path / "w.png"), "--wandb-run-id", "drift-1",
                             env=env), 120)
    assert code == 0 and str(tmp_path / "w.budget.png") in out, out
    (wandb_file,) = drifting.path.glob("wandb/offline-run-*/run-drift-1.wandb")
    logged = {i.key or "/".join(i.nested_key) for r in wandb_records(wandb_file)
              if r.WhichOneof("record_type") == "history" for i in r.history.item}
    assert "eval/addition/budget_curve/_type" in logged, logged  # the table, as wandb records it
    assert any(k.startswith("eval/addition/budget_curve_chart") for k in logged), logged  # its line chart
