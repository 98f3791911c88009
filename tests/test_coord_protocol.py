"""Discovery, results/points, ledger, GC and config validation — real files, no mocks."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ckpteval.coord.snapshots.discovery as discovery_mod
from ckpteval.coord.results.files import ResultIndex, ok_result, skip_result, write_point_skip, write_result
from ckpteval.coord.results.points import derive_point, point_metrics
from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
from ckpteval.coord.snapshots.gc import CaptureGC, StagingGC, has_room
from ckpteval.coord.snapshots.snapshot import mark_complete, publish_snapshot
from ckpteval.coord.work.claims import order_units
from ckpteval.coord.work.units import WorkUnit, units_for_step
from ckpteval.jobs.trainer.config import DispatchConfig, filesystem_type
from tests.support.runs import make_run, write_tiny_shards


# -- discovery ---------------------------------------------------------------------------------------
def test_discovery_reads_each_marker_once_and_forgets_deleted(tmp_path: Path, monkeypatch) -> None:
    for step in (10, 20, 30):
        publish_snapshot(tmp_path, step, lambda d: write_tiny_shards(d, n_shards=1, numel=8))
    reads: list[Path] = []
    real = discovery_mod.read_marker
    monkeypatch.setattr(discovery_mod, "read_marker", lambda p: reads.append(p) or real(p))
    disc = SnapshotDiscovery(tmp_path)
    assert [r.step for r in disc.poll()] == [10, 20, 30]
    assert len(reads) == 3
    assert [r.step for r in disc.poll()] == [10, 20, 30]
    assert len(reads) == 3  # idle poll: no marker re-read
    shutil.rmtree(tmp_path / "step-0000000020")
    assert [r.step for r in disc.poll()] == [10, 30]


def test_discovery_never_trusts_links_or_misnamed_snapshots(tmp_path: Path) -> None:
    elsewhere = publish_snapshot(tmp_path / "elsewhere", 7, lambda d: write_tiny_shards(d, n_shards=1, numel=8))
    root = tmp_path / "staging"
    publish_snapshot(root, 10, lambda d: write_tiny_shards(d, n_shards=1, numel=8))
    os.symlink(elsewhere, root / "step-0000000020")  # a link planted under a future step's name
    shutil.copytree(elsewhere, root / "step-0000000030")  # a step-7 snapshot copied under step 30's name
    assert [r.step for r in SnapshotDiscovery(root).poll()] == [10]
    with pytest.raises(FileExistsError, match="not this run's step 20"):
        publish_snapshot(root, 20, lambda d: write_tiny_shards(d, n_shards=1, numel=8))


def _foreign_checkpoint(root: Path, step: int, shards: int = 2, write_all: bool = True) -> Path:
    ckpt = root / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    write_tiny_shards(ckpt, n_shards=shards, numel=16)
    index = {"metadata": {}, "weight_map": {f"w{i}": f"model-{i:05d}.safetensors" for i in range(shards + 1)}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    if write_all:
        write_tiny_shards_extra(ckpt, shards)
    return ckpt


def write_tiny_shards_extra(ckpt: Path, i: int) -> None:
    save_file({f"w{i}": torch.zeros(4)}, str(ckpt / f"model-{i:05d}.safetensors"))


def test_foreign_checkpoint_admitted_only_after_quiescence_and_all_shards(tmp_path: Path) -> None:
    now = [0.0]
    watch, adopted = tmp_path / "ckpts", tmp_path / "adopted"
    disc = SnapshotDiscovery(watch, admit_foreign=True, quiescence_s=30, adoption_dir=adopted, clock=lambda: now[0])
    ckpt = _foreign_checkpoint(watch, 500, write_all=False)  # index names a shard not yet written
    assert disc.poll() == []
    now[0] = 100.0
    assert disc.poll() == []  # quiet, but a shard named by the index is missing
    write_tiny_shards_extra(ckpt, 2)
    now[0] = 110.0
    assert disc.poll() == []  # it changed: the quiet window restarts
    now[0] = 139.0
    assert disc.poll() == []
    now[0] = 141.0
    refs = disc.poll()
    assert [(r.step, r.foreign) for r in refs] == [(500, True)]
    assert not (ckpt / ".complete").exists()  # the foreign dir is never written to
    assert (adopted / "0000000500.json").exists()
    # a new process finds the adoption record at once, no second quiescence wait
    assert [r.step for r in SnapshotDiscovery(watch, admit_foreign=True, adoption_dir=adopted).poll()] == [500]


def test_foreign_temp_dirs_never_admitted(tmp_path: Path) -> None:
    now = [0.0]
    disc = SnapshotDiscovery(tmp_path, admit_foreign=True, quiescence_s=1, adoption_dir=tmp_path / "a",
                             clock=lambda: now[0])
    (tmp_path / "tmp-checkpoint-500").mkdir()
    write_tiny_shards(tmp_path / "tmp-checkpoint-500", n_shards=1)
    (tmp_path / "tmp-checkpoint-500" / "model-00000.safetensors").rename(
        tmp_path / "tmp-checkpoint-500" / "model.safetensors")
    disc.poll()
    now[0] = 100.0
    assert disc.poll() == []


def test_foreign_dirs_ignored_without_admission(tmp_path: Path) -> None:
    _foreign_checkpoint(tmp_path, 7)
    assert SnapshotDiscovery(tmp_path).poll() == []


def test_step_from_trainer_state(tmp_path: Path) -> None:
    d = tmp_path / "final"
    d.mkdir()
    (d / "trainer_state.json").write_text('{"global_step": 321}')
    assert discovery_mod.step_from_dir(d) == 321


# -- results and points ------------------------------------------------------------------------------
def test_point_is_independent_of_sharding(tmp_path: Path) -> None:
    scores = [float(i % 3 == 0) for i in range(12)]
    points = []
    for shard_size in (1, 5, 12):
        run = make_run(tmp_path / str(shard_size), n_prompts=12, shard_size=shard_size)
        manifest = run.manifest()
        for unit in units_for_step(manifest, 40):
            lo = unit.shard * shard_size
            chunk = scores[lo : lo + shard_size]
            write_result(run.results, ok_result(unit, chunk, ["40"] * len(chunk)))
        results = ResultIndex(run.results).refresh()
        points.append(derive_point(manifest, 40, results))
    assert all(p.complete for p in points)
    assert {p.datasets["add"].score for p in points} == {sum(scores) / 12}
    assert points[0].units_total == 12 and points[2].units_total == 1


def test_first_result_wins_and_duplicates_are_kept_aside(tmp_path: Path) -> None:
    run = make_run(tmp_path, n_prompts=2, shard_size=2)
    unit = WorkUnit(5, "add", 0)
    assert write_result(run.results, ok_result(unit, [1.0, 1.0], ["5", "5"], lease_token="a"))
    assert not write_result(run.results, ok_result(unit, [0.0, 0.0], ["5", "5"], lease_token="b"))
    index = ResultIndex(run.results)
    assert index.refresh()[unit].lease_token == "a"
    assert len(os.listdir(run.results / "duplicates")) == 1


def test_weight_version_metrics_and_skips(tmp_path: Path) -> None:
    run = make_run(tmp_path, n_prompts=4, shard_size=2, datasets=("add", "mul"))
    m = run.manifest()
    write_result(run.results, ok_result(WorkUnit(9, "add", 0), [1, 0], ["9", "9"]))
    write_result(run.results, ok_result(WorkUnit(9, "add", 1), [1, 1], ["9", "8"]))
    write_result(run.results, ok_result(WorkUnit(9, "mul", 0), [1, 1], ["9", "9"]))
    index = ResultIndex(run.results)
    assert not derive_point(m, 9, index.refresh()).complete
    write_result(run.results, skip_result(WorkUnit(9, "mul", 1), "pin_violation", "engine said 8"))
    point = derive_point(m, 9, index.refresh())
    metrics = point_metrics(point)
    assert point.complete and metrics["eval/step"] == 9
    assert metrics["eval/add"] == 0.75
    assert metrics["eval/add/weight_version/mean"] == pytest.approx(8.75)
    assert metrics["eval/add/weight_version/mixed_version_ratio"] == 0.25
    assert "eval/mul" not in metrics and metrics["eval/skipped_pin_violation"] == 1


def test_malformed_result_is_reported_not_trusted(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    (run.results / "step-0000000001").mkdir()
    (run.results / "step-0000000001" / "0000000001.add.00000.json").write_text('{"unit": {"step": 1}}')
    index = ResultIndex(run.results)
    assert index.refresh() == {}
    assert "malformed result" in index.errors["step-0000000001/0000000001.add.00000.json"]


def test_point_skip_covers_every_unit(tmp_path: Path) -> None:
    run = make_run(tmp_path, n_prompts=10, shard_size=3)
    write_point_skip(run.results, run.manifest(), 50, "busy")
    point = derive_point(run.manifest(), 50, ResultIndex(run.results).refresh())
    assert point.complete and point.skips == {"busy": 4} and point.datasets == {}


def test_claim_order(tmp_path: Path) -> None:
    units = [WorkUnit(s, "a", 0) for s in (30, 10, 20)]
    assert [u.step for u in order_units(units)] == [10, 20, 30]
    assert [u.step for u in order_units(units, newest_first=True)] == [30, 20, 10]
    shards = [WorkUnit(s, "a", i) for s in (1, 2) for i in range(16)]
    by_worker = [order_units(shards, spread=pid) for pid in (101, 202)]
    assert all([u.step for u in order] == [1] * 16 + [2] * 16 for order in by_worker)  # steps still in order
    assert by_worker[0][0] != by_worker[1][0]  # two workers start a step on different units


# -- ledger ------------------------------------------------------------------------------------------
def test_ledger_replay_and_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    led = Ledger(path)
    led.append("dispatched", 10, snapshot="/x")
    led.append("ingested", 10)
    led.append("dispatched", 20, snapshot="/y")
    with open(path, "ab") as f:
        f.write(b'{"event": "ingested", "st')  # crash mid-append
    again = Ledger(path)
    assert again.repaired_bytes > 0
    assert again.state.ingested == {10} and again.state.pending == [20]
    again.append("ingested", 20)
    assert Ledger(path).state.pending == [] and path.read_bytes().endswith(b"\n")


def test_ledger_malformed_middle_line_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    path.write_text('{"event": "dispatched", "step": 1}\nnot json\n{"event": "ingested", "step": 1}\n')
    with pytest.raises(ValueError, match=r"ledger.jsonl:2: malformed ledger line"):
        Ledger(path)


# -- GC ----------------------------------------------------------------------------------------------
RUN = "test-run-00000001"  # the run key a trainer stamps its staging markers with (GC spares run-less ones)


def test_gc_never_follows_symlinks_outside_and_keeps_newest(tmp_path: Path) -> None:
    root, leases = tmp_path / "staging", tmp_path / "leases"
    leases.mkdir()
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data.bin").write_bytes(b"do not delete")
    for step in (1, 2, 3, 4):
        publish_snapshot(root, step, lambda d: write_tiny_shards(d, n_shards=1, numel=8), run=RUN)
    os.symlink(outside, root / "step-0000000099")  # planted link to a dir outside
    os.symlink(outside, root / "step-0000000003" / "escape")  # and one inside a snapshot
    gc = StagingGC(root, leases, lease_duration_s=30, keep=1, run=RUN)
    report = gc.collect(retired_steps={1, 2, 3, 4, 99})
    assert sorted(p.name for p in report.deleted) == ["step-0000000001", "step-0000000002", "step-0000000003"]
    assert [p.name for p in report.kept] == ["step-0000000004"]
    assert (outside / "data.bin").read_bytes() == b"do not delete"
    assert (root / "step-0000000099").is_symlink()


def test_gc_spares_live_leases_until_seen_expired(tmp_path: Path) -> None:
    root, leases = tmp_path / "staging", tmp_path / "leases"
    leases.mkdir()
    publish_snapshot(root, 1, lambda d: write_tiny_shards(d, n_shards=1, numel=8), run=RUN)
    (leases / "step-0000000001").mkdir()
    (leases / "step-0000000001" / "0000000001.add.00000.lock").write_text("held")
    now = [0.0]
    gc = StagingGC(root, leases, lease_duration_s=30, keep=0, clock=lambda: now[0], run=RUN)
    assert gc.collect({1}).deleted == []
    now[0] = 29.0
    assert gc.collect({1}).deleted == []
    now[0] = 31.0  # unchanged for a whole lease duration on our clock: expired
    assert [p.name for p in gc.collect({1}).deleted] == ["step-0000000001"]


def test_gc_never_touches_reused_or_unmarked(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    reused = root / "checkpoint-10"
    reused.mkdir(parents=True)
    write_tiny_shards(reused, n_shards=1, numel=8)
    mark_complete(reused, 10)
    (root / "someones-data").mkdir()
    report = StagingGC(root, tmp_path, lease_duration_s=1, keep=0).collect({10})
    assert report.deleted == [] and reused.exists() and (root / "someones-data").exists()


def test_capture_gc_deletes_final_captures_only_inside_the_runs_captured_dir(tmp_path: Path) -> None:
    """RUN/captured/ (prime-rl broadcasts captured before the trainer's cleanup): a final step's capture is
    deleted; a step not final, a live lease, a planted symlink (its target outside survives), a dir that is
    no capture and a fresh temp capture are left alone."""
    root, leases = tmp_path / "run" / "captured", tmp_path / "run" / "leases"
    leases.mkdir(parents=True)
    for step in (2, 4, 6):
        (capture := root / f"step_{step:010d}").mkdir(parents=True)
        write_tiny_shards(capture, n_shards=1, numel=8)
    outside = tmp_path / "broadcasts" / "step_8"
    outside.mkdir(parents=True)
    (outside / "model.safetensors").write_bytes(b"the trainer's")
    os.symlink(outside, root / "step_0000000008")  # planted under a capture's name
    (root / "notes").mkdir()
    (root / ".tmp-step_0000000010-123").mkdir()  # a capture being taken right now
    (leases / "step-0000000004").mkdir()
    (leases / "step-0000000004" / "0000000004.add.00000.lock").write_text("held")
    now = [0.0]
    gc = CaptureGC(root, leases, lease_duration_s=30, clock=lambda: now[0])
    report = gc.collect({2, 4, 8})
    assert [p.name for p in report.deleted] == ["step_0000000002"]
    assert (root / "step_0000000004").is_dir() and (root / "step_0000000006").is_dir()  # leased; not final
    assert (outside / "model.safetensors").read_bytes() == b"the trainer's" and (root / "step_0000000008").is_symlink()
    assert (root / "notes").is_dir() and (root / ".tmp-step_0000000010-123").is_dir()
    reasons = dict((p.name, why) for p, why in report.refused)
    assert "symlink" in reasons["step_0000000008"] and "live lease" in reasons["step_0000000004"]
    now[0] = 31.0  # the lease unchanged for a whole lease duration: expired
    assert [p.name for p in gc.collect({2, 4, 8}).deleted] == ["step_0000000004"]


def test_has_room(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    assert has_room(tmp_path, 1024)
    assert not has_room(tmp_path, free)


# -- config --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eval_interval": None, "staging_dir": "/tmp/s"}, "eval_interval .* positive integer"),
        ({"eval_interval": 0}, r"eval_interval \(--eval-interval\) must be >= 1"),
        ({"eval_interval": 10, "staging_dir": "/tmp/s", "save_hf_dir": "/tmp/h", "save_interval": 5}, "choose"),
        ({"eval_interval": 10, "staging_dir": "/tmp/s", "max_in_flight": 3, "keep_snapshots": 2}, "keep-snapshots"),
        ({"eval_interval": 10, "save_hf_dir": "/tmp/h", "save_interval": 4}, "multiple of --save-interval"),
        ({"eval_interval": 10, "save_hf_dir": "/tmp/h"}, "needs --save-interval"),
        ({"eval_interval": 10, "staging_dir": "/tmp/s", "overflow_policy": "drop"}, "overflow-policy"),
        (
            {"eval_interval": 10, "staging_dir": "/dev/shm/ck", "trainer_nodes": ("n1",), "fleet_nodes": ("n2",)},
            "node-local",
        ),
    ],
)
def test_dispatch_config_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DispatchConfig(**kwargs).for_run(Path("/tmp/run"))


def test_dispatch_config_accepts_and_resolves(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = DispatchConfig(eval_interval=10, staging_dir=Path("rel/staging")).for_run(tmp_path / "run")
    assert cfg.staging_dir == tmp_path / "rel" / "staging" and cfg.mode == "staging"
    assert DispatchConfig().for_run(Path("run")).staging_dir == tmp_path / "run" / "snapshots"  # the default
    same_node = DispatchConfig(eval_interval=10, staging_dir=Path("/dev/shm/ck"), trainer_nodes=("n1",),
                               fleet_nodes=("n1",))
    same_node.for_run(tmp_path)
    reuse = DispatchConfig(eval_interval=10, save_hf_dir=tmp_path, save_interval=5).for_run(tmp_path)
    assert reuse.mode == "reuse"


def test_filesystem_type_of_dev_shm() -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine")
    assert filesystem_type(Path("/dev/shm/does/not/exist")) == "tmpfs"


NEW_STYLE_LEDGER = [
    {"event": "dispatched", "step": 2, "mode": "staging", "backpressure_wait_seconds": 0.0},
    {"event": "exported", "step": 2, "export_time_seconds": 1.5, "export_blocked_seconds": 0.25,
     "snapshot": "/s/step-0000000002"},
    {"event": "dispatched", "step": 4, "mode": "staging", "backpressure_wait_seconds": 0.0},
    {"event": "skipped", "step": 4, "mode": "staging", "export_time_seconds": 0.5, "export_blocked_seconds": 0.25,
     "reason": "export_failed", "message": "full"},
    {"event": "skipped", "step": 6, "mode": "staging", "backpressure_wait_seconds": 3.0, "reason": "busy",
     "message": "4 points in flight"},
    {"event": "dispatched", "step": 8, "mode": "staging", "backpressure_wait_seconds": 0.0},
    {"event": "exported", "step": 8, "snapshot": "/s/step-0000000008"},
    {"event": "evaluated_shared", "step": 8, "shared_eval_seconds": 2.0},
    {"event": "ingested", "step": 2, "outcome": "complete"},
    {"event": "retired", "step": 2},
]


def test_ledger_replay_folds_each_steps_events_into_one_record(tmp_path: Path) -> None:
    """Replay folds a step's dispatch, export, shared eval and skip events into the step's facts."""
    path = tmp_path / "ledger.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in NEW_STYLE_LEDGER))
    state = Ledger(path).state
    assert state.pending == [4, 6, 8] and state.ingested == state.retired == {2}
    assert state.skipped == {4: ("export_failed", "full"), 6: ("busy", "4 points in flight")}
    facts = {step: {k: rec.get(k) for k in ("mode", "snapshot", "export_time_seconds", "backpressure_wait_seconds",
                                             "shared_eval_seconds")} for step, rec in state.dispatched.items()}
    assert facts == {
        2: {"mode": "staging", "snapshot": "/s/step-0000000002", "export_time_seconds": 1.5,
            "backpressure_wait_seconds": 0.0, "shared_eval_seconds": None},
        4: {"mode": "staging", "snapshot": None, "export_time_seconds": 0.5, "backpressure_wait_seconds": 0.0,
            "shared_eval_seconds": None},
        6: {"mode": "staging", "snapshot": None, "export_time_seconds": None, "backpressure_wait_seconds": 3.0,
            "shared_eval_seconds": None},
        8: {"mode": "staging", "snapshot": "/s/step-0000000008", "export_time_seconds": None,
            "backpressure_wait_seconds": 0.0, "shared_eval_seconds": 2.0},
    }
