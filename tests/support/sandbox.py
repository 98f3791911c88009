"""Finding processes that outlived their sandbox (tests of jobs/eval/sandbox/core.py and the code scorer)."""

from __future__ import annotations

import time

from ckpteval.jobs.eval.sandbox.core import labelled_processes


def survivors(label: str, wait_s: float = 30.0) -> list[int]:
    """Pids still carrying the sandbox ``label`` after up to ``wait_s`` seconds: the kernel tears a killed
    PID namespace down asynchronously, so a clean sandbox reaches [] within moments, a leaking one never."""
    gone_by = time.monotonic() + wait_s
    while (found := labelled_processes(label)) and time.monotonic() < gone_by:
        time.sleep(0.1)
    return found
