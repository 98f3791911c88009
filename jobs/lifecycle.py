"""Exit codes and stop signals: one definition for every ckpteval program and ``sbatch/common.sh``.

The batch scripts requeue on ``EXIT_PREEMPTED`` and ``EXIT_UNHEALTHY`` (workers) and rerun the trainer
with ``--resume`` on ``EXIT_TRAIN_PREEMPTED``; ``tests/test_lifecycle.py`` ties ``sbatch/common.sh``'s
numbers and the signals it traps and forwards to these.

Early stops: a scheduler may preempt a worker (SIGTERM, or SLURM's pre-timeout SIGUSR1) in the seconds it
spends importing torch and building its engine, before it installs its own handlers; by default either
signal would kill it with exit 128+N instead of the documented "preempted, requeue me" code.
:func:`record_early_stops` (called by ``ckpteval`` first thing) records such a signal instead, and
the program honours it once it can (:func:`early_stop_signal`). It holds no lease yet, so there is
nothing to release. This lives outside ``ckpteval.jobs.cli`` because ``python -m ckpteval.jobs.cli`` runs the CLI as
``__main__``: a second import of ``ckpteval.jobs.cli`` would see an empty record.
"""

from __future__ import annotations

import signal

EXIT_DONE = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PREEMPTED = 3
EXIT_UNHEALTHY = 4
EXIT_TRAIN_PREEMPTED = 75  # EX_TEMPFAIL: the trainer saved a training checkpoint; run again with --resume
EXIT_INTERRUPTED = 130

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a scheduler's "stop soon": release / checkpoint, requeue
STOP_SIGNALS = (*PREEMPT_SIGNALS, signal.SIGINT)  # what makes a worker release and exit

EXIT_CODES_HELP = (
    f"exit codes: {EXIT_DONE} done, {EXIT_ERROR} unexpected error, {EXIT_USAGE} usage/config error, "
    f"{EXIT_PREEMPTED} preempted by SIGTERM/SIGUSR1 (lease released: requeue), {EXIT_UNHEALTHY} engine dead "
    f"(requeue elsewhere), {EXIT_INTERRUPTED} SIGINT"
)

EARLY_STOP_SIGNALS = PREEMPT_SIGNALS
_received: list[int] = []


def _record(signum: int, _frame: object) -> None:
    _received.append(signum)


def record_early_stops() -> None:
    """Record SIGTERM/SIGUSR1 until the program installs its own handlers (main thread only)."""
    for sig in EARLY_STOP_SIGNALS:
        signal.signal(sig, _record)


def early_stop_signal() -> int | None:
    """The first stop signal received before the program's own handlers, if any."""
    return _received[0] if _received else None
