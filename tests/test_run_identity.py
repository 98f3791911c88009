"""Issue 11 §1-2: runs never bleed into each other; foreign checkpoints as trainers really write them.

Real parts only: real runs made by the reference trainer's ``prepare_run``, real exports by the
dispatcher, one real :class:`HFEngine` shared by two runs' workers (the shared-engine case), real
subprocesses deleting a checkpoint while the service checksums it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch

from ckpteval.coord.results.files import ok_result
from ckpteval.coord.results.points import derive_point, point_metrics
from ckpteval.coord.run.identity import run_key, version_step, weight_version
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
from ckpteval.coord.snapshots.gc import StagingGC
from ckpteval.coord.snapshots.snapshot import mark_complete, publish_snapshot, read_marker, verify_snapshot
from ckpteval.coord.work.units import units_for_step
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
from ckpteval.jobs.eval.worker.evaluators import EngineEvaluator
from ckpteval.jobs.eval.worker.loop import Worker
from ckpteval.jobs.eval.worker.options import WorkerOptions
from ckpteval.jobs.metrics import MetricsSink
from ckpteval.jobs.reference.model import ModelConfig, build_model, save_hf_checkpoint
from ckpteval.jobs.reference.train.main import base_model_dir
from ckpteval.jobs.trainer.dispatcher import EvalDispatcher
from tests.support.runs import write_tiny_shards
from tests.support.training import make_train_run
from tests.support.workers import (
    make_eval_run,
    model_writer,
    results,
    safetensors_sum,
    write_foreign_checkpoint,
)

SMALL = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)
QUIET = {"out": lambda _line: None}


def _worker(run: RunDir, engine: HFEngine, **kw) -> Worker:
    opts = WorkerOptions(run_dir=run.path, poll_interval_s=0.05, pin_timeout_s=0.3, once=True, **kw)
    cache = DatasetCache(run, run.manifest())
    return Worker(run, opts, EngineEvaluator(engine, cache, opts.pin_timeout_s, opts.load_timeout_s), **QUIET)


def _dispatcher(run: RunDir, dispatch) -> EvalDispatcher:
    return EvalDispatcher.open(dispatch.with_waits(poll_interval_s=0.0), run, MetricsSink(run.metrics_path), base_model_dir(run))


def _dispatch_steps(d: EvalDispatcher, model: torch.nn.Module, steps: range) -> None:
    for step in steps:
        d.maybe_dispatch(step, model)
    assert d.exporter is not None and d.exporter.wait(60)
    d.poll(force=True)


def test_two_runs_sharing_one_staging_dir_never_bleed(tmp_path: Path) -> None:
    """Run A dispatches steps 2 and 4, run B only step 2, both into one staging dir; one engine serves
    both runs' workers. B scores only its own step 2, on its own weights, never A's step 4; each
    run's points carry its own versions; A's GC leaves B's snapshots alone."""
    shared = tmp_path / "shm"
    settings = {"eval_staging_dir": shared, "eval_max_in_flight": 1, "eval_keep_snapshots": 1}
    run_a, dispatch_a = make_train_run(tmp_path / "A", **settings)
    run_b, dispatch_b = make_train_run(tmp_path / "B", **settings)
    a, b = _dispatcher(run_a, dispatch_a), _dispatcher(run_b, dispatch_b)
    model_a, model_b = build_model(SMALL, "llama", seed=1), build_model(SMALL, "llama", seed=2)
    _dispatch_steps(a, model_a, range(1, 3))
    _dispatch_steps(b, model_b, range(1, 3))
    engine = HFEngine()  # one engine, two runs (a shared inference server)
    assert _worker(run_a, engine).run() == 0  # A's step 2 is now loaded into the engine
    _dispatch_steps(a, model_a, range(3, 5))
    assert _worker(run_b, engine).run() == 0

    got_b = results(run_b)
    assert sorted({u.step for u in got_b}) == [2], "run B holds results for steps it never dispatched"
    snap_a, snap_b = Path(results(run_a)[units_for_step(run_a.manifest(), 2)[0]].snapshot), None
    for r in got_b.values():
        assert r.ok and set(r.weight_versions) == {weight_version(run_key(run_b.manifest()), 2)}
        snap_b = Path(r.snapshot)
        assert snap_b != snap_a and read_marker(snap_b).run == run_key(run_b.manifest())
    assert safetensors_sum(str(snap_b)) != safetensors_sum(str(snap_a))  # B scored B's weights

    for run in (run_a, run_b):
        point = derive_point(run.manifest(), 2, results(run))
        assert point.complete and not point.skips
        assert point_metrics(point)["eval/addition/weight_version/mean"] == 2  # still the step

    _worker(run_a, engine).run()  # A's step 4 lands, A retires 2 and 4: its GC runs
    a.close(4, model_a)
    assert snap_b.is_dir() and verify_snapshot(snap_b, "full").run == run_key(run_b.manifest())
    assert not [p for p in shared.iterdir() if p.name.startswith("step-")]  # all run-scoped


def test_gc_deletes_only_its_own_runs_snapshots(tmp_path: Path) -> None:
    """A flat staging root holding snapshots of run A, run B and a run-less marker: A's GC deletes only
    A's retired ones."""
    root = tmp_path / "staging"
    for step, run in ((1, "A-00000001"), (2, "B-00000002"), (3, None), (4, "A-00000001")):
        publish_snapshot(root, step, model_writer(tmp_path, step), run=run)
    gc = StagingGC(root, tmp_path / "leases", lease_duration_s=1.0, keep=0, run="A-00000001")
    report = gc.collect({1, 2, 3, 4})
    assert sorted(p.name for p in report.deleted) == ["step-0000000001", "step-0000000004"]
    assert sorted(p.name for p in root.iterdir()) == ["step-0000000002", "step-0000000003"]


RUNLESS = "marker without a run key"


def test_a_runless_marker_in_a_runs_own_staging_is_not_its_snapshot_but_a_watched_one_is_admitted(tmp_path: Path) -> None:
    """A staging dir shared by runs holds run A's step 1 and a run-less marker at step 2 (an older ckpteval,
    another tool: anyone's weights). A's discovery reports step 1 only and says why step 2 is ignored;
    under a watched (foreign) root the same marker is a finished checkpoint and is admitted."""
    root = tmp_path / "staging"
    publish_snapshot(root, 1, lambda d: write_tiny_shards(d, n_shards=1, numel=8), run="A-00000001")
    publish_snapshot(root, 2, lambda d: write_tiny_shards(d, n_shards=1, numel=8))
    own = SnapshotDiscovery(root, run="A-00000001")
    assert [r.step for r in own.poll()] == [1]
    (line,) = own.problems.values()
    assert RUNLESS in line and "step-0000000002" in line
    watched = SnapshotDiscovery(root, admit_foreign=True, adoption_dir=tmp_path / "adopted", run="A-00000001")
    assert [r.step for r in watched.poll()] == [1, 2] and not watched.problems


def test_a_runless_marker_is_never_deleted_by_any_gc(tmp_path: Path) -> None:
    """A retired step's run-less staging snapshot survives a run-keyed GC and a GC given no run alike."""
    root = tmp_path / "staging"
    publish_snapshot(root, 3, lambda d: write_tiny_shards(d, n_shards=1, numel=8))
    for run in ("A-00000001", None):
        report = StagingGC(root, tmp_path / "leases", lease_duration_s=1.0, keep=0, run=run).collect({3})
        assert report.deleted == [] and [why for _, why in report.refused] == [
            f"{RUNLESS}: written by an older ckpteval or another tool; never deleted"]
    assert read_marker(root / "step-0000000003").run is None


def test_the_dispatcher_does_not_take_a_runless_marker_for_its_own(tmp_path: Path) -> None:
    """Reuse mode: the trainer's own checkpoint-2 already holds a run-less marker (planted, or an older
    ckpteval's); the dispatcher does not count it as published but marks the checkpoint with its run key."""
    save = tmp_path / "hf"
    run, dispatch = make_train_run(tmp_path / "run", save_hf_dir=save, save_interval=2, eval_interval=2)
    d, model = _dispatcher(run, dispatch), build_model(SMALL, "llama", seed=1)
    save_hf_checkpoint(save, 2, model)
    mark_complete(save / "checkpoint-2", 2)
    for step in (1, 2):
        d.maybe_dispatch(step, model)
    assert read_marker(save / "checkpoint-2").run == run_key(run.manifest())


def test_publish_refuses_another_runs_snapshot_under_the_same_name(tmp_path: Path) -> None:
    root = tmp_path / "staging"
    publish_snapshot(root, 5, model_writer(tmp_path, 5), run="A-00000001")
    try:
        publish_snapshot(root, 5, model_writer(tmp_path, 6), run="B-00000002")
    except FileExistsError as e:
        assert "step 5" in str(e)
    else:
        raise AssertionError("run B adopted run A's step-5 snapshot as its own")
    assert read_marker(root / "step-0000000005").run == "A-00000001"


def test_a_watched_dir_shared_by_two_services_is_adopted_by_each_and_never_written(tmp_path: Path) -> None:
    """Two service runs watch one checkpoint dir holding a marker-less HF checkpoint and another
    run's marked snapshot: each run adopts both into its own ``adopted/`` and scores them with its
    own versions; nothing is written into the watched dir."""
    watch = tmp_path / "ckpts"
    write_foreign_checkpoint(tmp_path, watch / "checkpoint-10", 10)
    publish_snapshot(watch, 20, model_writer(tmp_path, 20), run="trainer-run-0badc0de")
    before = sorted((str(p.relative_to(watch)), p.stat().st_mtime_ns) for p in watch.rglob("*"))
    engine = HFEngine()
    for name in ("svc1", "svc2"):
        run = make_eval_run(tmp_path, n_prompts=2, shard_size=2, name=name, snapshot_root=watch)
        assert _worker(run, engine, watch=(watch,), quiescence_s=0.2).run() == 0
        got = results(run)
        assert sorted(u.step for u in got) == [10, 20]
        key = run_key(run.manifest())
        assert all(r.ok and set(r.weight_versions) == {weight_version(key, u.step)} for u, r in got.items())
        assert sorted(p.name for p in run.adopted.iterdir()) == ["0000000010.json", "0000000020.json"]
    assert sorted((str(p.relative_to(watch)), p.stat().st_mtime_ns) for p in watch.rglob("*")) == before


def test_a_point_never_counts_samples_of_another_runs_weights(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=2, shard_size=2)
    manifest = run.manifest()
    (unit,) = units_for_step(manifest, 3)
    foreign = {unit: ok_result(unit, [1.0, 1.0], ["other-run-12345678@3"] * 2)}
    point = derive_point(manifest, 3, foreign)
    assert point.skips == {"pin_violation": 1} and not point.datasets
    assert version_step(weight_version(run_key(manifest), 3)) == 3


# -- §2 foreign checkpoints as trainers write them ------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _deepspeed_checkpoint(tmp: Path, path: Path, step: int) -> Path:
    """HF Trainer + DeepSpeed: weights and tokenizer first, then ``global_stepN/`` optimizer shards,
    ``latest``, ``rng_state_0.pth`` and ``trainer_state.json``."""
    write_foreign_checkpoint(tmp, path, step)
    shards = path / f"global_step{step}"
    shards.mkdir()
    (shards / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(os.urandom(4096))
    (path / "latest").write_text(f"global_step{step}")
    (path / "rng_state_0.pth").write_bytes(os.urandom(64))
    return path


def test_admission_waits_for_subdirectory_writes_and_covers_only_what_eval_loads(tmp_path: Path) -> None:
    watch = tmp_path / "ckpts"
    ckpt = _deepspeed_checkpoint(tmp_path, watch / "checkpoint-30", 30)
    optim = ckpt / "global_step30" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    clock = Clock()
    d = SnapshotDiscovery(watch, admit_foreign=True, quiescence_s=10.0, adoption_dir=tmp_path / "adopted",
                          clock=clock, run="svc-00000001")
    assert d.poll() == []
    clock.now = 5.0
    with open(optim, "ab") as f:  # the optimizer shard is still being written, inside a subdir
        f.write(os.urandom(4096))
    assert d.poll() == []
    clock.now = 11.0
    assert d.poll() == [], "admitted while a subdirectory was still being written"
    clock.now = 16.0
    (ref,) = d.poll()
    assert "model.safetensors" in ref.marker.files and "config.json" in ref.marker.files
    assert not any(n.startswith(("global_step", "rng_state", "trainer_state", "latest")) for n in ref.marker.files)
    with open(optim, "ab") as f:  # the trainer goes on writing what eval never loads
        f.write(os.urandom(4096))
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 30, "log_history": [1, 2, 3]}))
    assert verify_snapshot(ckpt, "full", marker=ref.marker).step == 30  # no false ckpt_corrupt
    assert not (ckpt / ".complete").exists()


def test_a_checkpoint_deleted_while_it_is_checksummed_is_silence(tmp_path: Path) -> None:
    """``save_total_limit`` rotation: a real ``rm -rf`` process deletes the checkpoint while discovery
    admits it (checksums every file), at several moments. Never an exception; never a record of a
    checkpoint that is gone."""
    watch = tmp_path / "ckpts"
    survived = 0
    for trial, delay in enumerate((0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)):
        ckpt = write_foreign_checkpoint(tmp_path, watch / f"checkpoint-{100 + trial}", 100 + trial)
        for i in range(40):  # widen the checksum window: many shards, listed in the index
            (ckpt / f"extra-{i:03d}.safetensors").write_bytes(_tiny_safetensors(256 << 10))
        clock = Clock()
        d = SnapshotDiscovery(watch, admit_foreign=True, quiescence_s=1.0, adoption_dir=tmp_path / f"adopted{trial}",
                              clock=clock)
        d.poll()
        clock.now = 2.0
        proc = subprocess.Popen(["sh", "-c", f"sleep {delay}; rm -rf '{ckpt}'"])
        try:
            refs = d.poll()  # must not raise, whenever the deletion lands
            proc.wait(30)
            refs += d.poll()
        finally:
            if proc.poll() is None:
                proc.kill()
        for ref in refs:  # admitted before the deletion: the worker's verify makes it ckpt_missing
            assert ref.step == 100 + trial
        survived += 1
    assert survived == 7


def _tiny_safetensors(nbytes: int) -> bytes:
    header = json.dumps({"x": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + os.urandom(nbytes)
