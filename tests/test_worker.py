"""The worker loop on the real HFEngine and real tiny-model snapshots, in this process.

Fault injection wraps the real HFEngine (subclasses that lie about their version or die); that is
the only way to make a healthy local engine misbehave on demand. Everything else is real: snapshots
published by coord, leases, result files, transformers generation on CPU.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckpteval.coord.results.files import write_point_skip
from ckpteval.coord.results.points import derive_point
from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.run.manifest import LeaseSettings
from ckpteval.coord.run.rundir import unit_dir
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.engines.base import EngineError, Generation, SamplingParams
from ckpteval.jobs.eval.engines.factory import EnginePool
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
from ckpteval.jobs.eval.worker.evaluators import EngineEvaluator
from ckpteval.jobs.eval.worker.loop import Worker
from ckpteval.jobs.eval.worker.main import run_worker
from ckpteval.jobs.eval.worker.options import WorkerOptions
from ckpteval.jobs.lifecycle import EXIT_DONE, EXIT_UNHEALTHY, EXIT_USAGE
from tests.support.workers import flip_byte, make_eval_run, publish_model, results, run_inprocess, version

QUIET = {"out": lambda _line: None}


def _opts(run_dir: Path, **kw) -> WorkerOptions:
    kw.setdefault("once", True)
    return WorkerOptions(run_dir=run_dir, poll_interval_s=0.05, pin_timeout_s=0.3, **kw)


def _engine_worker(run, engine, **kw) -> Worker:
    opts = _opts(run.path, **kw)
    cache = DatasetCache(run, run.manifest())
    return Worker(run, opts, EngineEvaluator(engine, cache, opts.pin_timeout_s, opts.load_timeout_s), **QUIET)


def test_hf_worker_end_to_end(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=6, shard_size=4, engine={"hf": {"max_batch_size": 8}})
    for step in (10, 20):
        publish_model(tmp_path, run.snapshots, step)
    lines: list[str] = []
    code, worker = run_inprocess(_opts(run.path, worker_id="hf-1"), out=lines.append)
    assert code == EXIT_DONE and len(lines) == 4
    got = results(run)
    assert sorted(got) == [WorkUnit(s, "addition", i) for s in (10, 20) for i in (0, 1)]
    for unit, r in got.items():
        assert r.ok and len(r.scores) == (4 if unit.shard == 0 else 2)
        assert set(r.weight_versions) == {version(run, unit.step)}
        assert {"verify_s", "load_s", "generate_s", "total_s"} <= set(r.timings)
        assert r.worker["worker_id"] == "hf-1" and r.worker["engine"] == "hf" and r.lease_token
        assert r.snapshot and Path(r.snapshot).name == f"step-{unit.step:010d}"
    assert not list(run.leases.rglob("*.lock"))  # every lease released
    # a second pass finds nothing and writes nothing
    code, _ = run_inprocess(_opts(run.path), **QUIET)
    assert code == EXIT_DONE and results(run) == got


def test_sharding_does_not_change_the_point_hf(tmp_path: Path) -> None:
    """Shard sizes 1, 7, N on the same weights (each run's own snapshot of one seed: a trainer stamps its
    run's key, so runs never share a marker): equal points. The scorer hashes the completion text, so
    equal scores mean equal generations; max_batch_size=1 keeps every prompt's batch identical."""
    n = 9
    points = []
    for size in (1, 7, n):
        run = make_eval_run(tmp_path, n_prompts=n, shard_size=size, name=f"r{size}",
                            scorer="tests.support.workers:completion_hash", engine={"hf": {"max_batch_size": 1}})
        publish_model(tmp_path, run.snapshots, 3)
        run_inprocess(_opts(run.path), **QUIET)
        points.append(derive_point(run.manifest(), 3, results(run)))
    assert [p.units_total for p in points] == [9, 2, 1] and all(p.complete for p in points)
    ds = [p.datasets["addition"] for p in points]
    assert ds[0] == ds[1] == ds[2] and ds[0].n == n and ds[0].mixed_version_ratio == 0


class WrongVersionOnLoad(HFEngine):
    def load(self, snapshot_dir: str, weight_version: str) -> None:
        super().load(snapshot_dir, weight_version + "0")


class VersionChangesMidUnit(HFEngine):
    """Loads correctly, then its last sample carries another version (as if reloaded mid-batch)."""

    def generate(self, prompts: list[str], params: SamplingParams) -> list[Generation]:
        out = super().generate(prompts, params)
        return out[:-1] + [Generation(out[-1].text, "999", out[-1].n_tokens)]


class VersionChangesAfterUnit(HFEngine):
    def generate(self, prompts: list[str], params: SamplingParams) -> list[Generation]:
        out = super().generate(prompts, params)
        self._version = "999"  # someone else reloaded the engine right after the batch
        return out


@pytest.mark.parametrize("engine_cls", [WrongVersionOnLoad, VersionChangesMidUnit, VersionChangesAfterUnit])
def test_lying_engine_gives_pin_violation(tmp_path: Path, engine_cls: type[HFEngine]) -> None:
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4)
    publish_model(tmp_path, run.snapshots, 5)
    assert _engine_worker(run, engine_cls()).run() == EXIT_DONE
    (r,) = results(run).values()
    assert r.skip_reason == "pin_violation", r.message


def test_pool_needs_every_engine_on_the_version(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=6, shard_size=6)
    publish_model(tmp_path, run.snapshots, 5)
    publish_model(tmp_path, run.snapshots, 6)
    pool = EnginePool([HFEngine(), HFEngine()])
    assert _engine_worker(run, pool, max_units=1).run() == EXIT_DONE
    ok = results(run)[WorkUnit(5, "addition", 0)]
    assert ok.ok and ok.weight_versions == (version(run, 5),) * 6  # both engines generated, both stamped 5
    pool.engines[1] = WrongVersionOnLoad()
    _engine_worker(run, pool).run()
    assert results(run)[WorkUnit(6, "addition", 0)].skip_reason == "pin_violation"


def test_corrupt_and_missing_snapshots_are_skips(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=2, shard_size=2)
    flipped, truncated, deleted, fine = (publish_model(tmp_path, run.snapshots, s) for s in (1, 2, 3, 4))
    flip_byte(flipped / "model.safetensors")  # inside tensor data: only a checksum sees it
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    (deleted / "model.safetensors").unlink()
    _engine_worker(run, HFEngine(), verify="full").run()
    got = {u.step: r for u, r in results(run).items()}
    assert got[1].skip_reason == "ckpt_corrupt" and "CRC-32" in got[1].message
    assert got[2].skip_reason == "ckpt_corrupt" and got[3].skip_reason == "ckpt_missing"
    assert got[4].ok


def test_bit_flip_passes_fast_verify_but_not_attestation_truncation_does_not(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=2, shard_size=2)
    flipped, truncated = (publish_model(tmp_path, run.snapshots, s) for s in (1, 2))
    flip_byte(flipped / "model.safetensors")
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 4)
    _engine_worker(run, HFEngine(), verify="fast").run()
    got = {u.step: r for u, r in results(run).items()}
    # fast verification cannot see a flipped bit inside tensor data; the engine's attestation does (#19)
    assert got[1].skip_reason == "attest_failed" and "different 1:" in got[1].message
    assert got[2].skip_reason == "ckpt_corrupt"


def test_snapshot_deleted_after_discovery_is_ckpt_missing(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=2, shard_size=2)
    publish_model(tmp_path, run.snapshots, 1)
    gone = publish_model(tmp_path, run.snapshots, 2)
    worker = _engine_worker(run, HFEngine(), max_units=1)
    assert worker.run() == EXIT_DONE  # evaluated step 1, saw step 2
    shutil.rmtree(gone)
    worker.run()
    got = {u.step: r for u, r in results(run).items()}
    assert got[1].ok and got[2].skip_reason == "ckpt_missing"


class DiesOnce(HFEngine):
    """Dies after its first unit and cannot restart once; then restarts fine."""

    def __init__(self) -> None:
        super().__init__()
        self.units = 0
        self.dead = False
        self.restart_failures = 1

    def generate(self, prompts: list[str], params: SamplingParams) -> list[Generation]:
        self.units += 1
        out = super().generate(prompts, params)
        self.dead = self.units == 1
        return out

    def healthy(self) -> bool:
        return not self.dead and super().healthy()

    def restart(self) -> None:
        if self.restart_failures:
            self.restart_failures -= 1
            raise EngineError("CUDA error: device lost (injected)")
        super().restart()
        self.dead = False


def test_engine_dying_mid_run_releases_the_unit_and_the_worker_goes_on(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=2, shard_size=2)
    for step in (1, 2, 3):
        publish_model(tmp_path, run.snapshots, step)
    engine = DiesOnce()
    assert _engine_worker(run, engine).run() == EXIT_DONE
    got = {u.step: r for u, r in results(run).items()}
    # the unit the engine died in is released (nothing written) and scored again once it is back
    assert got[1].ok and got[2].ok and got[2].attempt == 2
    assert got[3].ok and got[3].weight_versions == (version(run, 3),) * 2  # restarted, reloaded, re-probed


class NeverHealthy(HFEngine):
    def healthy(self) -> bool:
        return False


def test_persistently_dead_engine_exits_for_a_fresh_start(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=2, shard_size=2)
    for step in (1, 2, 3, 4):
        publish_model(tmp_path, run.snapshots, step)
    assert _engine_worker(run, NeverHealthy(), max_unhealthy=2).run() == EXIT_UNHEALTHY
    assert results(run) == {}  # a worker that never scored a unit burns none: all left for a healthy one
    attempts = sorted(p.name for p in run.leases.rglob("*.attempts"))
    assert len(attempts) >= 1  # its tries are counted, so a proven worker can still give up on a unit


def test_order_and_catchup(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=2, shard_size=2)
    for step in (1, 2, 3):
        publish_model(tmp_path, run.snapshots, step)
    order: list[int] = []
    worker = _engine_worker(run, HFEngine(), newest_first=True)
    worker.out = lambda line: order.append(int(line.split()[0].split("=")[1]))
    worker.run()
    assert order == [3, 2, 1]
    run2 = make_eval_run(tmp_path, n_prompts=2, shard_size=2, name="latest")
    for step in (1, 2, 3):  # its own trainer's snapshots (run's carry run's key: never run2's)
        publish_model(tmp_path, run2.snapshots, step)
    _engine_worker(run2, HFEngine(), catchup="latest").run()
    assert [u.step for u in results(run2)] == [3]


def test_fleet_waits_for_dispatched_steps_until_training_done(tmp_path: Path) -> None:
    """Fleet mode ends only when training is done and every dispatched step has results."""
    run = make_eval_run(tmp_path, n_prompts=2, shard_size=2)
    publish_model(tmp_path, run.snapshots, 1)
    ledger = Ledger(run.ledger_path)
    ledger.append("dispatched", 1)
    ledger.append("dispatched", 2)  # its export will fail
    worker = _engine_worker(run, HFEngine(), once=False)
    polls: list[int] = []

    def on_poll(outstanding: int) -> None:
        polls.append(outstanding)
        if len(polls) == 3:
            run.mark_training_done(2)
        if len(polls) == 6:  # the trainer records the failed export of step 2
            write_point_skip(run.results, run.manifest(), 2, "export_failed")

    worker.on_poll = on_poll
    assert worker.run() == EXIT_DONE
    assert len(polls) >= 7 and polls[3:6] == [1, 1, 1]  # waited on step 2 while it had no result
    assert {u.step: r.skip_reason for u, r in results(run).items()} == {1: None, 2: "export_failed"}


def test_malformed_result_is_left_alone(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=2)
    publish_model(tmp_path, run.snapshots, 1)
    bad = unit_dir(run.results, 1) / f"{WorkUnit(1, 'addition', 0).id}.json"
    bad.parent.mkdir()
    bad.write_text("{torn")
    assert _engine_worker(run, HFEngine()).run() == EXIT_DONE
    assert bad.read_text() == "{torn" and [u.shard for u in results(run)] == [1]
    assert not (run.results / "duplicates").exists()


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_worker(_opts(tmp_path / "nope")) == EXIT_USAGE
    assert "no run.json" in capsys.readouterr().err
    run = make_eval_run(tmp_path, n_prompts=2, shard_size=2)
    obj = json.loads(run.manifest_path.read_text())
    obj["eval"]["adapters"] = [{"name": "lora-a", "path": "/adapters/a"}]
    run.manifest_path.write_text(json.dumps(obj))
    assert run_worker(_opts(run.path)) == EXIT_USAGE
    assert "bare base weights" in capsys.readouterr().err
    (run.data / "addition.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert run_worker(_opts(run.path, engines=("fn:tests.support.workers:SumBackend",))) == EXIT_USAGE
    assert "n_prompts=2" in capsys.readouterr().err


def test_lease_settings_come_from_the_run(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=2, shard_size=2, lease=LeaseSettings(4.0, 1.0))
    worker = _engine_worker(run, HFEngine())
    assert worker.claimer.settings == LeaseSettings(4.0, 1.0)


def test_http_engine_pins_through_a_real_server(tmp_path: Path) -> None:
    """``--engine http:URL`` against ``ckpteval serve``: versions read back from the server; a second
    client reloading the shared server mid-unit makes that unit a pin_violation."""
    from tests.support.workers import RELOAD, start_serve

    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4)
    first = publish_model(tmp_path, run.snapshots, 1)
    url, proc = start_serve(first, "0", tmp_path / "serve.log")
    try:
        code, _ = run_inprocess(_opts(run.path, engines=(f"http:{url}",)), **QUIET)
        assert code == EXIT_DONE
        (ok,) = results(run).values()
        assert ok.ok and ok.weight_versions == (version(run, 1),) * 4 and ok.worker["engine"] == f"http:{url}"
        publish_model(tmp_path, run.snapshots, 2)
        obj = json.loads(run.manifest_path.read_text())
        obj["eval"]["datasets"][0]["scorer"] = "tests.support.workers:reloading_scorer"
        run.manifest_path.write_text(json.dumps(obj))
        RELOAD.update(url=url, snapshot=str(first))
        run_inprocess(_opts(run.path, engines=(f"http:{url}",)), **QUIET)
        bad = results(run)[WorkUnit(2, "addition", 0)]
        assert RELOAD["fired"] and bad.skip_reason == "pin_violation" and "'999'" in bad.message
    finally:
        proc.terminate()
        proc.wait(timeout=20)
