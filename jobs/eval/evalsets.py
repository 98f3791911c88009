"""Eval sets: JSONL files of prompt/answer rows, their scorers, and the built-in addition set.

The eval config lives in ``run.json`` (:class:`coord.manifest.DatasetSpec`); this module turns a spec
into rows and a scoring function. Worker flags never change what is scored.

Rows: ``{"prompt": str, "answer": any}``, or for ``prompt_format: "chat"`` datasets
``{"messages": [{"role": str, "content": str}, ...], "answer": any}`` (a ``prompt`` also works there;
:mod:`jobs.eval.prompts` renders both). ``answer`` is kept as a string.

Scorers (:class:`Scorer`: a batch of completions and gold answers in, one :class:`Scored` per sample
out — the score *and* the extracted answer, which majority voting needs):

- ``exact``: whitespace-stripped equality; the extracted answer is the stripped completion.
- ``math``: Hugging Face's math-verify in a process pool with a per-answer deadline
  (:mod:`jobs.eval.grader`); a timed-out answer scores 0 and is counted.
- ``module:function`` taking ``(completion, answer)`` and returning a float, or ``(float, extracted
  answer or None)``; a bare float has no extracted answer (such a dataset gets no ``maj@n``).

Limits: rows are loaded whole into memory (eval sets are small); a custom scorer runs in the worker's
process with its privileges.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from coord.atomic import read_jsonl_file, write_bytes_atomic
from coord.manifest import DatasetSpec
from coord.rundir import RunDir

Row = dict[str, Any]
ScoreFn = Callable[[str, str], Any]


@dataclass(frozen=True)
class Scored:
    """One sample's score, the answer the scorer extracted (None: nothing), and whether grading timed out."""

    score: float
    answer: str | None
    timed_out: bool = False


class Scorer(Protocol):
    def score(self, completions: list[str], answers: list[str]) -> list[Scored]: ...


def _check_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value)
    )


def _parse_row(row: Any, where: str) -> Row:
    if not isinstance(row, dict) or "answer" not in row:
        raise ValueError(f"{where}: each row needs an 'answer' and a string 'prompt' or a 'messages' list")
    if "messages" in row:
        if not _check_messages(row["messages"]):
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': str, 'content': str}}")
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in row["messages"]],
                "answer": str(row["answer"])}
    if not isinstance(row.get("prompt"), str):
        raise ValueError(f"{where}: each row needs an 'answer' and a string 'prompt' or a 'messages' list")
    return {"prompt": row["prompt"], "answer": str(row["answer"])}


def load_rows(path: Path) -> list[Row]:
    """Read a JSONL eval set (:func:`coord.atomic.read_jsonl_file`); every error names the file and line."""
    try:
        lines = read_jsonl_file(path, what="eval-set row (JSON)")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: eval set not found") from None
    return [_parse_row(row, f"{path}:{lineno}") for lineno, row in lines]


def load_dataset(run: RunDir, spec: DatasetSpec) -> list[Row]:
    """The rows of a dataset; their count must match the manifest's ``n_prompts``."""
    path = run.resolve_data_path(spec.path)
    rows = load_rows(path)
    if len(rows) != spec.n_prompts:
        raise ValueError(f"{path}: {len(rows)} rows but run.json says n_prompts={spec.n_prompts} for {spec.name!r}")
    if spec.prompt_format == "raw" and any("messages" in r for r in rows):
        raise ValueError(f"{path}: rows with 'messages' need prompt_format 'chat' for {spec.name!r} in run.json")
    return rows


def exact_scorer(completion: str, answer: str) -> tuple[float, str]:
    got = completion.strip()
    return float(got == answer.strip()), got


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


class FunctionScorer:
    """A per-sample ``(completion, answer)`` function, called in this thread."""

    def __init__(self, fn: ScoreFn, name: str) -> None:
        self.fn, self.name = fn, name

    def score(self, completions: list[str], answers: list[str]) -> list[Scored]:
        return [as_scored(self.fn(c, a), self.name) for c, a in zip(completions, answers, strict=True)]


class MathScorer:
    """math-verify in the process's grading pool (:func:`jobs.eval.grader.default_pool`), ``timeout_s`` per answer."""

    def __init__(self, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s

    def score(self, completions: list[str], answers: list[str]) -> list[Scored]:
        from jobs.eval.grader import default_pool

        graded = default_pool().grade(list(zip(completions, answers, strict=True)), self.timeout_s)
        return [Scored(g.score, g.answer, g.timed_out) for g in graded]


def get_scorer(name: str, grader_timeout_s: float | None = None) -> Scorer:
    """The scorer named ``name``; ``grader_timeout_s``: the ``math`` grader's deadline per answer."""
    if name == "exact":
        return FunctionScorer(exact_scorer, name)
    if name == "math":
        try:
            importlib.import_module("math_verify")
        except ImportError:
            raise ValueError("scorer 'math' needs the math-verify package: pip install math-verify") from None
        return MathScorer(grader_timeout_s)
    module_name, _, func_name = name.partition(":")
    if not module_name or not func_name:
        raise ValueError(f"scorer {name!r} must be 'exact', 'math' or 'module:function'")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"scorer {name!r} cannot be imported ({e})") from None
    if not callable(func):
        raise ValueError(f"scorer {name!r} is not callable")
    return FunctionScorer(func, name)


def write_jsonl(path: Path, rows: list[Row]) -> None:
    write_bytes_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode())


def write_addition_dataset(
    run: RunDir, name: str = "addition", n: int = 128, seed: int = 1234, shard_size: int = 64, **sampling: Any
) -> DatasetSpec:
    """The built-in eval set of the reference task, written into the run's ``data/`` dir.

    ``sampling``: further :class:`~coord.manifest.DatasetSpec` fields (``n_samples``, ``temperature``,
    ``pass_k``, ``every``, ...); greedy, one sample per prompt by default.
    """
    from jobs.reference.model import make_addition_examples

    rows = make_addition_examples(n, seed)
    write_jsonl(run.data / f"{name}.jsonl", rows)
    return DatasetSpec(
        name=name,
        path=f"data/{name}.jsonl",
        n_prompts=n,
        scorer="exact",
        shard_size=shard_size,
        max_new_tokens=max(len(r["answer"]) for r in rows) + 1,
        **sampling,
    )
