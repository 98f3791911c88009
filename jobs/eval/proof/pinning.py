"""Version pinning: the one routine that makes an engine hold a snapshot's weights, and the one check
that it still held them for every sample.

A point is trusted only if it provably measured the intended weights: the engine is loaded from the
snapshot on disk as version ``str(step)`` (:func:`pin`: load unless already held, then read the version
back), and after scoring every sample and the engine itself must still report that version
(:func:`check_pinned`). Any other version is a :class:`PinViolation` (skip reason ``pin_violation``).

Both evaluators call these: the fleet's :class:`ckpteval.jobs.eval.worker.evaluators.EngineEvaluator` and the shared
posture's :func:`ckpteval.jobs.trainer.gate.shared_eval`. They pass different settings, for stated reasons:

- the fleet bounds the load (``load_timeout_s``: a wedged server must not hang the worker) and waits up
  to ``pin_timeout_s`` for the read-back (a remote server may report the new version a moment late),
  and keeps a version only while it is one the worker loaded itself: an engine whose label already names
  the wanted version but which this worker did not load (a server launched or relabelled by another
  client) is reloaded (``reload=True``), so a label is never adopted (:mod:`ckpteval.jobs.eval.proof.attest`
  records only loads made by the caller);
- the shared posture always reloads (``reload=True``): the trainer's producers may have synced weights
  into the same engine under a version string of their own, and an eval point's weights come only from
  its snapshot on disk. It does not wait or bound the load: the gate holds the engine, nothing else
  loads concurrently, and the engine is in-process.

Limits: pinning detects another writer of the engine's weights (the read-back), it does not prevent one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from ckpteval.jobs.eval.engines.base import Engine, EngineError, WeightVersionMismatch, launch_timeout
from ckpteval.jobs.eval.skips import WorkerSkip


class PinViolation(WorkerSkip):
    reason = "pin_violation"


class CallTimedOut(EngineError):
    """:func:`call_with_timeout`'s call did not return in time (it may still be running)."""


def call_with_timeout(fn: Callable[[], Any], timeout_s: float | None, what: str) -> Any:
    """Run ``fn`` in a helper thread; :class:`CallTimedOut` (an :class:`EngineError`) if it has not returned
    after ``timeout_s``.

    ``None`` calls it directly, unbounded. The helper thread cannot be killed: a wedged call keeps
    running in the background (and the engine typically stays unusable, which health checks report).
    """
    if timeout_s is None:
        return fn()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 — carried to the calling thread and re-raised there
            box["error"] = e

    thread = threading.Thread(target=target, name=f"ckpteval-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise CallTimedOut(f"{what} did not finish within {timeout_s:g}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def pin(
    engine: Engine,
    snapshot: str,
    want: str,
    *,
    load_timeout_s: float | None = None,
    pin_timeout_s: float = 0.0,
    reload: bool = False,
) -> bool:
    """Load ``snapshot`` as version ``want`` (unless held and not ``reload``); read the version back.

    Returns whether a load happened. :class:`EngineError` if the load fails (a dead engine, a load past
    ``load_timeout_s``, plus the engine's launch timeout when this load launches its server:
    :func:`~ckpteval.jobs.eval.engines.base.launch_timeout`); :class:`PinViolation` if the engine still reports
    another version after ``pin_timeout_s``.
    """
    loaded = reload or engine.weight_version() != want
    if loaded:
        bound = None if load_timeout_s is None else load_timeout_s + launch_timeout(engine, pending_only=True)
        try:
            call_with_timeout(lambda: engine.load(snapshot, want), bound, "weight load")
        except EngineError as e:
            if not isinstance(e, WeightVersionMismatch):
                raise
            # loaded, but the engine reads back another version: the read-back below decides
    deadline, delay = time.monotonic() + pin_timeout_s, 0.02
    while (got := engine.weight_version()) != want:
        if time.monotonic() >= deadline:
            raise PinViolation(f"engine reports version {got!r} after loading step {want} (waited {pin_timeout_s:g}s)")
        time.sleep(delay)
        delay = min(2 * delay, 1.0)
    return loaded


def restart(engine: Engine, load_timeout_s: float) -> None:
    """Restart ``engine``, bounded by its launch timeout when it launches a server (an sglang start-up
    outlasts a weight load), else by ``load_timeout_s``; :class:`EngineError` past the bound."""
    bound = max(load_timeout_s, launch_timeout(engine))
    call_with_timeout(engine.restart, bound, "engine restart")


def check_pinned(engine: Engine, want: str, sample_versions: Iterable[str | None]) -> None:
    """After scoring: every sample and the engine itself must carry ``want``; else :class:`PinViolation`."""
    after = engine.weight_version()
    wrong = sorted({str(v) for v in sample_versions if v != want})
    if wrong or after != want:
        raise PinViolation(f"want version {want}; samples carried {wrong or 'it'}, engine reports after={after!r}")

