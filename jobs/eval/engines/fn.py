"""The ``CheckpointEvalFn`` contract: black-box eval backends that score a whole work unit.

Owns the call's ``input`` (:func:`build_input`) and the check of its ``output`` (:func:`parse_output`); the
worker owns claiming, leases, verification, results and skips around it. A version differing from the
step's on any sample is a ``pin_violation``, a malformed output a ``crashed`` skip. Limits: the call is not
interruptible; the backend runs with the worker's privileges (trusted code). See docs/USER_GUIDE.md "Your own
eval backend (``CheckpointEvalFn``)".
"""

from __future__ import annotations

import importlib
import math
from dataclasses import asdict, dataclass
from typing import Any

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.results.files import SCORE_BOUND
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.work.units import WorkUnit


class EvalSkip(Exception):
    """Raised by a backend to record its unit as skipped with ``reason`` (a metric-name identifier)."""

    def __init__(self, reason: str, message: str = "") -> None:
        if not isinstance(reason, str) or not reason or not reason.replace("_", "").isalnum():
            raise ValueError(
                f"EvalSkip reason {reason!r} must be a non-empty identifier (it becomes a metric name)"
            )
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason
        self.message = message


class CheckpointEvalFn:
    """Base class of black-box backends; subclass it and override :meth:`evaluate_checkpoint`."""

    def evaluate_checkpoint(self, checkpoint_dir: str, input: dict[str, Any]) -> dict[str, Any]:  # noqa: A002
        raise NotImplementedError(f"{type(self).__name__} must implement evaluate_checkpoint")

    def dispose(self) -> None:
        """Release every resource; called once when the worker exits."""


@dataclass(frozen=True)
class FnOutput:
    scores: list[float]
    weight_versions: list[str | None]
    message: str
    answers: list[str | None] | None = None
    finish_reasons: list[str | None] | None = None  # "stop" | "length" | None per sample; None: not reported

    def extras(self) -> dict[str, dict[str, float]]:
        """The result's ``extras`` of what the backend reported: ``truncated`` over the samples it said."""
        known = [f for f in self.finish_reasons or () if f is not None]
        return {"truncated": {"sum": float(sum(f == "length" for f in known)), "n": len(known)}} if known else {}


def load_fn_class(path: str) -> type[CheckpointEvalFn]:
    """The class named by ``module:Class`` (ValueError when it cannot be imported or is no backend)."""
    module_name, sep, class_name = path.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(f"fn backend {path!r} must be 'package.module:ClassName'")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"fn backend {path!r} cannot be imported ({e})") from None
    if not isinstance(cls, type) or not callable(getattr(cls, "evaluate_checkpoint", None)):
        raise ValueError(
            f"fn backend {path!r} is not a class with evaluate_checkpoint(checkpoint_dir, input)"
        )
    return cls


def make_fn_backend(path: str, extra: dict[str, Any]) -> CheckpointEvalFn:
    """Construct the backend ``module:Class`` with ``extra`` as keyword arguments."""
    cls = load_fn_class(path)
    try:
        return cls(**extra)
    except TypeError as e:
        raise ValueError(
            f"fn backend {path!r} rejects the settings {sorted(extra)} from run.json ({e})"
        ) from None


def build_input(
    manifest: RunManifest,
    spec: GenerateEntry,
    unit: WorkUnit,
    rows: list[dict[str, Any]],
    prompts: list[str] | None = None,
    seeds: list[int] | None = None,
) -> dict[str, Any]:
    """The ``input`` dict of one unit (see the module docstring); ``prompts`` default to the raw ones."""
    samples = unit.sample_range(spec.n_samples)
    return {
        "run_id": manifest.run_id,
        "step": unit.step,
        "weight_version": str(unit.step),
        "unit": unit.to_json(),
        "unit_id": unit.id,
        "dataset": asdict(spec),
        "rows": [dict(r) for r in rows],
        "prompts": list(prompts) if prompts is not None else [r.get("prompt") for r in rows],
        "samples": [samples.start, samples.stop],
        "seeds": None if seeds is None else list(seeds),
        "adapters": [dict(a) for a in manifest.eval.adapters],
        "base_model": manifest.eval.base_model,  # set: the checkpoint is a LoRA adapter on this base
        "engine": dict(manifest.eval.engine),
    }


def parse_output(output: Any, expected_n: int, weight_version: str) -> FnOutput:
    """Validate a backend's output; ValueError says what is wrong (the worker records ``crashed``)."""
    if not isinstance(output, dict):
        raise ValueError(f"evaluate_checkpoint must return a dict, got {type(output).__name__}")
    scores = output.get("scores")
    if not isinstance(scores, list) or len(scores) != expected_n:
        got = len(scores) if isinstance(scores, list) else type(scores).__name__
        raise ValueError(f"output 'scores' must be a list of {expected_n} numbers, got {got}")
    if not all(isinstance(s, int | float) and not isinstance(s, bool) and math.isfinite(s) and abs(s) <= SCORE_BOUND
               for s in scores):
        raise ValueError(f"output 'scores' must hold finite numbers within ±{SCORE_BOUND:g} only")
    versions = output.get("weight_versions")
    if versions is None:
        versions = [weight_version] * expected_n
    if not isinstance(versions, list) or len(versions) != expected_n:
        raise ValueError(f"output 'weight_versions' must be a list of {expected_n} versions")
    answers = output.get("answers")
    if answers is not None and (not isinstance(answers, list) or len(answers) != expected_n):
        raise ValueError(f"output 'answers' must be a list of {expected_n} extracted answers (str or null)")
    finish = output.get("finish_reasons")
    if finish is not None and (not isinstance(finish, list) or len(finish) != expected_n
                               or any(f not in ("stop", "length", None) for f in finish)):
        raise ValueError(f"output 'finish_reasons' must be a list of {expected_n} of 'stop', 'length' or null")
    message = output.get("message", "")
    return FnOutput(
        scores=[float(s) for s in scores],
        weight_versions=[None if v is None else str(v) for v in versions],
        message=message if isinstance(message, str) else str(message),
        answers=None if answers is None else [None if a is None else str(a) for a in answers],
        finish_reasons=finish,
    )
