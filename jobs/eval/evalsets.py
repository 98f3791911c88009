"""Eval sets: JSONL files of prompt/answer rows, their scorers, and the built-in addition set.

The eval config lives in ``run.json`` (:class:`coord.manifest.DatasetSpec`); this module turns a spec
into rows and a scoring function. Worker flags never change what is scored.

Scorers: ``exact`` (whitespace-stripped equality), ``math`` (gsm8k style: the number after ``####``
if present, else the last number in the completion, compared numerically with the answer's), or
``module:function`` taking ``(completion, answer) -> float``.

Limits: rows are loaded whole into memory (eval sets are small); a custom scorer runs in the worker's
process with its privileges.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from pathlib import Path

from coord.atomic import write_bytes_atomic
from coord.manifest import DatasetSpec
from coord.rundir import RunDir

Scorer = Callable[[str, str], float]
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def load_rows(path: Path) -> list[dict[str, str]]:
    """Read a JSONL eval set; every error names the file and line."""
    rows = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: eval set not found") from None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: malformed JSON ({e})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "answer" not in row:
            raise ValueError(f"{path}:{lineno}: each row needs a string 'prompt' and an 'answer'")
        rows.append({"prompt": row["prompt"], "answer": str(row["answer"])})
    return rows


def load_dataset(run: RunDir, spec: DatasetSpec) -> list[dict[str, str]]:
    """The rows of a dataset; their count must match the manifest's ``n_prompts``."""
    path = run.resolve_data_path(spec.path)
    rows = load_rows(path)
    if len(rows) != spec.n_prompts:
        raise ValueError(f"{path}: {len(rows)} rows but run.json says n_prompts={spec.n_prompts} for {spec.name!r}")
    return rows


def exact_scorer(completion: str, answer: str) -> float:
    return float(completion.strip() == answer.strip())


def _to_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def extract_math_answer(text: str) -> float | None:
    """gsm8k style: the number after ``####`` if present, else the last number in the text."""
    if "####" in text:
        text = text.split("####")[-1]
    numbers = NUMBER.findall(text)
    return _to_number(numbers[-1]) if numbers else None


def math_scorer(completion: str, answer: str) -> float:
    got, want = extract_math_answer(completion), extract_math_answer(answer)
    return float(got is not None and want is not None and abs(got - want) < 1e-6)


def get_scorer(name: str) -> Scorer:
    if name == "exact":
        return exact_scorer
    if name == "math":
        return math_scorer
    module_name, _, func_name = name.partition(":")
    if not module_name or not func_name:
        raise ValueError(f"scorer {name!r} must be 'exact', 'math' or 'module:function'")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"scorer {name!r} cannot be imported ({e})") from None
    if not callable(func):
        raise ValueError(f"scorer {name!r} is not callable")
    return func


def write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    write_bytes_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode())


def write_addition_dataset(
    run: RunDir, name: str = "addition", n: int = 128, seed: int = 1234, shard_size: int = 64
) -> DatasetSpec:
    """The built-in eval set of the reference task, written into the run's ``data/`` dir."""
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
    )
