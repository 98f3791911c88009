"""Splitting a prompt's samples over units (``samples_per_unit``, issue 20 §2): the same point as unsplit.

Real runs: a real worker (in this process) claims the units through leases, evaluates them on a real
snapshot of the tiny model and publishes real result files; the point is derived from those files as
status, plot and the trainer derive it. Backends: the real hf engine (per-sample seeded sampling of the
tiny Llama) and a real fn backend whose sample is a function of its seed (``SeedBackend``: nonzero
pass@k and maj@n votes on an untrained model).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from ckpteval.coord.results.files import ResultIndex
from ckpteval.coord.results.points import derive_point, point_metrics, prompt_major
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest, parse_manifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import WorkUnit, units_for_step
from ckpteval.jobs.eval.kinds.generate.evalsets import write_addition_dataset
from ckpteval.jobs.eval.worker.options import WorkerOptions
from ckpteval.jobs.lifecycle import EXIT_DONE
from tests.support.workers import publish_model, run_inprocess

STEP = 3
TIMED = {"engine_s", "gpu_s", "load_s", "attest_s", "canary_s", "verify_s", "score_s"}  # wall-clock seconds: differ per run


def scored_run(tmp: Path, name: str, engine: str, samples_per_unit: int | None, **sampling: object) -> dict[str, float]:
    """A run of 5 prompts (shards of 2: the last one short) x 4 samples at temperature 1.5, evaluated at one
    step by a real worker; the point's metrics, and the run for a closer look."""
    run = RunDir.create(tmp / name)
    spec = replace(write_addition_dataset(run, n=5, shard_size=2, n_samples=4, temperature=1.5, pass_k=(1, 2, 4),
                                          samples_per_unit=samples_per_unit), **sampling)  # type: ignore[arg-type]
    manifest = RunManifest(run_id="split", eval=EvalSpec(entries=(spec,)), snapshot_roots=(str(run.snapshots),),
                           lease=LeaseSettings(30.0, 5.0))
    run = RunDir.create(run.path, manifest)
    publish_model(tmp, run.snapshots, STEP, seed=0)
    code, _ = run_inprocess(WorkerOptions(run_dir=run.path, engines=(engine,), once=True, poll_interval_s=0.1),
                            out=lambda _line: None)
    assert code == EXIT_DONE
    results = ResultIndex(run.results).refresh()
    assert all(r.ok for r in results.values()), [r.message for r in results.values()]
    point = derive_point(manifest, STEP, results)
    assert point.complete
    return {"_units": len(results), **point_metrics(point)}


def same_point(a: dict[str, float], b: dict[str, float]) -> None:
    """Every metric key the same, every value identical (the cost's wall-clock seconds excepted)."""
    assert set(a) - {"_units"} == set(b) - {"_units"}
    for key in set(a) - {"_units"}:
        if key.removeprefix("eval/cost/") in TIMED:
            continue
        assert a[key] == b[key] or (math.isnan(a[key]) and math.isnan(b[key])), key


def test_split_samples_on_a_seeded_fn_backend_give_the_unsplit_point(tmp_path: Path) -> None:
    unsplit = scored_run(tmp_path, "whole", "fn:tests.support.workers:SeedBackend", None)
    assert unsplit["_units"] == 3
    assert 0 < unsplit["eval/addition/pass@1"] < unsplit["eval/addition/pass@4"] <= 1  # not a trivial point
    assert "eval/addition/maj@4" in unsplit and unsplit["eval/addition/stderr"] > 0
    for per_unit, units in ((2, 6), (1, 12), (4, 3)):
        split = scored_run(tmp_path, f"split{per_unit}", "fn:tests.support.workers:SeedBackend", per_unit)
        assert split["_units"] == units
        same_point(unsplit, split)


def test_split_samples_on_the_hf_engine_draw_the_same_samples_and_point(tmp_path: Path) -> None:
    """The tiny Llama sampling at temperature 1.5: the split run's samples (every completion, pooled per
    prompt) are the unsplit run's, and so is every metric."""
    sampling = {"scorer": "tests.support.workers:digit_first", "max_new_tokens": 3}
    unsplit = scored_run(tmp_path, "whole", "hf", None, **sampling)
    split = scored_run(tmp_path, "split", "hf", 2, **sampling)
    assert split["_units"] == 6
    same_point(unsplit, split)
    assert {"eval/addition/maj@4", "eval/cost/generated_tokens"} <= set(split)
    assert 0 < split["eval/addition/pass@1"] < split["eval/addition/pass@4"]

    def pooled(name: str) -> list[str | None]:
        run = RunDir.open(tmp_path / name)
        spec = run.manifest().entry("addition")
        results = ResultIndex(run.results).refresh()
        answers = prompt_major(spec, [results[u] for u in spec.units(STEP)]).answers
        assert answers is not None
        return answers

    whole = pooled("whole")
    assert len(whole) == 20 and len(set(whole)) > 4  # distinct samples, in the same places
    assert pooled("split") == whole


def test_split_unit_ids_carry_their_sample_range_and_read_back(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path / "r")
    spec = write_addition_dataset(run, n=3, shard_size=2, n_samples=4, temperature=1.0, samples_per_unit=2)
    manifest = RunManifest(run_id="r", eval=EvalSpec(entries=(spec,)), snapshot_roots=(str(run.snapshots),))
    units = units_for_step(manifest, 7)
    assert [u.id for u in units] == [
        "0000000007.addition.00000.s00000-00002", "0000000007.addition.00000.s00002-00004",
        "0000000007.addition.00001.s00000-00002", "0000000007.addition.00001.s00002-00004",
    ]
    assert [WorkUnit.from_id(u.id) for u in units] == units
    assert [WorkUnit.from_json(json.loads(json.dumps(u.to_json()))) for u in units] == units
    assert units[1].label == "addition[0] samples 2-4"
    for bad in ("0000000007.addition.00000.s00002-00002", "0000000007.addition.00000.retry1",
                "0000000007.addition.00000.s2"):
        with pytest.raises(ValueError, match="is not a unit id"):
            WorkUnit.from_id(bad)
    # samples_per_unit == n_samples is the unsplit run: same ids, so an existing run keeps its results
    whole = replace(manifest, eval=EvalSpec(entries=(replace(spec, samples_per_unit=4),)))
    assert [u.id for u in units_for_step(whole, 7)] == ["0000000007.addition.00000", "0000000007.addition.00001"]
    # run.json round trip: the setting is written when set, and written as null (unsplit) when not
    assert parse_manifest(manifest.to_json(), Path("run.json")) == manifest
    unsplit = replace(manifest, eval=EvalSpec(entries=(replace(spec, samples_per_unit=None),)))
    assert unsplit.to_json()["eval"]["datasets"][0]["samples_per_unit"] is None
    assert parse_manifest(unsplit.to_json(), Path("run.json")) == unsplit


@pytest.mark.parametrize(("value", "why"), [
    (0, "must be in 1..n_samples (4), got 0"), (8, "must be in 1..n_samples (4), got 8"),
    (3, "must divide n_samples (4)"), (-2, "must be in 1..n_samples"), (2.0, "must be int"), (True, "boolean"),
])
def test_a_bad_samples_per_unit_is_one_error_naming_the_file_and_key(value: object, why: str) -> None:
    obj = {"run_id": "r", "snapshot_roots": ["/snaps"], "eval": {"datasets": [
        {"name": "a", "path": "a.jsonl", "n_prompts": 1, "n_samples": 4, "temperature": 1.0,
         "samples_per_unit": value}]}}
    with pytest.raises(ValueError) as err:
        parse_manifest(obj, Path("/runs/r/run.json"))
    assert str(err.value).startswith("/runs/r/run.json: field eval.datasets[0].samples_per_unit ")
    assert why in str(err.value)


def test_split_episodes_of_an_env_entry_give_the_unsplit_point(tmp_path: Path) -> None:
    """An ``env`` entry (2 episodes per row) split one episode per unit: each unit plays its own absolute
    episode index of every row (the index its turn seeds derive from), and the point is the unsplit one.
    The engine is test_envs' scripted policy behind a real HTTP server; the tool runs in the real sandbox."""
    from tests.support.canned_engine import ScriptedEngine
    from tests.test_envs import ROWS, env_run, policy

    points = []
    for per_unit in (None, 1):
        run = env_run(tmp_path / str(per_unit), ROWS, pass_k=(1, 2), n_samples=2, samples_per_unit=per_unit)
        with ScriptedEngine(policy) as url:
            code, _ = run_inprocess(WorkerOptions(run_dir=run.path, engines=(f"http:{url}",), once=True,
                                                  poll_interval_s=0.05), out=lambda _l: None)
        assert code == EXIT_DONE
        results = ResultIndex(run.results).refresh()
        if per_unit:
            assert {u.id.rsplit(".", 1)[-1]: [(e["row"], e["sample"]) for e in r.episodes] for u, r in results.items()} == {
                f"s0000{j}-0000{j + 1}": [(i, j) for i in range(4)] for j in (0, 1)}
        points.append({"_units": len(results), **point_metrics(derive_point(run.manifest(), 1, results))})
    same_point(*points)
    assert points[0]["eval/arith/pass@1"] == 0.25
