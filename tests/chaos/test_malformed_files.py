"""Malformed protocol files: ``run.json``, result files, ledger lines.

The rule (docs/PROTOCOL.md §2): a reader that cannot parse a file reports an error naming it and never
substitutes a default. So: a worker or ``status`` refuses a malformed ``run.json`` (exit 2, file named,
no traceback) and a trainer refuses to resume from one; a malformed ledger line makes the resume refuse
(file and line named) *without touching the ledger*, while running workers carry on; once a human fixes
the file the run completes with every point ingested exactly once. A malformed result file is left alone
by every worker (its name is taken: re-evaluating could never publish), shown by ``status``, and its
point is logged at the trainer's drain timeout (``eval/skipped_drain_timeout``, the documented rule);
temp names and ``results/duplicates/`` are ignored.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from ckpteval.coord.results.files import ResultIndex
from ckpteval.coord.run.rundir import unit_dir
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.lifecycle import EXIT_USAGE
from ckpteval.jobs.views.status.main import collect_status
from tests.chaos import harness

RUN_JSON_VARIANTS = {
    "truncated": lambda good: good[: len(good) // 2],
    "empty": lambda good: b"",
    "not an object": lambda good: b"[1, 2, 3]\n",
    "lease of the wrong type": lambda good: json.dumps(
        {**json.loads(good), "lease": {"duration_s": "sixty"}}).encode(),
    "no eval section": lambda good: json.dumps({k: v for k, v in json.loads(good).items() if k != "eval"}).encode(),
}
LEDGER_GARBAGE = [b'{"event": "ingested", "step": "ten"}\n', b"\x00\x01 not json at all\n"]


def _scoring_workers(run_dir: Path) -> set[str]:
    """The ``worker_id`` of every worker that has written a result."""
    return {str(r.worker.get("worker_id")) for r in ResultIndex(run_dir / "results").refresh().values()}


def _refused(procs: harness.Procs, proc, what: str) -> tuple[int, str]:
    code = procs.wait(proc, 120)
    return code, procs.log(proc)


def test_malformed_protocol_files(tmp_path: Path, procs: harness.Procs, request: pytest.FixtureRequest) -> None:
    t_start = time.monotonic()
    faults: dict[str, int] = {"run.json": 0, "ledger lines": 0, "result files": 0}
    problems: list[str] = []

    # -- a real trainer run with a fleet, killed mid-run --------------------------------------------------
    run_dir = tmp_path / "run"
    steps = harness.scaled(200, 400)
    args = ("--steps", str(steps), "--eval-interval", "10", "--ckpt-interval", "20", "--eval-max-in-flight", "64",
            "--eval-keep-snapshots", "64")
    trainer = procs.cli(*harness.train_argv(run_dir, *args), name="train")
    harness.wait_for(lambda: (run_dir / "run.json").exists() or trainer.poll() is not None, 60, "run.json")
    sentinel = harness.guard_outside(run_dir / "snapshots", tmp_path / "outside")
    fleet = harness.Fleet(procs, run_dir, 2, env=harness.base_env(SUMBACKEND_DELAY_S="0.1"))
    fleet.start_all()
    ingested = lambda: [r for r in harness.read_jsonl_tolerant(run_dir / "ledger.jsonl") if r["event"] == "ingested"]  # noqa: E731
    harness.wait_for(lambda: len(ingested()) >= 3 or trainer.poll() is not None, 120, "three ingested points")
    # Both workers must be running on the good run.json before it is damaged (under load one may still be
    # importing torch): wait for a result from each, the event this test relies on, not for a time.
    harness.wait_for(lambda: len(_scoring_workers(run_dir)) >= len(fleet.live()), 120, "both workers scoring")
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()

    # -- malformed run.json: workers and status refuse, the trainer does not resume -------------------------
    manifest = run_dir / "run.json"
    good = manifest.read_bytes()
    variants = list(RUN_JSON_VARIANTS.items())[: harness.scaled(2, len(RUN_JSON_VARIANTS))]
    for name, make in variants:
        manifest.write_bytes(make(good))
        faults["run.json"] += 1
        code, out = _refused(procs, procs.cli("worker", "--run-dir", str(run_dir), "--engine", harness.SUM_FN,
                                              "--once", name="worker-bad-runjson"), "worker")
        if code != EXIT_USAGE or "run.json" not in out or "Traceback" in out:
            problems.append(f"worker with {name} run.json: exit {code}: {out[-500:]}")
        code, out = _refused(procs, procs.cli("status", str(run_dir), name="status-bad-runjson"), "status")
        if code != 2 or "run.json" not in out or "Traceback" in out:
            problems.append(f"status with {name} run.json: exit {code}: {out[-500:]}")
    if harness.FULL:  # a resume on a malformed run.json must refuse and change nothing
        before = {p: p.read_bytes() for p in (manifest, run_dir / "ledger.jsonl", run_dir / "metrics.jsonl")}
        code, out = _refused(procs, procs.cli(*harness.train_argv(run_dir, *args, "--resume"), name="train-bad"),
                             "trainer")
        if code == 0 or "run.json" not in out or any(p.read_bytes() != b for p, b in before.items()):
            problems.append(f"trainer resume with a malformed run.json: exit {code}: {out[-800:]}")
    manifest.write_bytes(good)

    # -- a malformed ledger line: status and the resume refuse (naming the line), nothing is repaired ------
    ledger = run_dir / "ledger.jsonl"
    ledger_good = ledger.read_bytes()
    lines = ledger_good.splitlines(keepends=True)
    for garbage in LEDGER_GARBAGE[: harness.scaled(1, len(LEDGER_GARBAGE))]:
        bad = b"".join([*lines[:2], garbage, *lines[2:]])
        ledger.write_bytes(bad)
        faults["ledger lines"] += 1
        code, out = _refused(procs, procs.cli("status", str(run_dir), name="status-bad-ledger"), "status")
        if code != 2 or "ledger.jsonl:3" not in out:
            problems.append(f"status with a malformed ledger line: exit {code}: {out[-500:]}")
        code, out = _refused(procs, procs.cli(*harness.train_argv(run_dir, *args, "--resume"), name="train-bad"),
                             "trainer")
        if code == 0 or "ledger.jsonl:3" not in out:
            problems.append(f"trainer resume with a malformed ledger line: exit {code}: {out[-800:]}")
        if ledger.read_bytes() != bad:
            problems.append("the refused resume changed the ledger")
        if len(fleet.live()) != 2:
            problems.append(f"a worker died on the malformed ledger: {fleet.logs()}")
    ledger.write_bytes(ledger_good)  # what a human does after reading the error

    trainer = procs.cli(*harness.train_argv(run_dir, *args, "--resume"), name="train-resume")
    code = procs.wait(trainer, 300)
    fleet_codes = fleet.wait_all(120)
    ta = harness.tally(run_dir, range(10, steps + 1, 10))

    # -- malformed result files in a live run ---------------------------------------------------------------
    inproc = harness.InProcTrainer(tmp_path / "run-results", eval_interval=2, drain_timeout=4.0)
    results_dir = inproc.run.results
    planted = {
        WorkUnit(6, "addition", 0).result_name: b'{"torn',
        WorkUnit(8, "addition", 1).result_name: b'{"unit": {"step": 8}, "status": "maybe"}\n',
    }
    if harness.FULL:
        planted[WorkUnit(12, "addition", 0).result_name] = b"\xff\xfe binary junk"
        planted[WorkUnit(14, "addition", 1).result_name] = b'{"unit": {"step": 14, "dataset": "addition", ' \
            b'"shard": 1}, "status": "ok", "scores": [1.0], "weight_versions": []}\n'
    def planted_at(name: str) -> Path:  # a protocol 2 run: the unit's step directory
        return unit_dir(results_dir, WorkUnit.from_id(name[:-5]).step) / name

    for name, data in planted.items():
        planted_at(name).parent.mkdir(exist_ok=True)
        planted_at(name).write_bytes(data)
    (results_dir / ".tmp-garbage.json").write_bytes(b"{{{{")  # a temp name: ignored
    (results_dir / "duplicates").mkdir()
    (results_dir / "duplicates" / "junk.json").write_bytes(b"junk")  # audit copies: ignored
    faults["result files"] = len(planted) + 2
    broken_steps = sorted(WorkUnit.from_id(n[:-5]).step for n in planted)
    rfleet = harness.Fleet(procs, inproc.run.path, 2, env=harness.base_env(SUMBACKEND_DELAY_S="0.05"), name="r")
    rfleet.start_all()
    inproc.run_until(lambda: len(inproc.dispatched()) >= max(broken_steps) // 2 + 3, step_s=0.05, max_s=60)
    inproc.run_until(lambda: len(inproc.dispatcher.pending) <= len(broken_steps), step_s=0.05, max_s=60,
                     dispatch=False)
    status = collect_status(inproc.run.path)
    inproc.close()
    rcodes = rfleet.wait_all(60)
    tb = harness.tally(inproc.run.path, inproc.dispatched())
    untouched = all(planted_at(n).read_bytes() == d for n, d in planted.items())

    merged = ta.merged(tb, step_offset=100_000)
    harness.record(
        request.node.nodeid, "malformed run.json / ledger lines / results",
        ", ".join(f"{n} {k}" for k, n in faults.items()), merged, stalls=inproc.stalls, max_gap_s=inproc.max_block,
        outside_deleted=sentinel.deleted_bytes() + inproc.sentinel.deleted_bytes(), wall_s=time.monotonic() - t_start,
        notes=f"run.json variants: {', '.join(n for n, _ in variants)} (worker and status exit 2 naming the file"
              f"{'; the trainer refuses to resume' if harness.FULL else ''}); a malformed middle ledger line: "
              "status exits 2 and the resume refuses naming `ledger.jsonl:3` and leaves the file as it was, "
              "running workers carry on; malformed results are left alone and shown by status "
              f"({len(status['health']['malformed_results'])} listed), their points {broken_steps} logged at "
              "the drain timeout (a malformed result keeps its point in flight until then)",
    )
    assert not problems, "\n".join(problems)
    assert code == 0, procs.tail(trainer)
    assert fleet_codes == [0, 0] and rcodes == [0, 0], fleet.logs() + rfleet.logs()
    assert ta.lost == [] and set(ta.skips) <= {"crashed"} and ta.dup_ingestions == 0, ta
    assert ta.units_without_result == [], ta.units_without_result
    named = sorted(str(planted_at(n).relative_to(results_dir)) for n in planted)  # step-<N>/<unit>.json
    assert sorted(status["health"]["malformed_results"]) == named, status["health"]
    assert untouched
    assert tb.skip_steps.get("drain_timeout") == broken_steps and set(tb.skips) == {"drain_timeout"}, tb
    assert tb.lost == [] and tb.dup_ingestions == 0 and tb.units_without_result == [], tb
    assert inproc.stalls == 0, inproc.max_block
    assert sentinel.deleted_bytes() == 0 and inproc.sentinel.deleted_bytes() == 0
