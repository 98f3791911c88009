"""The requeue matrix (issue 16): every posture and option that changes where files go × every way a job is
restarted. Each cell is real processes — ``ckpteval train`` / ``worker`` / ``backfill`` with the fn backend
(:class:`tests.support.workers.SumBackend`, scores from the snapshot's real safetensors), killed with real
signals and started again with the *identical* command line — and asserts: training (or the evaluation)
finishes, every point is logged exactly once, nothing is lost (every unit of every point has its result).

Postures (what changes where files go):

=================  =======================================================================================
``staging-run``    fleet + staging in ``RUN/snapshots`` (the default)
``staging-dir``    fleet + ``--eval-staging-dir`` in an explicit dir (run.json lists ``<dir>/<run key>``)
``staging-shm``    fleet + ``--eval-staging-dir /dev/shm/...`` (the design's tmpfs posture)
``reuse``          fleet + ``--save-hf DIR --save-interval N`` (the HF checkpoints are the snapshots)
``shared``         ``--eval-posture shared``: the trainer evaluates in-process; there is no worker, so the
                   *worker-sigkill* mode does not apply (no cell)
``lora``           fleet + ``--lora``: snapshots are adapters over ``RUN/base``
``sampled+sparse`` fleet + ``--eval-config`` with a sampled dataset (``n_samples`` 2, temperature 1) and a
                   sparse one (``every``: every second point)
``service``        ``ckpteval worker --watch DIR --eval-config F --wandb`` (offline) over marker-less
                   checkpoints this test writes as a foreign trainer would; there is no ckpteval trainer:
                   *sigkill-resume* restarts the SIGKILLed service with its identical command, *usr1-requeue*
                   sends it SIGUSR1 (exit 3, lease released) and starts it again; its points are logged
                   to ``RUN/service_metrics.jsonl``
``from-run``       ``ckpteval backfill --from-run OLD --eval-config F --wandb`` (offline) re-evaluating a
                   finished run: the backfill is what is restarted, as for ``service``
=================  =======================================================================================

Restart modes: *sigkill-resume* — SIGKILL of the trainer at a random step, then the same command plus
``--resume`` (as a user does by hand); *usr1-requeue* — SIGUSR1 (SLURM's pre-timeout signal), exit 75, then
the same command again (it carries ``--resume`` from the start, as the sbatch script's does); *worker-sigkill*
— a worker SIGKILLed while it holds a unit's lease, restarted with its same command. For ``service`` and
``from-run`` the first two apply to the evaluating process itself and the third is the first.

Scale: ``make test`` runs one 40-step run (4 points) per posture that injects one fault of each mode in
turn (the worker's, then the trainer's SIGKILL + ``--resume``, then its USR1 + the same command): every
cell of the matrix, nine runs. ``CKPTEVAL_CHAOS_SCALE=full`` (``make chaos``) runs each cell on its own,
2 faults of its mode on a 60-step run (6 points): 24 runs. At full scale the cells' table is written into
bench/CHAOS.md (section "Requeue matrix", by tests/chaos/conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.lifecycle import EXIT_PREEMPTED, EXIT_TRAIN_PREEMPTED
from tests.chaos import harness

INTERVAL = 10
STEPS = harness.scaled(40, 60)
FAULTS = harness.scaled(1, 2)  # faults of one mode per cell at full scale
DELAY_S = "0.3"  # each unit takes this long in the fn backend, so a worker is caught holding a lease


@dataclass(frozen=True)
class Posture:
    """Flags of one posture (``{tmp}``, ``{shm}``, ``{cfg}`` are filled in per cell), and whether a
    worker fleet runs beside the trainer."""

    flags: tuple[str, ...]
    fleet: bool = True


POSTURES: dict[str, Posture] = {
    "staging-run": Posture(()),
    "staging-dir": Posture(("--eval-staging-dir", "{tmp}/staging")),
    "staging-shm": Posture(("--eval-staging-dir", "{shm}")),
    "reuse": Posture(("--save-hf", "{tmp}/hf", "--save-interval", str(INTERVAL))),
    "shared": Posture(("--eval-posture", "shared"), fleet=False),
    "lora": Posture(("--lora", "--lora-rank", "4")),
    "sampled+sparse": Posture(("--eval-config", "{cfg}")),
}


def cells(postures: list[str], modes: tuple[str, ...]) -> list[tuple[str, tuple[str, ...]]]:
    """(posture, the faults of one run, in order). Full scale: one cell per posture × mode with ``FAULTS``
    faults of that mode. ``make test``: one run per posture injecting one fault of every mode in turn
    (worker first, then the trainer's SIGKILL + ``--resume``, then USR1 + the same command), which covers
    the same cells at a third of the cost."""
    def applies(p: str, m: str) -> bool:
        return m != "worker-sigkill" or POSTURES.get(p, Posture(())).fleet

    if harness.FULL:
        return [(p, (m,) * FAULTS) for p in postures for m in modes if applies(p, m)]
    return [(p, tuple(m for m in modes if applies(p, m))) for p in postures]


def cell_id(cell: tuple[str, tuple[str, ...]]) -> str:
    return f"{cell[0]}-{'+'.join(dict.fromkeys(cell[1]))}"


TRAINER_CELLS = cells(list(POSTURES), ("worker-sigkill", "sigkill-resume", "usr1-requeue"))
EVAL_CELLS = cells(["service", "from-run"], ("sigkill-resume", "usr1-requeue"))

@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A staging dir on /dev/shm (tmpfs), removed afterwards."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine: the tmpfs posture cannot run")
    path = Path("/dev/shm") / f"ckpteval-requeue-{uuid.uuid4().hex[:8]}"
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def sampled_sparse_config(tmp: Path) -> Path:
    """An eval config with a sampled dataset and a sparse one (every second point)."""
    from ckpteval.jobs.eval.kinds.generate.evalsets import write_jsonl
    from ckpteval.jobs.reference.model import make_addition_examples

    d = tmp / "cfg"
    d.mkdir()
    write_jsonl(d / "dense.jsonl", make_addition_examples(8, seed=3))
    write_jsonl(d / "sparse.jsonl", make_addition_examples(4, seed=4))
    datasets = [
        {"name": "sampled", "path": "dense.jsonl", "n_prompts": 8, "shard_size": 4, "max_new_tokens": 4,
         "n_samples": 2, "temperature": 1.0, "pass_k": [1, 2]},
        {"name": "sparse", "path": "sparse.jsonl", "n_prompts": 4, "shard_size": 2, "max_new_tokens": 4,
         "every": 2 * INTERVAL},
    ]
    (d / "eval.json").write_text(json.dumps({"eval": {"datasets": datasets},
                                             "lease": {"duration_s": 3, "heartbeat_s": 0.5}}))
    return d / "eval.json"


def fill(flags: tuple[str, ...], **values: str) -> list[str]:
    return [f.format(**values) for f in flags]


def fn_env() -> dict[str, str]:
    return harness.base_env(SUMBACKEND_DELAY_S=DELAY_S, WANDB_MODE="offline", WANDB_SILENT="true")


def busy_slot(fleet: harness.Fleet, run: RunDir) -> tuple[int, int] | None:
    """(slot, pid) of a live worker holding a lease, if any."""
    for i, p in fleet.live():
        if harness.units_held_by(run, p.pid):
            return i, p.pid
    return None


def reached(monitor: harness.ProgressMonitor, step: int) -> bool:
    """The current trainer incarnation logged a train line at ``step`` or later."""
    last = monitor.incarnation_step()
    return last is not None and last >= step


def kill_targets(rand_name: str, n: int, first: int, last: int) -> list[int]:
    """``n`` increasing random steps in [first, last], one per stretch of that range."""
    rand = harness.rng(rand_name)
    span = (last - first) // max(1, n)
    return [first + k * span + rand.randint(0, max(0, span - 1)) for k in range(n)]


# -- trainer postures ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("posture", "faults"), TRAINER_CELLS, ids=[cell_id(c) for c in TRAINER_CELLS])
def test_trainer_posture_survives_restart(posture: str, faults: tuple[str, ...], tmp_path: Path, shm_dir: Path,
                                          procs: harness.Procs, request: pytest.FixtureRequest) -> None:
    spec = POSTURES[posture]
    t_start = time.monotonic()
    run_dir = tmp_path / "run"
    cfg = sampled_sparse_config(tmp_path) if "{cfg}" in spec.flags else Path("-")
    base = harness.train_argv(
        run_dir, "--steps", str(STEPS), "--eval-interval", str(INTERVAL), "--ckpt-interval", "5",
        "--eval-max-in-flight", "2", "--eval-keep-snapshots", "64", "--eval-backpressure-timeout", "600",
        *fill(spec.flags, tmp=str(tmp_path), shm=str(shm_dir), cfg=str(cfg)),
    )
    resume = [*base, "--resume"]
    # the USR1 cells start as the sbatch script does, with --resume; the SIGKILL cells as a user does, without
    command = resume if faults[0] == "usr1-requeue" else base
    env = fn_env()
    trainer = procs.cli(*command, name="train", env=env)
    monitor = harness.ProgressMonitor(run_dir / "metrics.jsonl")
    monitor.start()
    harness.wait_for(lambda: (run_dir / "run.json").exists() or trainer.poll() is not None, 120, "run.json")
    assert trainer.poll() is None, procs.tail(trainer)
    run = RunDir(run_dir)
    fleet = harness.Fleet(procs, run_dir, 2, env=env) if spec.fleet else None
    if fleet is not None:
        fleet.start_all()
    done: list[str] = []
    targets = iter(kill_targets(cell_id((posture, faults)), sum(f != "worker-sigkill" for f in faults), 3, STEPS - 15))
    try:
        for fault in faults:
            if fault == "worker-sigkill":
                assert fleet is not None
                i, pid = harness.wait_for(lambda: busy_slot(fleet, run), 120, "a worker holding a lease",
                                          interval=0.02)
                fleet.signal(i, signal.SIGKILL)
                fleet.start(i)
                done.append("worker SIGKILL mid-unit")
                continue
            target = next(targets)
            # a train line of *this* incarnation at or past the target: the restarted trainer is up (a signal
            # in its first second, before Python runs, would kill it with the default action, as anywhere)
            harness.wait_for(lambda t=target, p=trainer: reached(monitor, t) or p.poll() is not None, 180,
                             f"the trainer to reach step {target}", interval=0.01)
            assert trainer.poll() is None, f"trainer finished before its {fault}: {procs.tail(trainer)}"
            if fault == "sigkill-resume":
                trainer.send_signal(signal.SIGKILL)
                trainer.wait()
                done.append(f"trainer SIGKILL at step {monitor.last_step()} + --resume")
            else:
                trainer.send_signal(signal.SIGUSR1)
                code = procs.wait(trainer, 120)
                assert code == EXIT_TRAIN_PREEMPTED, f"USR1: exit {code}: {procs.tail(trainer)}"
                done.append(f"trainer USR1 at step {monitor.last_step()} → exit {code}, same command")
            monitor.new_incarnation()
            trainer = procs.cli(*resume, name="train-again", env=env)
        code = procs.wait(trainer, 300)
        fleet_codes = fleet.wait_all(120) if fleet is not None else []
    finally:
        monitor.stop.set()
    expected = list(range(INTERVAL, STEPS + 1, INTERVAL))
    t = harness.tally(run_dir, expected)
    record(request, f"{posture} × {' + '.join(dict.fromkeys(faults))}", done, t, t_start)
    assert code == 0, procs.tail(trainer)
    assert fleet_codes == [0] * len(fleet_codes), fleet.logs() if fleet else ""
    assert run.training_done() == STEPS
    assert_every_point_once(t)


def assert_every_point_once(t: harness.Tally) -> None:
    assert t.lost == [] and t.unexpected == [], t
    assert t.dup_ingestions == 0, t
    assert t.units_without_result == [], t.units_without_result
    # a trainer killed between publishing a point and its ledger record re-dispatches it; the documented
    # outcome for a point whose export a kill cut short is a `crashed` skip, never a silent loss
    assert set(t.skips) <= {"crashed"}, (t.skips, t.skip_steps)


def record(request: pytest.FixtureRequest, cell: str, faults: list[str], t: harness.Tally, t_start: float) -> None:
    harness.record(request.node.nodeid, f"requeue: {cell}", "; ".join(faults) or "-", t, stalls=0, max_gap_s=0.0,
                   outside_deleted=0, wall_s=time.monotonic() - t_start,
                   notes=f"units without a result: {len(t.units_without_result)} of {t.units_total}")


# -- evaluation-only postures: the service and a re-evaluation run ----------------------------------------------
def service_config(tmp: Path) -> Path:
    from ckpteval.jobs.eval.kinds.generate.evalsets import write_jsonl
    from ckpteval.jobs.reference.model import make_addition_examples

    (tmp / "cfg").mkdir()
    write_jsonl(tmp / "cfg" / "addition.jsonl", make_addition_examples(4, seed=7))
    (tmp / "cfg" / "eval.json").write_text(json.dumps({
        "run_id": "svc",
        "eval": {"datasets": [{"name": "addition", "path": "addition.jsonl", "n_prompts": 4, "shard_size": 2,
                               "max_new_tokens": 4}]},
        "lease": {"duration_s": 3, "heartbeat_s": 0.5},
    }))
    return tmp / "cfg" / "eval.json"


@pytest.mark.parametrize(("posture", "faults"), EVAL_CELLS, ids=[cell_id(c) for c in EVAL_CELLS])
def test_eval_posture_survives_restart(posture: str, faults: tuple[str, ...], tmp_path: Path, procs: harness.Procs,
                                       request: pytest.FixtureRequest) -> None:
    from tests.support.workers import make_eval_run, publish_model, write_foreign_checkpoint

    t_start = time.monotonic()
    steps = list(range(INTERVAL, STEPS + 1, INTERVAL))
    cfg = service_config(tmp_path)
    run_dir = tmp_path / "new"
    fn = ("--engine", harness.SUM_FN, "--poll-interval", "0.1")
    write_next: Callable[[int], object]
    if posture == "service":
        watch = tmp_path / "hf-trainer-out"
        watch.mkdir()
        argv = ["worker", "--run-dir", str(run_dir), "--watch", str(watch), "--eval-config", str(cfg),
                "--quiescence", "0.3", "--wandb", "--wandb-run-id", "train-run-1", *fn]
        write_next = lambda s: write_foreign_checkpoint(tmp_path, watch / f"checkpoint-{s}", s)  # noqa: E731
    else:
        old = make_eval_run(tmp_path, name="old")
        for s in steps:
            publish_model(tmp_path, old.snapshots, s)
        old.mark_training_done(steps[-1])
        argv = ["backfill", "--run-dir", str(run_dir), "--from-run", str(old.path), "--eval-config", str(cfg),
                "--wandb", "--wandb-mode", "resume", *fn]
        write_next = lambda s: None  # noqa: E731  (the old run is finished: every snapshot is there)
    env = fn_env()
    written = [steps[0]]
    write_next(steps[0])
    proc = procs.cli(*argv, name=posture, env=env)
    run = RunDir(run_dir)
    done: list[str] = []
    for k, fault in enumerate(faults):
        # the foreign trainer keeps writing checkpoints while the service runs
        for s in steps[len(written): len(written) + max(1, len(steps) // (len(faults) + 1))]:
            write_next(s)
            written.append(s)
        harness.wait_for(lambda p=proc: (run_dir / "run.json").exists() and harness.units_held_by(run, p.pid), 120,
                         f"{posture} to hold a lease (fault {k + 1})", interval=0.02)
        sig = signal.SIGKILL if fault == "sigkill-resume" else signal.SIGUSR1
        os.kill(proc.pid, sig)
        code = procs.wait(proc, 60)
        want = -signal.SIGKILL if sig == signal.SIGKILL else EXIT_PREEMPTED
        assert code == want, f"{sig.name}: exit {code}: {procs.tail(proc)}"
        done.append(f"{sig.name} mid-unit → exit {code}, same command")
        proc = procs.cli(*argv, name=f"{posture}-again", env=env)  # the identical command
    for s in steps[len(written):]:
        write_next(s)
    if posture == "service":  # a service never ends by itself: stop it once every point is logged
        harness.wait_for(lambda: len(harness.tally(run_dir, steps, run.service_metrics_path).landed) == len(steps),
                         180, "the service to log every point", interval=0.2)
        os.kill(proc.pid, signal.SIGTERM)
        assert procs.wait(proc, 60) == EXIT_PREEMPTED, procs.tail(proc)
    else:
        assert procs.wait(proc, 300) == 0, procs.tail(proc)
    t = harness.tally(run_dir, steps, run.service_metrics_path)
    record(request, f"{posture} × {' + '.join(dict.fromkeys(faults))}", done, t, t_start)
    assert_every_point_once(t)
    assert t.skips == {}, t.skips
