"""Adaptive evaluation under a GPU budget (#40): grants (``RUN/grants.jsonl``) add samples to a step as ordinary
units, a point pools them as if they had been asked for up front, and the dispatcher spends them where the
decision is still open (``--eval-adaptive``), recording why."""

from __future__ import annotations

import json
import threading
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ckpteval.coord.results.files import ResultIndex, ok_result, write_result
from ckpteval.coord.results.points import derive_point, point_metrics
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest, save_manifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
from ckpteval.coord.work.grants import GRANTS_FILE, Grant, Grants
from ckpteval.coord.work.units import shard_range, unit_samples, units_for_step
from ckpteval.jobs.eval.kinds.generate.evalsets import write_addition_dataset
from ckpteval.jobs.eval.worker.options import WorkerOptions
from ckpteval.jobs.lifecycle import EXIT_DONE
from ckpteval.jobs.trainer.adaptive.policy import AdaptiveSettings, StepValues, open_steps, parse_adaptive
from tests.support.training import eval_lines, make_train_run, train_beside
from tests.support.workers import publish_model, run_inprocess

STEP = 3
SEED_FN = "fn:tests.support.workers:SeedBackend"


def _seeded_run(tmp: Path, name: str, n_samples: int, grant: tuple[int, int] | None) -> dict[str, float]:
    """5 prompts (shards of 2) x ``n_samples`` at temperature 1.5, plus a grant of samples ``grant``; one real worker
    (in this process) claims every unit, granted ones included, through the leases; the point's metrics."""
    run = RunDir.create(tmp / name)
    spec = write_addition_dataset(run, n=5, shard_size=2, n_samples=n_samples, temperature=1.5, pass_k=(1, 2))
    manifest = RunManifest(run_id="adaptive", eval=EvalSpec(entries=(spec,)), snapshot_roots=(str(run.snapshots),),
                           lease=LeaseSettings(30.0, 5.0))
    run = RunDir.create(run.path, manifest)
    if grant is not None:
        Grants.of(run.path).append(Grant(STEP, "addition", grant[0], grant[1], "test: more samples"))
    publish_model(tmp, run.snapshots, STEP, seed=0)
    code, _ = run_inprocess(WorkerOptions(run_dir=run.path, engines=(SEED_FN,), once=True, poll_interval_s=0.1),
                            out=lambda _line: None)
    assert code == EXIT_DONE
    results = ResultIndex(run.results).refresh()
    assert all(r.ok for r in results.values()) and (run.leases / "step-0000000003").is_dir()
    point = derive_point(manifest, STEP, results)
    assert point.complete
    return {"_units": len(results), **point_metrics(point)}


def test_granted_samples_pool_into_the_point_as_if_asked_for_up_front(tmp_path: Path) -> None:
    whole = _seeded_run(tmp_path, "whole", 4, None)
    granted = _seeded_run(tmp_path, "granted", 2, (2, 4))
    base = _seeded_run(tmp_path, "base", 2, None)
    assert (whole["_units"], granted["_units"], base["_units"]) == (3, 6, 3)
    for key in ("eval/addition", "eval/addition/stderr", "eval/addition/pass@1", "eval/addition/pass@2",
                "eval/addition/maj@4"):
        assert granted[key] == whole[key], key
    assert base["eval/addition"] != whole["eval/addition"]  # the grant is what made the difference
    assert "eval/addition/maj@4" not in base


def test_the_grants_file_is_read_back_and_a_bad_line_names_its_place(tmp_path: Path) -> None:
    grants = Grants.of(tmp_path)
    grants.append(Grant(10, "addition", 4, 8, "candidate best"))
    again = Grants.of(tmp_path)
    assert again.samples(10, "addition") == 8 and again.by_step[10][0].reason == "candidate best"
    with open(tmp_path / GRANTS_FILE, "a") as f:
        f.write('{"step": 11, "dataset": "addition", "samples": [8, 4]}\n{"step": 12')  # a bad range; a torn tail
    with pytest.raises(ValueError, match=rf"{GRANTS_FILE}:2: grant field samples"):
        Grants.of(tmp_path)


def test_units_of_a_step_include_its_grants_one_per_shard(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path / "r")
    spec = write_addition_dataset(run, n=5, shard_size=2, n_samples=2, temperature=1.0)
    manifest = RunManifest(run_id="u", eval=EvalSpec(entries=(spec,)), snapshot_roots=(str(run.snapshots),))
    grants = Grants.of(run.path)
    grants.append(Grant(7, "addition", 2, 6, "why"))
    units = units_for_step(manifest, 7, grants)
    assert [u.id for u in units[3:]] == [f"0000000007.addition.{s:05d}.s00002-00006" for s in range(3)]
    assert units_for_step(manifest, 8, grants) == units_for_step(manifest, 8)


def test_the_policy_deepens_the_best_then_its_candidates_and_leaves_far_behind_steps_alone() -> None:
    rng = np.random.default_rng(1)
    per_prompt = rng.uniform(0.2, 0.8, 60)
    draws = rng.random((4, 60, 8))

    def step(i: int, shift: float, samples: int = 2) -> StepValues:
        return StepValues(10 * i, (draws[i, :, :samples] < np.clip(per_prompt + shift, 0, 1)[:, None]).mean(axis=1),
                          samples)

    settings = AdaptiveSettings("addition", 0.02, lag=1)
    points = [step(0, -0.5), step(1, 0.0), step(2, 0.01), step(3, -0.5)]
    best = max(points, key=lambda p: p.values.mean()).step
    assert best in (10, 20)
    wants = open_steps(settings, points, cap=8)
    assert [(w.step, w.add) for w in wants] == [(best, 2)] and "best step" in wants[0].reason  # the best first
    deep = [p if p.step != best else step(best // 10, 0.0 if best == 10 else 0.01, samples=8) for p in points]
    other = 30 - best
    wants = open_steps(settings, deep, cap=8)
    assert [w.step for w in wants] == [other] and "candidate best" in wants[0].reason  # then its candidate
    assert open_steps(AdaptiveSettings("addition", 0.02, lag=3), points, cap=8) == []  # the best is too new
    assert [w.step for w in open_steps(AdaptiveSettings("addition", 0.02, lag=3), points, cap=8, final=True)] == [best]
    assert open_steps(AdaptiveSettings("addition", 0.9, lag=1), points, cap=8) == []  # within a loose target: decided


def test_the_settings_parse_and_refuse_with_one_line() -> None:
    s = parse_adaptive("eval/gsm8k mde 0.03 max-samples 32 budget 0.1", "F")
    assert (s.dataset, s.mde, s.max_samples, s.fraction, s.gpu_s_per_point) == ("gsm8k", 0.03, 32, 0.1, None)
    assert parse_adaptive("eval/a mde 0.05 budget 600s", "F").gpu_s_per_point == 600
    for bad in ("eval/a", "eval/a mde 2", "eval/a mde 0.1 max-samples 1", "a mde 0.1", "eval/a mde 0.1 budget 0"):
        with pytest.raises(ValueError, match="^--eval-adaptive"):
            parse_adaptive(bad, "--eval-adaptive")


MEANS = {0: 0.0, 5: 0.0, 10: 0.5, 15: 0.52, 20: 0.1}  # steps 10 and 15: the open decision; 0, 5, 20 decided


def _sample(step: int, prompt: int, sample: int) -> float:
    """A scripted engine: sample j of prompt i at step s is right with probability MEANS[s] (a hash of (s, i, j))."""
    return float(zlib.crc32(f"{step}:{prompt}:{sample}".encode()) % 1000 < 1000 * MEANS.get(step, 0.0))


def _fleet(run: RunDir, stop: threading.Event) -> None:
    """Score every open unit of every published step, granted ones included (read from RUN/grants.jsonl)."""
    manifest, grants = run.manifest(), Grants.of(run.path)
    discovery, steps = SnapshotDiscovery(Path(manifest.snapshot_roots[0])), set()
    index = ResultIndex(run.results, manifest)
    while not stop.is_set():
        steps |= {ref.step for ref in discovery.poll()}
        grants.refresh()
        index.refresh()
        for step in sorted(steps):
            for unit in units_for_step(manifest, step, grants):
                if index.get(unit) is None:
                    scores = [_sample(step, i, j) for i in shard_range(manifest, unit) for j in unit_samples(manifest, unit)]
                    write_result(run.results, ok_result(unit, scores, [str(step)] * len(scores)))
        stop.wait(0.05)


def test_the_trainer_spends_samples_where_the_decision_is_open_and_says_why(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    run, _ = make_train_run(run_dir, eval_interval=5, eval_n_prompts=40, eval_shard_size=20,
                            eval_max_in_flight=4, eval_keep_snapshots=6)
    manifest = run.manifest()
    spec = replace(manifest.eval.entries[0], n_samples=2, temperature=1.0)
    save_manifest(run.manifest_path, replace(manifest, eval=replace(manifest.eval, entries=(spec,))))
    code = train_beside(run, _fleet, ["--run-dir", str(run_dir), "--resume", "--steps", "20", "--batch-size", "8",
                                      "--no-progress", "--eval-interval", "5", "--eval-poll-interval", "0",
                                      "--eval-max-in-flight", "4", "--eval-keep-snapshots", "6",
                                      "--eval-adaptive", "eval/addition mde 0.05 max-samples 8 lag 1"])
    assert code == 0
    records = [json.loads(line) for line in (run.path / GRANTS_FILE).read_text().splitlines()]
    granted = {r["step"] for r in records}
    assert granted == {10, 15}, records  # steps 0 and 5 tie with no spread; step 20 came in far behind
    assert all(r["step"] != 15 or "best step" in r["reason"] for r in records)
    assert all("candidate best" in r["reason"] or "best step" in r["reason"] for r in records)
    reach = {s: max(r["samples"][1] for r in records if r["step"] == s) for s in granted}
    assert reach[10] == reach[15] == 8, reach  # the open pair doubled to the cap: 2 -> 4 -> 8
    logged = {int(m["eval/step"]): m for m in eval_lines(run_dir)}
    results = ResultIndex(run.results, run.manifest()).refresh()
    point = point_metrics(derive_point(run.manifest(), 20, results))
    assert logged[20]["eval/addition"] == point["eval/addition"]  # never granted: logged as it is
    base = np.mean([_sample(15, i, j) for i in range(40) for j in range(2)])
    pooled = np.mean([_sample(15, i, j) for i in range(40) for j in range(8)])
    assert logged[15]["eval/addition"] == pytest.approx(base)  # logged when it landed (the lag: granted later)
    assert point_metrics(derive_point(run.manifest(), 15, results))["eval/addition"] == pytest.approx(pooled)


def test_a_worker_reopens_a_settled_step_when_it_is_granted_more(tmp_path: Path) -> None:
    """A real worker settles a step once its units have results; a grant appended after that reopens it: its
    next poll offers the granted units (one per shard) for claiming."""
    run = RunDir.create(tmp_path / "r")
    spec = write_addition_dataset(run, n=5, shard_size=2, n_samples=2, temperature=1.5)
    manifest = RunManifest(run_id="reopen", eval=EvalSpec(entries=(spec,)), snapshot_roots=(str(run.snapshots),),
                           lease=LeaseSettings(30.0, 5.0))
    run = RunDir.create(run.path, manifest)
    publish_model(tmp_path, run.snapshots, STEP, seed=0)
    code, worker = run_inprocess(WorkerOptions(run_dir=run.path, engines=(SEED_FN,), once=True, poll_interval_s=0.1),
                                 out=lambda _line: None)
    assert code == EXIT_DONE and STEP in worker.settled and worker.poll() == ([], 0)
    Grants.of(run.path).append(Grant(STEP, "addition", 2, 4, "candidate best"))
    claimable, outstanding = worker.poll()
    assert outstanding == 3 and [u.id for u in claimable] == [f"0000000003.addition.{s:05d}.s00002-00004" for s in range(3)]


@pytest.mark.parametrize(("budget", "granted"), [("", 1), (" budget 8s", 1), (" budget 7s", 0), (" budget 0.15", 1),
                                                 (" budget 0.1", 0)])
def test_grants_stay_within_the_gpu_budget(tmp_path: Path, budget: str, granted: int) -> None:
    """Two complete points of 40 prompts x 2 samples, one unit each costing 5 GPU-seconds, an open decision: the
    best first (a grant estimated at 5 GPU-s, its own unit's cost per sample x 2 more samples). ``budget Gs``:
    at most G GPU-seconds per point on average (10 spent + 5 <= 2 x G); ``budget F``: at most F x the trainer's
    GPU-seconds (100 recorded by its dispatch)."""
    from ckpteval.coord.run.ledger import LedgerState
    from ckpteval.jobs.trainer.adaptive.spend import open_spender

    run = RunDir.create(tmp_path / "r")
    spec = write_addition_dataset(run, n=40, shard_size=40, n_samples=2, temperature=1.0)
    manifest = RunManifest(run_id="b", eval=EvalSpec(entries=(spec,)), snapshot_roots=(str(run.snapshots),))
    spender = open_spender(f"eval/addition mde 0.01 lag 0{budget}", run.path, manifest, None)
    rng = np.random.default_rng(0)
    by_step = {}
    for step in (10, 20):
        (unit,) = spec.units(step)
        scores = [float(x) for x in rng.random(80) < 0.5]
        by_step[step] = {unit: ok_result(unit, scores, [str(step)] * 80, cost={"gpu_s": 5.0})}
    state = LedgerState()
    state.dispatched.update({10: {"train_gpu_s": 50.0}, 20: {"train_gpu_s": 100.0}})
    made = spender.spend(by_step, state, lambda step: True)
    assert len(made) == granted
    assert Grants.of(run.path).by_step == ({} if not granted else {made[0].step: made})
