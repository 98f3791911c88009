"""Issue 11 §4 (trainer side): the final point is never skipped, a trainer without a fleet never
waits for one, and SIGUSR1/SIGTERM end every wait of the trainer.

The reference trainer runs for real (``ckpteval train``, in-process or as a subprocess receiving
real signals); no eval fleet runs, so every wait is a wait for results that never come.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from ckpteval.coord.results.files import ResultIndex
from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import units_for_step
from ckpteval.jobs.metrics import MetricsSink
from ckpteval.jobs.reference.model import ModelConfig, build_model, save_hf_checkpoint
from ckpteval.jobs.reference.train.main import main as train_main
from ckpteval.jobs.trainer.dispatcher import EvalDispatcher
from tests.support.training import eval_lines, fill_results, make_train_run
from tests.support.workers import finish, spawn, wait_for

SMALL = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)


def _reuse_argv(tmp: Path, steps: int, *extra: str) -> list[str]:
    return ["--run-dir", str(tmp / "run"), "--steps", str(steps), "--batch-size", "8", "--threads", "1",
            "--no-progress", "--ckpt-interval", "1000", "--eval-interval", "2", "--save-hf", str(tmp / "hf"),
            "--save-interval", "2", "--eval-max-in-flight", "1", "--eval-keep-snapshots", "1",
            "--eval-n-prompts", "4", "--eval-shard-size", "2", "--eval-poll-interval", "0.05",
            "--lease-duration", "5", "--lease-heartbeat", "1", "--no-eval-at-start", *extra]  # waits, not step 0


@pytest.mark.parametrize("steps", [4, 5], ids=["steps%interval==0", "steps%interval!=0"])
def test_the_final_point_is_never_skipped(tmp_path: Path, steps: int) -> None:
    """Reuse mode, no fleet, a short backpressure bound: earlier points may be skipped busy, the
    final one never is — it stays open for a backfill (its units have no result at all)."""
    code = train_main(_reuse_argv(tmp_path, steps, "--eval-backpressure-timeout", "0.2",
                                  "--eval-drain-timeout", "0.2"))
    assert code == 0
    run = RunDir.open(tmp_path / "run")
    assert run.training_done() == steps
    record = Ledger(run.ledger_path, repair=False).state.dispatched[steps]
    assert "skipped" not in record, f"the final point was skipped: {record}"
    index = ResultIndex(run.results).refresh()
    assert not [u for u in units_for_step(run.manifest(), steps) if u in index]  # open for a backfill
    assert (tmp_path / "hf" / f"checkpoint-{steps}" / ".complete").is_file()


def test_a_trainer_without_a_fleet_never_waits_and_points_stay_pending(tmp_path: Path) -> None:
    """``--eval-fleet none`` with a backpressure bound far longer than the test's timeout: training
    runs through, nothing is skipped busy, every point stays pending for a backfill."""
    proc = spawn("train", *_reuse_argv(tmp_path, 6, "--eval-fleet", "none", "--eval-backpressure-timeout", "600",
                                       "--eval-drain-timeout", "600"))
    code, out = finish(proc, 120)
    assert code == 0, out
    run = RunDir.open(tmp_path / "run")
    state = Ledger(run.ledger_path, repair=False).state
    assert sorted(state.dispatched) == [2, 4, 6]
    assert not [s for s, r in state.dispatched.items() if r.get("skipped")]
    assert sorted(state.pending) == [2, 4, 6] and not state.ingested


def test_a_backfill_landing_while_training_runs_is_ingested_without_a_fleet(tmp_path: Path) -> None:
    save = tmp_path / "hf"
    run, dispatch = make_train_run(tmp_path / "run", save_hf_dir=save, save_interval=2, eval_interval=2,
                                   eval_max_in_flight=1, eval_keep_snapshots=1, eval_fleet="none")
    d = EvalDispatcher.open(dispatch.with_waits(poll_interval_s=0.0, backpressure_timeout_s=600.0), run,
                       MetricsSink(run.metrics_path), run.base)
    model = build_model(SMALL, "llama")
    for step in range(1, 5):
        if step % 2 == 0:
            save_hf_checkpoint(save, step, model)
        d.maybe_dispatch(step, model)
    fill_results(run, 2)  # a backfill finished step 2 meanwhile
    d.maybe_dispatch(5, model)
    assert [int(m["eval/step"]) for m in eval_lines(run.path)] == [2]
    assert d.pending == [4]


def _spawn_trainer(tmp: Path, *extra: str):
    return spawn("train", "--run-dir", str(tmp / "run"), "--batch-size", "8", "--threads", "1", "--no-progress",
                 "--ckpt-interval", "1000", "--eval-interval", "2", "--eval-max-in-flight", "1",
                 "--eval-keep-snapshots", "1", "--eval-n-prompts", "4", "--eval-shard-size", "2",
                 "--eval-poll-interval", "0.05", "--no-eval-at-start", *extra)  # waits, not step 0


WAITS = {
    # step 2 pending (no fleet), step 4 waits for a slot for up to 600 s
    "backpressure": (["--steps", "50", "--eval-backpressure-timeout", "600"], lambda run: 2 in _dispatched(run)),
    # training done, then the drain waits up to 600 s for the final point
    "drain": (["--steps", "2", "--eval-drain-timeout", "600"], lambda run: run.training_done() is not None),
}


def _dispatched(run_dir: Path) -> set[int]:
    path = run_dir / "ledger.jsonl"
    return set(Ledger(path, repair=False).state.dispatched) if path.is_file() else set()


@pytest.mark.parametrize("wait", sorted(WAITS))
@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_a_stop_signal_ends_every_trainer_wait(tmp_path: Path, wait: str, signum: int) -> None:
    """A trainer in a 600 s wait exits well before it on SIGUSR1/SIGTERM (the test's own bound is
    60 s); preempted mid-training it exits 75 with a training checkpoint, in the drain 0 (done)."""
    argv, in_wait = WAITS[wait]
    proc = _spawn_trainer(tmp_path, *argv)
    run_dir = tmp_path / "run"
    try:
        wait_for(lambda: (run_dir / "run.json").is_file() and in_wait(run_dir if wait == "backpressure" else
                                                                      RunDir(run_dir)), 120, what=f"{wait} wait")
        time.sleep(1.0)  # inside the wait now
        proc.send_signal(signum)
        code, out = finish(proc, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if wait == "backpressure":
        assert code == 75 and "preempted" in out, out
        assert sorted(p.name for p in (run_dir / "train_ckpt").iterdir())
        assert RunDir(run_dir).training_done() is None
    else:
        assert code == 0, out


def test_a_stop_signal_ends_the_final_export_wait_and_training_is_not_marked_done(tmp_path: Path) -> None:
    """``close`` waits for the final snapshot's export (a real ~200 MB export); a real SIGUSR1 to
    this process ends that wait: ``close`` returns False, TRAINING_DONE is not written (the snapshot
    is not published yet), and the export itself still completes in the background."""
    import threading

    big = ModelConfig(num_layers=4, hidden_size=1024, num_heads=8, num_kv_heads=8, intermediate_size=4096)
    run, dispatch = make_train_run(tmp_path / "run", eval_interval=2)
    got: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, _frame: got.append(signum))
    d = EvalDispatcher.open(dispatch.with_waits(poll_interval_s=0.0), run, MetricsSink(run.metrics_path), run.base,
                       should_stop=lambda: bool(got))
    model = build_model(big, "llama")
    timer = threading.Timer(0.05, lambda: __import__("os").kill(__import__("os").getpid(), signal.SIGUSR1))
    try:
        timer.start()
        finished = d.close(2, model)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert got == [signal.SIGUSR1]
    if finished:  # the export beat the signal on this machine: nothing to interrupt
        pytest.skip("the final export finished before the signal arrived")
    assert run.training_done() is None
    assert d.exporter is not None and d.exporter.wait(120)


def test_a_stop_signal_ends_the_shared_postures_wait_for_producers(tmp_path: Path) -> None:
    """Shared posture: a producer request stays in flight (a real thread inside ``gate.submission()``);
    ``paused`` waiting for it (bound 600 s) ends as soon as the stop flag is set, and reopens the gate."""
    import threading

    from ckpteval.jobs.trainer.gate import ProducerGate, StopRequested

    gate = ProducerGate()
    release, started = threading.Event(), threading.Event()

    def producer() -> None:
        with gate.submission():
            started.set()
            release.wait(60)

    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    assert started.wait(10)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    with pytest.raises(StopRequested):
        with gate.paused(600.0, should_stop=stop.is_set):
            raise AssertionError("the gate was taken while a producer was in flight")
    assert not gate.is_paused
    release.set()
    thread.join(10)
