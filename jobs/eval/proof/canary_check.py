"""The canary's engine side: recompute a snapshot's stored probe on the engines that can, and decide.

:func:`check_canary` runs after pinning, on every engine behind the evaluator's that can teacher-force
(:class:`~ckpteval.jobs.eval.engines.base.TeacherForced`), compares with the trainer's record
(:func:`ckpteval.jobs.eval.proof.canary.compare`) and applies the threshold: over it a unit is skipped
``canary_failed`` (:class:`CanaryFailed`) or flagged, as run.json ``eval.canary`` says. The probe's format,
the trainer's side and the measured bounds are :mod:`ckpteval.jobs.eval.proof.canary` (engine-free: the trainer
library imports it; this module is the eval worker's).

Limits: as :mod:`ckpteval.jobs.eval.proof.canary`'s — an engine that cannot teacher-force, or refuses to score
prompts, reports the canary absent, never passed.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from ckpteval.coord.snapshots.snapshot import CANARY, Marker
from ckpteval.jobs.eval.engines.base import (
    NamesCanaryKind,
    ReportsComputeDtype,
    RequestRejected,
    TeacherForced,
    members,
)
from ckpteval.jobs.eval.proof.canary import UNMEASURED, Fidelity, compare, default_bound
from ckpteval.jobs.eval.skips import WorkerSkip


def engine_kind(engine: Any) -> str:
    """The kind the bound table is keyed by: an engine's ``canary_kind`` (``sglang`` for sglang's HTTP
    API), else ``hf`` (in-process transformers)."""
    return str(engine.canary_kind) if isinstance(engine, NamesCanaryKind) else "hf"



class CanaryFailed(WorkerSkip):
    """The engine's log-probs of the probe differ from the trainer's by more than the threshold."""

    reason = "canary_failed"


def check_canary(
    engine: Any, snapshot: Path, marker: Marker, max_abs_diff: float | None, on_fail: str = "skip"
) -> Fidelity | None:
    """Recompute ``snapshot``'s canary on every engine behind ``engine`` that can (the worst is kept);
    None when the snapshot has no canary or no engine can teacher-force (or every one refused to). Over the threshold
    (``max_abs_diff`` > 0; 0: record only; None: the measured default for the engine's dtype against the
    trainer's, :func:`ckpteval.jobs.eval.proof.canary.default_bound`) ``on_fail`` decides (run.json ``eval.canary``): ``skip`` raises
    :class:`CanaryFailed`, ``flag`` logs one line on stderr and returns the fidelity ``flagged``.
    ValueError for an unreadable canary file."""
    forcing = [e for e in members(engine) if isinstance(e, TeacherForced)]
    if CANARY not in marker.files or not forcing:
        return None
    t0 = time.perf_counter()
    try:
        stored = json.loads((snapshot / CANARY).read_text())
        pairs = [(p["prompt"], p["continuation"]) for p in stored["probes"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{snapshot / CANARY}: unreadable canary ({e})") from e
    results = [compare(stored, got) for e in forcing if (got := _recompute(e, pairs, marker.step)) is not None]
    if not results:
        return None
    worst = max(results, key=lambda f: (f.max_abs_logprob_diff, -f.argmax_agreement))
    unmeasured = False
    if max_abs_diff is None:
        bounds = [default_bound(e.compute_dtype if isinstance(e, ReportsComputeDtype) else None, stored.get("dtype"),
                                engine_kind(e)) for e in forcing]
        max_abs_diff = max(b.bound for b in bounds)
        unmeasured = any(b.where == UNMEASURED for b in bounds)
    failed = 0 < max_abs_diff < worst.max_abs_logprob_diff
    fidelity = Fidelity(worst.max_abs_logprob_diff, worst.argmax_agreement, worst.tokens, time.perf_counter() - t0,
                        flagged=failed, bound=max_abs_diff, bound_unmeasured=unmeasured)
    if failed:
        message = (
            f"canary: max |Δ log-prob| {fidelity.max_abs_logprob_diff:.4g} over {fidelity.tokens} probe tokens "
            f"(argmax agreement {fidelity.argmax_agreement:.3f}) exceeds {max_abs_diff:g} — another tokenizer, "
            f"dtype or kernel than the trainer's ({stored.get('dtype')})"
        )
        provisional = unmeasured and math.isfinite(fidelity.max_abs_logprob_diff)
        if on_fail != "flag" and not provisional:
            raise CanaryFailed(message)
        why = ("the bound for this engine kind is unmeasured (bench/canary_gpu.py measures it; or set "
               "--canary-max-diff)" if provisional else "eval.canary.on_fail is flag")
        print(f"ckpteval: step {marker.step}: {message} (flagged, scored: {why})", file=sys.stderr, flush=True)
    return fidelity


def _recompute(engine: Any, pairs: list[tuple[str, str]], step: int) -> list[dict[str, Any]] | None:
    """``engine``'s teacher-forced records, or None (one line on stderr) when it refuses the request (a
    server that cannot score prompts: the canary is absent for it, not failed)."""
    try:
        return engine.teacher_forced(pairs)
    except RequestRejected as e:
        print(f"ckpteval: step {step}: no canary from this engine: {e}", file=sys.stderr, flush=True)
        return None
