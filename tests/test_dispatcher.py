"""EvalDispatcher and AsyncExporter on real files: export, ingestion, overflow, failures, restart."""

from __future__ import annotations

import dataclasses
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ckpteval.coord.results.files import ResultIndex
from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.gc import StagingGC
from ckpteval.coord.snapshots.snapshot import MARKER, read_marker, snapshot_dirname, verify_snapshot
from ckpteval.jobs.metrics import MetricsSink
from ckpteval.jobs.reference.model import ModelConfig, build_model, save_hf_checkpoint
from ckpteval.jobs.trainer.config import DispatchConfig
from ckpteval.jobs.trainer.dispatcher import EvalDispatcher
from ckpteval.jobs.trainer.export.async_export import AsyncExporter
from tests.support.training import eval_lines, eval_step_counts, fill_results, ledger_counts, make_train_run

SMALL = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)


def _model(seed: int = 0) -> torch.nn.Module:
    return build_model(SMALL, "llama", seed=seed)


def _dispatcher(run: RunDir, dispatch: DispatchConfig, room_check=None, **waits: float) -> EvalDispatcher:
    waits.setdefault("poll_interval_s", 0.0)
    kw = {} if room_check is None else {"room_check": room_check}
    return EvalDispatcher.open(dispatch.with_waits(**waits), run, MetricsSink(run.metrics_path), run.base, **kw)


def _by_step(run_dir: Path) -> dict[int, dict]:
    return {int(r["eval/step"]): r for r in eval_lines(run_dir)}


# -- export ------------------------------------------------------------------------------------------
def test_async_export_loads_with_identical_logits_and_blocks_less_than_total(tmp_path: Path) -> None:
    run, _ = make_train_run(tmp_path / "run")
    model = build_model(ModelConfig(), "llama", seed=3)
    ids = torch.tensor([[1, 4, 11, 5, 6, 14, 7, 8, 15]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    exporter = AsyncExporter(tmp_path / "staging", run.base)
    exporter.submit(7, model)
    with torch.no_grad():  # training goes on: the snapshot must hold the weights at submit time
        for p in model.parameters():
            p.add_(1.0)
    assert exporter.wait(60)
    (outcome,) = exporter.poll()
    assert outcome.ok and outcome.path == tmp_path / "staging" / snapshot_dirname(7), outcome
    assert 0 < outcome.blocked_s < outcome.total_s
    assert verify_snapshot(outcome.path, "full").step == 7
    loaded = AutoModelForCausalLM.from_pretrained(outcome.path, use_safetensors=True).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, want)


def test_export_no_room_by_threshold_is_export_failed(tmp_path: Path) -> None:
    run, dispatch = make_train_run(tmp_path / "run", eval_interval=2)
    d = _dispatcher(run, dispatch, room_check=lambda path, n: n < 1000)  # the model needs more
    d.maybe_dispatch(2, _model())
    d.close(2, _model())
    point = _by_step(run.path)[2]
    assert point["eval/skipped_export_failed"] == 2 and "eval/addition" not in point
    assert not any(run.snapshots.iterdir())
    assert (run.path / "TRAINING_DONE").exists()


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    mnt = tmp_path / "shm"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("trust_room", [False, True], ids=["has_room-refuses", "ENOSPC-while-writing"])
def test_export_failed_on_a_full_tmpfs_and_training_goes_on(tmp_path: Path, tiny_tmpfs: Path, trust_room: bool) -> None:
    run, dispatch = make_train_run(tmp_path / "run", eval_staging_dir=tiny_tmpfs, eval_interval=2)
    kw = {"room_check": lambda path, n: True} if trust_room else {}
    d = _dispatcher(run, dispatch, **kw)
    model = build_model(ModelConfig(), "llama")  # ~2 MB of weights > the 1 MB tmpfs
    for step in range(1, 5):
        d.maybe_dispatch(step, model)
    d.close(4, model)
    points = _by_step(run.path)
    assert sorted(points) == [2, 4]
    assert all(p["eval/skipped_export_failed"] == 2 for p in points.values())
    assert [p for p in tiny_tmpfs.rglob("*") if not p.is_dir()] == []  # nothing half-written left on the tmpfs


# -- ingestion, lag, GC --------------------------------------------------------------------------------
def test_points_land_at_dispatch_step_with_lag_and_gc_keeps_newest(tmp_path: Path) -> None:
    run, dispatch = make_train_run(tmp_path / "run", eval_interval=2, eval_max_in_flight=1, eval_keep_snapshots=1)
    d = _dispatcher(run, dispatch, drain_timeout_s=0.2)
    model = _model()
    for step in range(1, 8):
        if step % 2 == 1 and step > 1:  # the fleet finishes the previous point one step late
            d.exporter.wait()
            fill_results(run, step - 1, score=0.5)
        d.maybe_dispatch(step, model)
    d.close(8, model)  # final point: dispatched at 8, nobody evaluates it -> drain timeout
    points = _by_step(run.path)
    assert [points[s]["eval/lag_steps"] for s in (2, 4, 6)] == [1, 1, 1]
    for s in (2, 4, 6):
        p = points[s]
        assert p["step"] == s and p["eval/addition"] == 0.5
        assert p["eval/addition/weight_version/mean"] == s and p["eval/addition/weight_version/mixed_version_ratio"] == 0
        assert 0 < p["eval/export_blocked_seconds"] < p["eval/export_time_seconds"]
    assert sorted(p.name for p in run.snapshots.iterdir()) == [snapshot_dirname(6), snapshot_dirname(8)]
    assert ledger_counts(run.path, "retired") == {2: 1, 4: 1, 6: 1}


def test_drain_timeout_logs_skip_but_writes_no_result(tmp_path: Path) -> None:
    run, dispatch = make_train_run(tmp_path / "run", eval_interval=4)
    d = _dispatcher(run, dispatch, drain_timeout_s=0.3)
    t0 = time.monotonic()
    d.close(3, _model())
    assert time.monotonic() - t0 < 10
    assert _by_step(run.path)[3]["eval/skipped_drain_timeout"] == 2
    assert not list(run.results.rglob("*.json"))  # units stay open for a fleet/backfill
    assert (run.snapshots / snapshot_dirname(3) / MARKER).exists()  # not retired, not collected
    assert run.training_done() == 3


# -- overflow -----------------------------------------------------------------------------------------
def test_skip_policy_records_busy_and_the_final_point_still_lands(tmp_path: Path) -> None:
    run, dispatch = make_train_run(tmp_path / "run", eval_interval=2, eval_max_in_flight=1,
                                   eval_overflow_policy="skip")
    d = _dispatcher(run, dispatch, drain_timeout_s=30)
    model = _model()
    for step in range(1, 8):
        d.maybe_dispatch(step, model)
    assert d.pending == [2]
    fleet = threading.Thread(target=lambda: (time.sleep(0.5), fill_results(run, 2), time.sleep(0.3), fill_results(run, 7)))
    fleet.start()
    d.close(7, model)  # 7 is not an interval step: the final point is dispatched anyway, never skipped
    fleet.join()
    points = _by_step(run.path)
    assert sorted(points) == [2, 4, 6, 7]
    assert points[4]["eval/skipped_busy"] == 2 and points[6]["eval/skipped_busy"] == 2
    assert points[4]["eval/lag_steps"] == 0
    assert "eval/skipped_busy" not in points[2] and points[2]["eval/addition"] == 1.0
    assert points[7]["eval/addition"] == 1.0 and "eval/skipped_drain_timeout" not in points[7]
    assert not (run.snapshots / snapshot_dirname(4)).exists()  # busy: nothing exported


def test_backpressure_waits_for_the_oldest_point(tmp_path: Path) -> None:
    run, dispatch = make_train_run(tmp_path / "run", eval_interval=2, eval_max_in_flight=1)
    d = _dispatcher(run, dispatch, backpressure_timeout_s=30)
    model = _model()
    d.maybe_dispatch(2, model)
    d.exporter.wait()
    timer = threading.Timer(1.0, fill_results, args=(run, 2))
    timer.start()
    t0 = time.monotonic()
    d.maybe_dispatch(4, model)  # blocks until point 2 lands
    waited = time.monotonic() - t0
    assert waited >= 0.9 and d.pending == [4]
    fill_results(run, 4)
    d.poll(force=True)
    d.close(4, model)
    points = _by_step(run.path)
    assert points[4]["eval/backpressure_wait_seconds"] >= 0.9 and "eval/skipped_busy" not in points[4]


def test_backpressure_timeout_skips_busy_instead_of_hanging(tmp_path: Path) -> None:
    run, dispatch = make_train_run(tmp_path / "run", eval_interval=2, eval_max_in_flight=1)
    d = _dispatcher(run, dispatch, backpressure_timeout_s=0.3, drain_timeout_s=0.1)
    model = _model()
    d.maybe_dispatch(2, model)
    t0 = time.monotonic()
    d.maybe_dispatch(4, model)
    assert 0.3 <= time.monotonic() - t0 < 5
    d.exporter.wait()
    point = _by_step(run.path)[4]
    assert point["eval/skipped_busy"] == 2 and point["eval/backpressure_wait_seconds"] >= 0.3


def test_a_stop_signal_during_the_backpressure_wait_dispatches_the_step_over_the_limit(tmp_path: Path) -> None:
    """The trainer checkpoints this step and leaves on the signal; a resumed trainer starts after it, so
    skipping it ``busy`` would lose a point whose weights exist only now: it is exported over the limit."""
    run, dispatch = make_train_run(tmp_path / "run", eval_interval=2, eval_max_in_flight=1)
    d = _dispatcher(run, dispatch, backpressure_timeout_s=30, drain_timeout_s=0.1)
    stop = threading.Event()
    d.should_stop = stop.is_set
    model = _model()
    d.maybe_dispatch(2, model)
    threading.Timer(0.5, stop.set).start()
    t0 = time.monotonic()
    d.maybe_dispatch(4, model)  # waits for point 2 until the signal, then dispatches 4 anyway
    assert 0.4 <= time.monotonic() - t0 < 10
    assert d.pending == [2, 4]
    d.exporter.wait()
    assert (run.snapshots / snapshot_dirname(4) / MARKER).exists()
    assert "eval/skipped_busy" not in _by_step(run.path).get(4, {})


# -- validation ----------------------------------------------------------------------------------------
def test_dispatcher_refuses_a_root_missing_from_run_json(tmp_path: Path) -> None:
    run, dispatch = make_train_run(tmp_path / "run")
    other = DispatchConfig(eval_interval=2, staging_dir=tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="snapshot_roots"):
        _dispatcher(run, other)
    with pytest.raises(ValueError, match="--eval-keep-snapshots"):
        _dispatcher(run, DispatchConfig(eval_interval=2, staging_dir=run.snapshots, keep_snapshots=0))


# -- reuse mode ----------------------------------------------------------------------------------------
def test_reuse_mode_marks_checkpoints_exports_nothing_and_gc_never_deletes(tmp_path: Path) -> None:
    save = tmp_path / "hf"
    run, dispatch = make_train_run(tmp_path / "run", save_hf_dir=save, save_interval=2, eval_interval=2,
                                   eval_max_in_flight=3, eval_keep_snapshots=3)
    assert run.manifest().snapshot_roots == (str(save.resolve()),)
    d = _dispatcher(run, dispatch)
    assert d.exporter is None and d.gc is None
    model = _model()
    for step in range(1, 7):
        if step in (2, 4):  # the trainer "forgets" to save 6
            save_hf_checkpoint(save, step, model)
        d.maybe_dispatch(step, model)
    for step in (2, 4):
        marker = read_marker(save / f"checkpoint-{step}")
        assert marker.mode == "reuse" and marker.step == step and "model.safetensors" in marker.files
        fill_results(run, step)
    d.close(6, model)
    points = _by_step(run.path)
    assert points[2]["eval/addition"] == 1.0 and points[4]["eval/addition"] == 1.0
    assert points[6]["eval/skipped_ckpt_missing"] == 2
    assert "eval/export_time_seconds" not in points[2]
    assert list(run.snapshots.iterdir()) == []  # zero extra export
    gc = StagingGC(save, run.leases, 5.0, keep=0)
    report = gc.collect({2, 4, 6})
    assert report.deleted == [] and (save / "checkpoint-2" / MARKER).exists()


# -- restart safety ------------------------------------------------------------------------------------
def _six_steps_dispatched(tmp_path: Path) -> tuple:
    """A run whose trainer dispatched steps 2, 4, 6 (exports finished), none ingested yet."""
    run, dispatch = make_train_run(tmp_path / "run", eval_interval=2, eval_max_in_flight=3, eval_keep_snapshots=3)
    model = _model()
    d1 = _dispatcher(run, dispatch)
    for step in range(1, 7):
        d1.maybe_dispatch(step, model)
    d1.exporter.wait()
    return run, dispatch, model, d1


def test_restart_ingests_finished_points_exactly_once(tmp_path: Path) -> None:
    run, dispatch, model, d1 = _six_steps_dispatched(tmp_path)
    d1.poll(force=True)
    fill_results(run, 2)
    d1.poll(force=True)
    assert ledger_counts(run.path, "ingested") == {2: 1}
    fill_results(run, 4)  # finished while the trainer is dead
    del d1  # SIGKILL stand-in: nothing closed

    d2 = _dispatcher(run, dispatch)  # requeued trainer, resumed from its checkpoint at step 3
    assert d2.pending == [4, 6]
    d2.maybe_dispatch(4, model)
    assert ledger_counts(run.path, "ingested") == {2: 1, 4: 1}
    assert _by_step(run.path)[4]["eval/lag_steps"] == 0
    assert d2.pending == [6]
    for step in range(5, 7):  # re-running 4..6: nothing dispatched twice
        d2.maybe_dispatch(step, model)
    assert ledger_counts(run.path, "dispatched")[6] == 1 and ledger_counts(run.path, "exported")[6] == 1  # not re-exported

    # crash window: metrics line of 6 written, trainer killed before the ledger's "ingested"
    fill_results(run, 6)
    d2.poll(force=True)
    lines = run.ledger_path.read_bytes().splitlines(keepends=True)
    assert b'"ingested"' in lines[-2] and b'"retired"' in lines[-1]
    run.ledger_path.write_bytes(b"".join(lines[:-2]))
    d3 = _dispatcher(run, dispatch)
    d3.close(6, model)
    assert eval_step_counts(run.path) == {2: 1, 4: 1, 6: 1}
    assert ledger_counts(run.path, "ingested") == {2: 1, 4: 1, 6: 1}


def test_lost_export_is_redispatched_when_reached_else_skipped_crashed(tmp_path: Path) -> None:
    run, dispatch = make_train_run(tmp_path / "run", eval_interval=2, eval_max_in_flight=3, eval_keep_snapshots=3)
    ledger = Ledger(run.ledger_path)
    for step in (2, 4):  # the trainer died mid-export of both: ledger records, no snapshots
        ledger.append("dispatched", step, mode="staging")
    d = _dispatcher(run, dispatch, drain_timeout_s=0.1)
    assert d.pending == []  # lost points do not occupy in-flight slots
    model = _model()
    d.maybe_dispatch(3, model)  # resumed at 3: step 2 will never be reached again
    d.maybe_dispatch(4, model)  # step 4 is reached again: exported now
    d.exporter.wait()
    assert (run.snapshots / snapshot_dirname(4) / MARKER).exists()
    fill_results(run, 4)
    d.close(4, model)
    points = _by_step(run.path)
    assert points[2]["eval/skipped_crashed"] == 2 and points[4]["eval/addition"] == 1.0


def test_ledger_reader_never_truncates_a_live_ledger(tmp_path: Path) -> None:
    """coord fix: only the writer repairs a torn tail; a reader (status, worker) must not cut it."""
    path = tmp_path / "ledger.jsonl"
    Ledger(path).append("dispatched", 2)
    with open(path, "ab") as f:
        f.write(b'{"event": "ingested", "st')  # an append still arriving
    reader = Ledger(path, repair=False)
    assert reader.state.pending == [2] and reader.repaired_bytes == 0
    assert path.read_bytes().endswith(b'"st')
    assert Ledger(path).repaired_bytes > 0  # the writer, on restart, repairs


def test_result_index_sees_skips_from_dispatcher(tmp_path: Path) -> None:
    run, dispatch = make_train_run(tmp_path / "run", eval_interval=2, eval_max_in_flight=1,
                                   eval_overflow_policy="skip")
    d = _dispatcher(run, dispatch, drain_timeout_s=0.1)
    d.maybe_dispatch(2, _model())
    d.maybe_dispatch(4, _model())
    d.exporter.wait()
    index = ResultIndex(run.results)
    reasons = {r.skip_reason for r in index.refresh().values()}
    assert reasons == {"busy"}


def test_point_landing_while_a_resumed_trainer_retrains_has_lag_zero_not_negative(tmp_path: Path) -> None:
    run, dispatch, model, d1 = _six_steps_dispatched(tmp_path)
    fill_results(run, 6)  # finished while the trainer is dead
    del d1

    d2 = _dispatcher(run, dispatch)  # resumed from its checkpoint at step 2
    d2.maybe_dispatch(3, model)
    d2.poll(force=True)
    assert _by_step(run.path)[6]["eval/lag_steps"] == 0


def test_gc_keeps_the_best_k_points_snapshots(tmp_path: Path) -> None:
    """``--eval-keep-best 1``: the best point's snapshot survives GC beyond the newest ``keep``; once a
    better point lands, the old best becomes an ordinary retired snapshot and is collected."""
    run, dispatch = make_train_run(tmp_path / "run", eval_interval=2, eval_max_in_flight=1, eval_keep_snapshots=1)
    dispatch = dataclasses.replace(dispatch, keep_best=1)
    d = _dispatcher(run, dispatch, drain_timeout_s=0.2)
    model = _model()
    scores = {2: 0.9, 4: 0.5, 6: 0.3, 8: 0.95, 10: 0.1}
    for step in range(1, 12):
        if step % 2 == 1 and step > 1:
            d.exporter.wait()
            fill_results(run, step - 1, score=scores[step - 1])
        d.maybe_dispatch(step, model)
        if step == 7:  # points 2, 4, 6 retired: keep the newest (6) and the best (2)
            assert sorted(p.name for p in run.snapshots.iterdir()) == [snapshot_dirname(s) for s in (2, 6)]
    d.close(12, model)
    assert sorted(p.name for p in run.snapshots.iterdir()) == [snapshot_dirname(s) for s in (8, 10, 12)]
