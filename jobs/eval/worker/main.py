"""``ckpteval worker``: the eval worker — fleet member, long-running service, or one pass.

What it owns: the loop that turns snapshots into results. Each poll (at most one per ``--poll-interval``,
however fast units go: listings are metadata round trips on Lustre) it discovers complete snapshots
under every root of ``run.json``'s ``snapshot_roots`` (plus ``--watch`` dirs), lists ``results/`` once
(only the step directories it still waits for), and then claims unfinished units ``(step, dataset,
shard)`` from that list until it is used up (oldest step first; ``--newest-first`` reverses; ``--catchup
latest`` considers only the newest step), each checked for a result just before and just after its
claim. For a claimed unit it verifies the snapshot (once per snapshot and process while its marker is
unchanged; a failed unit's snapshot again), pins the engine to it, scores the unit, writes the result
(first writer wins) and releases the lease. Everything it evaluates is configured by ``run.json``;
flags only say *how* to run.

Promises:

* **Every outcome is a result — but never one for the worker's own fault.** A unit ends as scores or
  as a skip record with a reason: ``ckpt_missing`` / ``ckpt_corrupt`` (snapshot gone or failing
  ``--verify``), ``pin_violation`` (the engine's version differs from the step after the load, after
  the unit, or on any sample), ``unhealthy`` (the engine stays dead after restart + reload + re-probe),
  ``crashed`` (scoring raised an engine, runtime, value or OS error), or a backend's own
  ``EvalSkip(reason)``. User code that raises — a scorer, an lm-eval task — is that unit's ``crashed``
  skip with the exception's last line and a ``blame``, written at once (another worker would fail the
  same way; the engine is not restarted and its health not counted); a scorer's
  ``ScorerInfraError`` (a judge, a sandbox) is a skip with its own reason, also written at once. A load or scoring failure is checked against the snapshot once more: if it no
  longer verifies (deleted or damaged after the first check), the unit is that ``ckpt_missing`` /
  ``ckpt_corrupt`` skip, not ``unhealthy`` or ``crashed``. An ``unhealthy`` or ``crashed`` outcome may
  be this worker's own fault (a dead engine, a setting its backend cannot use), so the unit is
  *released* with nothing written, for another worker; the skip is written only once the unit is to
  blame — this worker has scored a unit of the run and the unit's ``.attempts`` reached
  ``--max-attempts`` — or once no healthy worker can be expected: ``TRAINING_DONE`` seen
  ``max_attempts × lease duration`` ago and the attempts used up (the step's deadline). The worker
  then moves on to the next unit.
* **Pinning.** The engine loads ``(snapshot, weight_version="<run key>@<step>")`` (:mod:`ckpteval.coord.run.identity`:
  an engine shared with another run never passes this run's pin) only when its version differs;
  the version is read back (polled up to ``--pin-timeout``), every sample must carry it, and it is read
  again after the unit. With several engines (``--engines N`` or repeated ``--engine``) all must agree.
* **Health.** Before the first claim the engine is probed (:meth:`Evaluator.probe`): not usable → one
  line on stderr, exit 4, nothing written. Before each unit the engine is probed (one-token generate); a dead one is restarted,
  reloaded and re-probed. Loads and restarts are bounded by ``--load-timeout``. After
  ``--max-unhealthy`` consecutive ``unhealthy`` or released units the worker exits with
  ``EXIT_UNHEALTHY`` so the scheduler can give it a fresh node (0 disables this).
* **Start order.** ``--wait-for-run S``: a worker started before its trainer wrote ``run.json`` waits
  for it (bounded; a stop signal ends the wait with exit 3). A run dir without ``results/``,
  ``leases/`` or ``adopted/`` (a copied run whose results were removed) gets them before any work.
* **Leases.** The claim's heartbeat runs while the unit runs. If the claim was lost (taken over after
  a stall), the worker writes *nothing* for the unit. Just before writing it also checks that the lease
  file still carries its token, narrowing the window in which a stalled worker can double-write (a rare
  double write lands in ``results/duplicates/``; readers take the first result).
* **Preemption.** SIGTERM or SIGUSR1 (SLURM's pre-timeout signal, ``--signal=USR1@T``): no new work is
  started, the current unit is abandoned and its lease released at once (a contender takes it over
  without waiting for expiry), and the worker exits with ``EXIT_PREEMPTED`` ("requeue me"). SIGINT
  does the same and exits with ``EXIT_INTERRUPTED``.

Exit (``EXIT_DONE``): fleet mode (default) once ``TRAINING_DONE`` exists and every unit of every
dispatched (``ledger.jsonl``) or discovered step has a result — a dispatched step whose snapshot no
poll has found for one lease duration after ``TRAINING_DONE`` (deleted before anyone saw it, a wiped
tmpfs, an unreadable marker) is evaluated against the path it should have, so its units end as
``ckpt_missing`` / ``ckpt_corrupt`` instead of keeping the fleet waiting forever; ``--once`` after one pass over what is
there — every unit of the snapshots present has a result, waiting for units other workers hold (and
taking over expired ones), and for marker-less dirs under ``--watch`` to become quiescent (at most
``2 * --quiescence + 5 * --poll-interval`` per dir); ``--max-units N`` after writing N results.
Service mode (``--watch``) never ends otherwise.

Exit codes (``sbatch/`` scripts requeue on 3 and 4):

=====================  ====  =================================================================
``EXIT_DONE``          0     finished (see above)
``EXIT_ERROR``         1     unexpected error (a traceback was printed)
``EXIT_USAGE``         2     bad flags, run dir, run.json, eval set or engine settings; a snapshot no node
                             can load with run.json (a LoRA adapter without eval.base_model); a server
                             started without a route or flag the engine needs; run.json code others could
                             have written (see ``--trust-run-code``)
``EXIT_PREEMPTED``     3     SIGTERM / SIGUSR1: lease released, nothing lost — requeue me
``EXIT_UNHEALTHY``     4     the engine could not be started or stayed dead — requeue elsewhere
``EXIT_INTERRUPTED``   130   SIGINT (Ctrl-C): lease released
=====================  ====  =================================================================

Service mode: ``--watch DIR`` evaluates any trainer's checkpoints in DIR — snapshots with a
``.complete`` marker at once, marker-less ones (an HF Trainer ``checkpoint-500/``) after
``--quiescence`` seconds without change and with every indexed shard present; the step comes from the
dir name's trailing digits or ``trainer_state.json``; ``--layout`` says where a trainer's HF weights
and its own completion signal are (:mod:`ckpteval.coord.layouts`; a save with its signal is admitted without
the quiescence wait). Watched dirs are polled every ``--poll-interval`` even while a unit runs, so a
trainer rotating saves faster than units finish has each one seen — admitted, or recorded in
``RUN/lost/`` — never silently missed. Restarting never re-evaluates a unit with a result. If ``RUN/run.json`` does not exist, ``--eval-config FILE`` creates the run from a JSON file::

    {"run_id": "my-eval",                                   # optional; default: the run dir's name
     "eval": {"datasets": [{"name": "gsm8k", "path": "gsm8k.jsonl", "n_prompts": 1319,
                            "scorer": "math", "shard_size": 64, "max_new_tokens": 256}],
              "engine": {"hf": {"dtype": "bfloat16"}}},
     "lease": {"duration_s": 120, "heartbeat_s": 20}}       # optional

Dataset paths are relative to the config file; the files are copied into ``RUN/data/``. The watch
dirs become the run's ``snapshot_roots`` and ``trainer.foreign_roots`` (so backfill and status see the
adopted checkpoints too). If run.json exists, the config must describe the same eval, else exit 2.

Limits: one unit at a time per worker process (run more workers, or pool engines, for throughput);
scoring is not interruptible mid-call — on preemption the worker releases first and does not wait for
it; adopting a foreign checkpoint checksums all its files once, in the polling thread.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ckpteval.coord.entries import scored_per_sample
from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.eval.engines.base import EngineError, ServerMisconfigured
from ckpteval.jobs.eval.kinds.evaluate import check_entries
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
from ckpteval.jobs.eval.proof.pinning import CallTimedOut, call_with_timeout
from ckpteval.jobs.eval.proof.trust import check_run_code
from ckpteval.jobs.eval.scorers import ScorerContext
from ckpteval.jobs.eval.worker.evalconfig import create_run_from_config
from ckpteval.jobs.eval.worker.evaluators import ConfigMismatch, Evaluator, build_evaluator
from ckpteval.jobs.eval.worker.loop import Worker
from ckpteval.jobs.eval.worker.options import (
    WorkerOptions,
    add_worker_flags,
    options_from_args,
    scorer_options,
)
from ckpteval.jobs.eval.worker.service import service_ingestion
from ckpteval.jobs.flags import Parser, fail, run_dir_from_args
from ckpteval.jobs.lifecycle import (
    EXIT_CODES_HELP,
    EXIT_DONE,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    EXIT_UNHEALTHY,
    EXIT_USAGE,
    STOP_SIGNALS,
    early_stop_signal,
)

RUN_WAIT_SLICE_S = 0.5


class StoppedWhileWaiting(RuntimeError):
    """A stop signal arrived while the worker waited for run.json (nothing claimed: requeue)."""


def wait_for_run(opts: WorkerOptions, sleep: Callable[[float], None] = time.sleep) -> None:
    """``--wait-for-run S``: a fleet started before its trainer waits (bounded) for RUN/run.json.

    Says once on stderr what it waits for; a SIGTERM/SIGUSR1 meanwhile ends the wait
    (:class:`StoppedWhileWaiting`); at the bound :func:`RunDir.open` reports the missing file."""
    manifest = RunDir(opts.run_dir).manifest_path
    if opts.wait_for_run_s <= 0 or opts.eval_config is not None or manifest.is_file():
        return
    print(f"ckpteval worker: waiting up to {opts.wait_for_run_s:g}s for {manifest} (trainer not started yet?)",
          file=sys.stderr, flush=True)
    deadline = time.monotonic() + opts.wait_for_run_s
    while not manifest.is_file() and time.monotonic() < deadline:
        if early_stop_signal() is not None:
            raise StoppedWhileWaiting(f"stopped while waiting for {manifest}")
        sleep(min(RUN_WAIT_SLICE_S, max(0.0, deadline - time.monotonic())))
    if not manifest.is_file():
        raise FileNotFoundError(f"{manifest}: not there after waiting {opts.wait_for_run_s:g}s (--wait-for-run)")


def open_run(opts: WorkerOptions) -> RunDir:
    if opts.eval_config is not None:
        if not opts.watch:
            raise ValueError("--eval-config creates a service run: give the checkpoint dir with --watch DIR")
        return create_run_from_config(opts.run_dir, opts.eval_config, opts.watch)
    wait_for_run(opts)
    run = RunDir.open(opts.run_dir)
    ensure_protocol_dirs(run)
    return run


def ensure_protocol_dirs(run: RunDir) -> None:
    """Create ``results/``, ``leases/`` and ``adopted/`` if missing (a copied run whose results were
    removed to re-score it), before any work: a unit evaluated and then unpublishable is work lost.
    An unwritable run dir is a one-line usage error (PermissionError is an OSError), and so is one
    whose dirs exist but are not writable by this user (a run dir it may read but not write): the worker
    would fail at its first lease or result."""
    for path in (run.results, run.leases, run.adopted):
        if not path.is_dir():
            try:
                path.mkdir(exist_ok=True)
            except OSError as e:
                raise ValueError(f"{path}: missing and cannot be created ({e.strerror or e})") from None
        elif not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{path}: not writable by this user; a worker writes its leases and results "
                             "in the run dir (run it as the run's owner or a member of its group)")


def check_datasets(cache: DatasetCache) -> None:
    """Check every eval set once (:func:`ckpteval.jobs.eval.kinds.evaluate.check_entries`: rows, scorers, library tasks) so
    a broken one stops the worker at start, not unit by unit."""
    check_entries(cache)


# -- entry points ---------------------------------------------------------------------------------------
def close_quietly(evaluator: Evaluator, timeout_s: float = 10.0, *, abandoned: bool = False) -> None:
    """Close the backend, bounded: a unit still running may hold the engine's locks. ``abandoned``: a stop
    signal left a generation running that holds them; a close it keeps from finishing is expected, not a
    failure (the process's exit frees the engine), and says nothing."""
    try:
        call_with_timeout(evaluator.close, timeout_s, "engine close")
    except (EngineError, RuntimeError, ValueError, OSError) as e:
        if abandoned and isinstance(e, CallTimedOut):
            return
        print(f"ckpteval worker: closing the engine failed: {e}", file=sys.stderr, flush=True)


def install_signal_handlers(worker: Worker) -> dict[int, Any]:
    """Route SIGTERM/SIGUSR1/SIGINT to ``worker``; returns the previous handlers (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in STOP_SIGNALS:
        previous[sig] = signal.signal(sig, lambda signum, _frame: worker.request_stop(signum))
    if (early := early_stop_signal()) is not None:  # preempted while still starting up
        worker.request_stop(early)
    return previous


def prepare_worker(opts: WorkerOptions, **kw: Any) -> Worker:
    """Open (or create) the run, check its eval sets, build the backend: everything before the loop."""
    run = open_run(opts)
    manifest = run.manifest()
    run.ended()  # a malformed TRAINING_DONE or INTERRUPTED stops the worker here, named, not mid-loop
    check_run_code(run, manifest, trusted=opts.trust_run_code)  # before any scorer is imported
    cache = DatasetCache(run, manifest, ScorerContext(run.path, scorer_options(opts)))
    try:
        check_datasets(cache)
    except (ValueError, FileNotFoundError) as e:  # the run's eval sets: no worker can evaluate them
        run.refuse_config(f"{socket.gethostname()}:{os.getpid()}", str(e))
        raise
    for d in manifest.eval.entries:  # legal, but almost always a mistake: say it once, at start
        if scored_per_sample(d) and d.n_samples > 1 and not d.samples_randomly:
            print(f"ckpteval worker: warning: dataset {d.name!r} draws n_samples={d.n_samples} at temperature 0: "
                  "greedy samples are identical (pass@k = pass@1); set a temperature > 0", file=sys.stderr, flush=True)
    evaluator = build_evaluator(opts, manifest, cache)
    try:  # before the first claim: a broken engine must not write a single result
        call_with_timeout(evaluator.probe, opts.load_timeout_s, "engine start-up probe")
    except ServerMisconfigured as e:  # started without a flag/route it needs: no fresh node cures it (exit 2)
        close_quietly(evaluator, timeout_s=2.0)
        run.refuse_config(f"{socket.gethostname()}:{os.getpid()}", str(e))
        raise ConfigMismatch(str(e)) from e
    except EngineError:
        close_quietly(evaluator, timeout_s=2.0)
        raise
    return Worker(run, opts, evaluator, **kw)


def run_worker(opts: WorkerOptions, *, exit_process: bool = False, prog: str = "ckpteval worker", **kw: Any) -> int:
    """Build, run and close a worker with signal handling; returns the exit code.

    ``exit_process`` (the CLI): after a stop signal abandoned a unit mid-call, end the process at once
    with the code instead of returning (the abandoned call would otherwise hold up interpreter exit).
    A stop signal ends with one line (the worker's ``out``), named ``prog``.
    """
    try:
        worker = prepare_worker(opts, **kw)
    except StoppedWhileWaiting as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    except EngineError as e:
        print(f"{prog}: engine not usable at start, nothing claimed: {e}", file=sys.stderr)
        return EXIT_UNHEALTHY
    except (ValueError, FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError) as e:
        # bad run dir, run.json, eval set or engine settings; unreadable or misplaced files
        return fail(prog, e, EXIT_USAGE)
    finish_ingestion: Callable[[], None] | None = None
    if opts.wandb:
        worker.on_poll, finish_ingestion = service_ingestion(worker, opts)
    previous = install_signal_handlers(worker)
    try:
        try:
            code = worker.run()
        except ConfigMismatch as e:  # no node can load this run's snapshots: never exit 4 (requeue)
            worker.rundir.refuse_config(f"{socket.gethostname()}:{os.getpid()}", str(e))
            return fail(prog, e, EXIT_USAGE)
        if opts.once and code == EXIT_DONE and worker.written == 0 and prog == "ckpteval worker":
            found = f"{len(worker.refs)} snapshot(s) found, every unit has a result" if worker.refs else \
                "no complete snapshot found under the run's snapshot roots" + (" or --watch" if opts.watch else "")
            print(f"{prog} --once: nothing to do: {found}", flush=True)
        if finish_ingestion is not None:
            finish_ingestion()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        abandoned = worker.busy and worker.stop_signal is not None
        close_quietly(worker.evaluator, timeout_s=2.0 if worker.busy else 10.0, abandoned=abandoned)
    if worker.stop_signal is not None:
        worker.out(f"{prog}: stopped by {signal.Signals(worker.stop_signal).name}: leases released, nothing lost; "
                   "run it again to continue")
    if worker.busy and exit_process:  # abandoned mid-unit: neither wait for it nor let shutdown wait
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def main(argv: list[str]) -> int:
    parser = Parser(
        prog="ckpteval worker", description=__doc__.split("\n\n")[0], epilog=EXIT_CODES_HELP
    )
    add_worker_flags(parser)
    args = parser.parse_args(argv)
    run_dir_from_args(parser, args)
    try:
        opts = options_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    return run_worker(opts, exit_process=True)


__all__ = [
    "EXIT_DONE",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_PREEMPTED",
    "EXIT_UNHEALTHY",
    "EXIT_USAGE",
    "Worker",
    "WorkerOptions",
    "main",
    "run_worker",
]
