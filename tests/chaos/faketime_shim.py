"""``python -m tests.chaos.faketime_shim <ckpteval command> ...``: run a ckpteval command under
libfaketime with ``FAKETIME_DONT_FAKE_MONOTONIC=1``.

Debian bookworm's libfaketime 0.9.10 mistranslates ``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)``
when the monotonic clock is excluded from faking, so Python >= 3.11's ``time.sleep`` fails with EINVAL
(wolfcw/libfaketime#426). ``threading`` waits and ``select`` are unaffected (checked by the chaos suite),
so this shim only replaces ``time.sleep`` with a relative ``select`` timeout, then runs the command
unchanged. Nothing else of ckpteval is touched: the lease, heartbeat and expiry code run as shipped.
"""

from __future__ import annotations

import select
import sys
import time


def _sleep(seconds: float) -> None:
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        select.select([], [], [], left)


if __name__ == "__main__":
    time.sleep = _sleep
    from ckpteval.jobs.cli import main

    sys.exit(main(sys.argv[1:]))
