"""Version pinning under attack: another client keeps reloading the ``ckpteval serve`` engine a worker
scores on (``--engine http:URL``) under its own versions, and a backend reports the wrong version.
Every unit that ran on weights other than its step's is a ``pin_violation`` skip; no unit reported ok
carries any version but its own (so no point silently measures the wrong weights)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from ckpteval.coord.results.files import ResultIndex
from ckpteval.coord.run.identity import run_key, version_matches
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.snapshot import snapshot_dirname
from tests.chaos import harness
from tests.support.workers import start_serve


def _impure_ok_units(run_dir: Path) -> list[str]:
    """Units reported ok although some sample carries another version than the run's step's."""
    results = ResultIndex(Path(run_dir) / "results").refresh()
    key = run_key(RunDir.open(run_dir).manifest())
    return [u.id for u, r in results.items()
            if r.ok and not all(version_matches(v, key, u.step) for v in r.weight_versions)]


def test_rogue_reloads_and_lying_engines_are_pin_violations(tmp_path: Path, procs: harness.Procs,
                                                            request: pytest.FixtureRequest) -> None:
    points = harness.scaled(6, 40)
    rand = harness.rng("pin")
    t_start = time.monotonic()
    # (a) a shared ckpteval serve engine, reloaded by a rogue client at random moments
    trainer = harness.InProcTrainer(tmp_path / "run", eval_interval=1, n_prompts=16, shard_size=8)
    run = trainer.run
    trainer.advance(points)
    trainer.dispatcher.exporter.wait()
    trainer.dispatcher.poll(force=True)
    first = run.snapshots / snapshot_dirname(1)
    url, server = start_serve(first, "1", tmp_path / "serve.log")
    procs.all.append(server)  # type: ignore[arg-type]  # reaped by pid with the others
    fleet = harness.Fleet(procs, run.path, 1, engine=f"http:{url}", extra=["--pin-timeout", "2"])
    fleet.start_all()
    reloads = {"n": 0}
    stop = threading.Event()

    def rogue() -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            while not stop.wait(rand.uniform(0.05, 0.6)):
                body = {"model_path": str(first), "weight_version": f"rogue-{reloads['n']}"}
                if client.post("/update_weights_from_disk", json=body).status_code == 200:
                    reloads["n"] += 1

    thread = threading.Thread(target=rogue, daemon=True)
    thread.start()
    try:
        trainer.run_until(lambda: not trainer.dispatcher.pending, step_s=0.05, max_s=harness.scaled(150, 600),
                          dispatch=False)
    finally:
        stop.set()
        thread.join(60)
    trainer.close()
    codes = fleet.wait_all(60)
    ta = harness.tally(run.path, trainer.dispatched())
    impure_a = _impure_ok_units(run.path)

    # (b) an engine that reports the wrong version on every sample (fn backend, off by one)
    liar = harness.InProcTrainer(tmp_path / "run-liar", eval_interval=1)
    liar.advance(harness.scaled(2, 10))
    liar_fleet = harness.Fleet(procs, liar.run.path, 1, engine="fn:tests.chaos.backends:WrongVersionBackend",
                               name="liar")
    liar_fleet.start_all()
    liar.close()
    codes_b = liar_fleet.wait_all(60)
    tb = harness.tally(liar.run.path, liar.dispatched())
    impure_b = _impure_ok_units(liar.run.path)

    merged = ta.merged(tb, step_offset=10_000)
    harness.record(
        request.node.nodeid, "engine version changed / wrong",
        f"{reloads['n']} rogue reloads of the shared serve engine + {len(tb.expected)} points on a lying engine",
        merged, stalls=trainer.stalls + liar.stalls, max_gap_s=max(trainer.max_block, liar.max_block),
        outside_deleted=trainer.sentinel.deleted_bytes() + liar.sentinel.deleted_bytes(), wall_s=time.monotonic() - t_start,
        notes=f"shared engine: {len(ta.ok)}/{len(ta.expected)} points clean, pin_violation on "
              f"{ta.skips.get('pin_violation', 0)}; ok units carrying a foreign version: {len(impure_a) + len(impure_b)}"
              " (must be 0); lying engine: every point pin_violation",
    )
    assert codes == [0] and codes_b == [0], fleet.logs() + liar_fleet.logs()
    assert impure_a == [] and impure_b == []
    assert ta.skips.get("pin_violation", 0) >= 1, (reloads, ta)  # the rogue was caught at least once
    # a rogue reload that lands between the load and its checks is caught by the weights themselves instead
    # of by the label — attest_failed (the engine's tensors are not the snapshot's) or canary_failed (the
    # engine's log-probs on the probe are not the trainer's: http engines run the canary too) — never scored
    assert set(ta.skips) <= {"pin_violation", "attest_failed", "canary_failed"}, ta.skips
    assert tb.skips == {"pin_violation": len(tb.expected)} and tb.ok == [], tb
    assert merged.lost == [] and merged.units_without_result == [] and merged.dup_ingestions == 0, merged
    assert trainer.stalls == 0 and liar.stalls == 0
    assert trainer.sentinel.deleted_bytes() == 0 and liar.sentinel.deleted_bytes() == 0
