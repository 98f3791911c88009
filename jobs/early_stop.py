"""Stop signals that arrive while a program is still starting up.

A scheduler may preempt a worker (SIGTERM, or SLURM's pre-timeout SIGUSR1) in the seconds it spends
importing torch and building its engine, before it installs its own handlers; by default either
signal would kill it with exit 128+N instead of the documented "preempted, requeue me" code.
:func:`record_early_stops` (called by ``ckpteval`` first thing) records such a signal instead, and
the program honours it once it can (:func:`early_stop_signal`). It holds no lease yet, so there is
nothing to release.

This lives in its own module, not in ``jobs.cli``, because ``python -m jobs.cli`` runs the CLI as
``__main__``: a second import of ``jobs.cli`` would see an empty record.
"""

from __future__ import annotations

import signal

EARLY_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
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
