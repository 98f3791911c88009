"""Helpers for the trainer-side tests: a tiny eval-fleet stand-in and metrics readers.

``python -m tests.support.training consume RUN [--delay S] [--until-done]`` is a minimal consumer that
speaks only the coord protocol: it discovers complete snapshots under ``run.json``'s snapshot roots,
claims units with :class:`ckpteval.coord.work.claims.UnitClaimer`, scores them on a real
:class:`ckpteval.jobs.eval.engines.hf.engine.HFEngine` with :func:`ckpteval.jobs.eval.kinds.generate.scoring.score_unit`, and publishes results with
:func:`ckpteval.coord.results.files.write_result`. ``--delay`` slows each unit down (to make points overlap);
``--until-done`` exits once ``TRAINING_DONE`` exists and every dispatched step has all its results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpteval.coord.atomic import read_jsonl
from ckpteval.coord.results.files import ResultIndex, ok_result, write_result
from ckpteval.coord.run.identity import run_key
from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
from ckpteval.coord.snapshots.snapshot import producer_identity
from ckpteval.coord.work.claims import UnitClaimer
from ckpteval.coord.work.units import shard_range, units_for_step
from ckpteval.jobs.trainer.config import DispatchConfig

if TYPE_CHECKING:
    from ckpteval.jobs.reference.model import ModelConfig


def make_train_run(
    run_dir: Path,
    *,
    eval_interval: int = 2,
    eval_n_prompts: int = 4,
    eval_shard_size: int = 2,
    eval_max_in_flight: int = 2,
    eval_keep_snapshots: int = 2,
    eval_overflow_policy: str = "backpressure",
    eval_fleet: str = "attached",
    eval_staging_dir: Path | None = None,
    save_hf_dir: Path | None = None,
    save_interval: int | None = None,
    lease_duration: float = 5.0,
    lease_heartbeat: float = 1.0,
    model: ModelConfig | None = None,
    eval_scorer: str = "exact",
) -> tuple[RunDir, DispatchConfig]:
    """A trainer's run dir built from the library (what any trainer integrating ckpteval writes):
    ``base/`` for the toy model, a small addition eval set, ``run.json`` listing the snapshot root; and
    the validated eval config (staging into ``RUN/snapshots`` unless a staging dir or ``--save-hf``)."""
    from ckpteval.jobs.eval.kinds.generate.evalsets import write_addition_dataset
    from ckpteval.jobs.reference.model import (  # torch: imported only when needed
        ModelConfig,
        save_base_model_dir,
    )

    run_dir = Path(run_dir)
    dispatch = DispatchConfig(
        eval_interval=eval_interval, staging_dir=eval_staging_dir, save_hf_dir=save_hf_dir, save_interval=save_interval,
        max_in_flight=eval_max_in_flight, keep_snapshots=eval_keep_snapshots, overflow_policy=eval_overflow_policy,
        fleet=eval_fleet,
    ).for_run(run_dir)
    run = RunDir.create(run_dir)
    save_base_model_dir(run.base, model or ModelConfig(), "llama")
    dataset = dataclasses.replace(write_addition_dataset(run, n=eval_n_prompts, shard_size=eval_shard_size),
                                  scorer=eval_scorer)
    manifest = RunManifest(
        run_id=re.sub(r"[^A-Za-z0-9_-]", "-", run_dir.name)[:64], eval=EvalSpec(entries=(dataset,), engine={"dtype": "float32"}),
        snapshot_roots=(), trainer={"program": "tests", **producer_identity()},
        lease=LeaseSettings(lease_duration, lease_heartbeat), created=time.time(),
    )
    root = dispatch.run_snapshot_root(run_key(manifest), run.path)  # per-run subdir of a shared staging dir
    manifest = dataclasses.replace(manifest, snapshot_roots=(str(root),))
    return RunDir.create(run.path, manifest), dispatch


def fill_results(run: RunDir, step: int, score: float = 1.0, version: str | None = None,
                 manifest: RunManifest | None = None) -> None:
    """Write an ok result for every unit of ``step`` (an instant eval fleet)."""
    manifest = manifest or run.manifest()
    for unit in units_for_step(manifest, step):
        n = len(shard_range(manifest, unit))
        write_result(run.results, ok_result(unit, [score] * n, [version or str(step)] * n))


class InstantFleet(threading.Thread):
    """A thread that fills results for every complete snapshot it discovers (engine-free)."""

    def __init__(self, run: RunDir, delay_s: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.rundir, self.delay_s = run, delay_s
        self.manifest = run.manifest()
        self.stop = threading.Event()
        self.done: set[int] = set()

    def run(self) -> None:
        discoveries = [SnapshotDiscovery(Path(root)) for root in self.manifest.snapshot_roots]
        while not self.stop.is_set():
            for ref in (r for d in discoveries for r in d.poll()):
                if ref.step not in self.done:
                    time.sleep(self.delay_s)
                    fill_results(self.rundir, ref.step, manifest=self.manifest)
                    self.done.add(ref.step)
            self.stop.wait(0.05)


def eval_lines(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "eval/step" in r]


def eval_step_counts(run_dir: Path) -> Counter[int]:
    return Counter(int(r["eval/step"]) for r in eval_lines(run_dir))


def ledger_counts(run_dir: Path, event: str) -> Counter[int]:
    return Counter(r["step"] for r in read_jsonl(Path(run_dir) / "ledger.jsonl") if r["event"] == event)


def dispatched_steps(run_dir: Path) -> set[int]:
    """Every step the trainer dispatched or skipped (the ledger's replay, as a reader sees it)."""
    return set(Ledger(RunDir(run_dir).ledger_path, repair=False).state.dispatched)


def consume(run_dir: Path, delay_s: float = 0.0, until_done: bool = True, timeout_s: float = 300.0) -> int:
    """Evaluate every unit of every complete snapshot; returns the number of results written."""
    from ckpteval.jobs.eval.engines.hf.engine import HFEngine
    from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache, score_unit

    run = RunDir.open(run_dir)
    manifest = run.manifest()
    discoveries = [SnapshotDiscovery(Path(root)) for root in manifest.snapshot_roots]
    index = ResultIndex(run.results)
    claimer = UnitClaimer(run.leases, manifest.lease, results_dir=run.results)
    cache = DatasetCache(run, manifest)
    engine = HFEngine(device="cpu")
    written = 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        index.refresh()
        refs = sorted((r for d in discoveries for r in d.poll()), key=lambda r: r.step)
        todo = [u for ref in refs for u in units_for_step(manifest, ref.step) if index.get(u) is None]
        claim = claimer.claim_first(todo)
        if claim is None:
            if until_done and run.training_done() is not None and _all_dispatched_done(run, manifest, index):
                break
            time.sleep(0.1)
            continue
        ref = next(r for r in refs if r.step == claim.unit.step)
        try:
            if engine.weight_version() != str(ref.step):
                engine.load(str(ref.path), str(ref.step))
            scores = score_unit(engine, cache, claim.unit, str(ref.path))
            time.sleep(delay_s)
            write_result(run.results, ok_result(claim.unit, scores.scores, scores.weight_versions, scores.answers,
                                                snapshot=str(ref.path), lease_token=claim.token,
                                                attempt=claim.attempt))
            written += 1
        finally:
            claim.release()
            claimer.forget(claim.unit)
    engine.close()
    return written


def _all_dispatched_done(run: RunDir, manifest: Any, index: ResultIndex) -> bool:
    index.refresh()
    return all(index.get(u) is not None for s in dispatched_steps(run.path) for u in units_for_step(manifest, s))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.training")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("consume")
    c.add_argument("run_dir", type=Path)
    c.add_argument("--delay", type=float, default=0.0)
    c.add_argument("--until-done", action="store_true")
    c.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    while not (args.run_dir / "run.json").exists():  # started before the trainer wrote it
        time.sleep(0.1)
    n = consume(args.run_dir, args.delay, args.until_done, args.timeout)
    print(json.dumps({"results_written": n}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def train_beside(run: RunDir, fleet: Any, argv: list[str]) -> int:
    """The reference trainer (in this process) with ``argv``, while ``fleet(run, stop)`` runs in a thread (an
    engine-free fleet that scores what it finds until ``stop`` is set); the trainer's exit code."""
    from ckpteval.jobs.reference.train.main import main

    stop = threading.Event()
    thread = threading.Thread(target=fleet, args=(run, stop), daemon=True)
    thread.start()
    try:
        return main(argv)
    finally:
        stop.set()
        thread.join(5)
