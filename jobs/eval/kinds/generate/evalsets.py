"""Eval sets: JSONL files of prompt/answer rows, and the built-in addition set.

The eval config lives in ``run.json`` (:class:`ckpteval.coord.entries.generate.GenerateEntry`); this module turns a spec
into rows (scorers are :mod:`ckpteval.jobs.eval.scorers`'). Worker flags never change what is scored.

Rows: ``{"prompt": str, "answer": any, ...}``, or for ``prompt_format: "chat"`` datasets
``{"messages": [{"role": str, "content": str}, ...], "answer": any, ...}`` (a ``prompt`` also works there;
:mod:`ckpteval.jobs.eval.kinds.generate.prompts` renders both). ``answer`` is kept as a string; every other field of a row is
kept as it is (a scorer reads them: ``tests``, ``entry_point``, ``inputs``, ``question``, ...). What a
row must carry besides its prompt is its scorer's (``needs_answer``, ``required_row_fields``), checked
when the rows load; every error names the file and line.

Limits: rows are loaded whole into memory (eval sets are small).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import read_jsonl_file, write_bytes_atomic
from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.entries.rows import RowsEntry, subset_rows
from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.eval.scorers import check_row, scorer_class

Row = dict[str, Any]


def _check_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value)
    )


def _parse_row(row: Any, where: str) -> Row:
    """A row with its prompt checked and ``answer`` (when present) as a string; other fields kept."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: each row must be a JSON object with a string 'prompt' or a 'messages' list")
    out = dict(row)
    if "messages" in row:
        if not _check_messages(row["messages"]):
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': str, 'content': str}}")
        out["messages"] = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    elif not isinstance(row.get("prompt"), str):
        raise ValueError(f"{where}: each row needs a string 'prompt' or a 'messages' list")
    if row.get("answer") is not None:
        out["answer"] = str(row["answer"])
    return out


def load_rows(path: Path, scorer: type | None = None) -> list[Row]:
    """Read a JSONL eval set (:func:`ckpteval.coord.atomic.read_jsonl_file`); every error names the file and line.
    ``scorer``: a scorer class whose row needs (:func:`ckpteval.jobs.eval.scorers.check_row`) each row must meet
    (default: an ``answer``)."""
    try:
        lines = read_jsonl_file(path, what="eval-set row (JSON)")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: eval set not found") from None
    rows = []
    for lineno, raw in lines:
        rows.append(_parse_row(raw, f"{path}:{lineno}"))
        if scorer is not None:
            check_row(scorer, rows[-1], f"{path}:{lineno}")
        elif "answer" not in rows[-1]:
            raise ValueError(f"{path}:{lineno}: the row has no 'answer'")
    return rows


def load_entry_rows(path: Path, spec: RowsEntry) -> list[Row]:
    """Every row of an entry's file: checked against its scorer's needs (a ``generate`` entry), or, for an
    entry whose rows no scorer reads (an ``env`` entry), any JSON objects (checked at worker start)."""
    if not isinstance(spec, GenerateEntry):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path}: eval set not found")
        return [row for _lineno, row in read_jsonl_file(Path(path), what="env row")]
    try:
        scorer = scorer_class(spec.scorer)
    except ValueError as e:
        raise ValueError(f"dataset {spec.name!r}: {e}") from None
    return load_rows(path, scorer)


def load_dataset(run: RunDir, spec: RowsEntry) -> list[Row]:
    """The rows a dataset evaluates (its ``subset`` of the file, :func:`ckpteval.coord.entries.rows.subset_rows`),
    checked by :func:`load_entry_rows`; their count must match ``n_prompts``."""
    path = run.resolve_data_path(spec.path)
    rows = load_entry_rows(path, spec)
    try:
        rows = [rows[i] for i in subset_rows(len(rows), spec)]
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if len(rows) != spec.n_prompts:
        raise ValueError(f"{path}: {len(rows)} rows but run.json says n_prompts={spec.n_prompts} for {spec.name!r}")
    if spec.prompt_format == "raw" and any("messages" in r for r in rows):
        raise ValueError(f"{path}: rows with 'messages' need prompt_format 'chat' for {spec.name!r} in run.json")
    return rows


def write_jsonl(path: Path, rows: list[Row]) -> None:
    write_bytes_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode())


def write_addition_dataset(
    run: RunDir, name: str = "addition", n: int = 128, seed: int = 1234, shard_size: int = 64, **sampling: Any
) -> GenerateEntry:
    """The built-in eval set of the reference task, written into the run's ``data/`` dir.

    ``sampling``: further :class:`~ckpteval.coord.entries.generate.GenerateEntry` fields (``n_samples``, ``temperature``,
    ``pass_k``, ``every``, ...); greedy, one sample per prompt by default.
    """
    from ckpteval.jobs.reference.model import make_addition_examples

    rows = make_addition_examples(n, seed)
    write_jsonl(run.data / f"{name}.jsonl", rows)
    return GenerateEntry(
        name=name,
        path=f"data/{name}.jsonl",
        n_prompts=n,
        scorer="exact",
        shard_size=shard_size,
        max_new_tokens=max(len(r["answer"]) for r in rows) + 1,
        **sampling,
    )
