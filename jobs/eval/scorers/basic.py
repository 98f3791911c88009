"""The built-in scorers: ``exact``, ``math``, and ``module:function`` user functions.

- ``exact`` (:class:`ExactScorer`): whitespace-stripped equality with the row's ``answer``; the extracted
  answer is the stripped completion.
- ``math`` (:class:`MathScorer`): Hugging Face's math-verify in the process's grading pool with a
  per-answer deadline (the dataset's ``grader_timeout_s``, :mod:`ckpteval.jobs.eval.scorers.grader`); a timed-out answer
  scores 0 and is counted (``grader_timeouts``).
- ``module:function`` (:class:`FunctionScorer`): a function taking ``(completion, answer)`` and returning
  a float, or ``(float, extracted answer or None)``; a bare float has no extracted answer (such a
  dataset gets no ``maj@n``). Imported when the scorer is built (after the trust check), not when
  run.json is parsed.

None takes ``scorer_options``. Limits: a ``module:function`` runs in the worker's thread with its
privileges; its exception is the unit's ``crashed`` skip (:func:`ckpteval.jobs.eval.scorers.score_samples`).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.jobs.eval.scorers import BaseScorer, Sample, Scored, ScorerContext


def _answers(samples: list[Sample]) -> list[str]:
    return [s.answer or "" for s in samples]


class ExactScorer(BaseScorer):
    """Whitespace-stripped equality; the extracted answer is the stripped completion."""

    def score(self, samples: list[Sample]) -> list[Scored]:
        return [exact(s.completion, a) for s, a in zip(samples, _answers(samples), strict=True)]


def exact(completion: str, answer: str) -> Scored:
    got = completion.strip()
    return Scored(float(got == answer.strip()), got)


class MathScorer(BaseScorer):
    """math-verify in the grading pool, ``grader_timeout_s`` per answer (see the module docstring)."""

    def __init__(self, spec: GenerateEntry, ctx: ScorerContext) -> None:
        super().__init__(spec, ctx)
        try:
            importlib.import_module("math_verify")
        except ImportError:
            raise ValueError("scorer 'math' needs the math-verify package: pip install math-verify") from None

    def score(self, samples: list[Sample]) -> list[Scored]:
        from ckpteval.jobs.eval.scorers.grader import default_pool

        pairs = [(s.completion, a) for s, a in zip(samples, _answers(samples), strict=True)]
        return [Scored(g.score, g.answer, g.timed_out) for g in default_pool().grade(pairs, self.spec.grader_timeout_s)]

    def no_answer(self, sample: Sample, scored: Scored) -> bool:
        """math-verify extracted no answer (a timed-out grade included: nothing was extracted in time)."""
        return scored.answer is None

    def identity(self) -> dict[str, Any]:
        return {"name": "math", "grader_timeout_s": self.spec.grader_timeout_s}


class FunctionScorer(BaseScorer):
    """A per-sample ``(completion, answer)`` function named ``module:function``, called in this thread."""

    def __init__(self, spec: GenerateEntry, ctx: ScorerContext) -> None:
        super().__init__(spec, ctx)
        self.fn = import_function(spec.scorer)

    def score(self, samples: list[Sample]) -> list[Scored]:
        return [as_scored(self.fn(s.completion, a), self.spec.scorer) for s, a in zip(samples, _answers(samples), strict=True)]


def import_function(name: str) -> Callable[[str, str], Any]:
    module_name, _, func_name = name.partition(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"scorer {name!r} cannot be imported ({e})") from None
    if not callable(func):
        raise ValueError(f"scorer {name!r} is not callable")
    return func  # type: ignore[no-any-return]


def as_scored(value: Any, name: str) -> Scored:
    """A scoring function's return value (float, or (float, answer)) as :class:`Scored`."""
    answer = None
    if isinstance(value, tuple):
        if len(value) != 2:
            raise ValueError(f"scorer {name!r} returned a tuple of {len(value)}; expected (score, answer)")
        value, answer = value
        answer = None if answer is None else str(answer)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"scorer {name!r} returned {value!r}; expected a finite number")
    return Scored(float(value), answer)
