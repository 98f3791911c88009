"""The trainer's own prompts, streamed in batches from the files a layout or the user names
(docs/USER_GUIDE.md "Contamination gate"): JSONL, JSON (a list of rows, or an object holding one), parquet
(read by column batches with pyarrow), or a directory of them (searched recursively, in name order).

Guarantee: every error names the file (and line) and what is wrong. Limits: a JSON file is read whole;
rows are read once per check and never kept (only the matches are).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpteval.jobs.eval.contamination.text import PROMPT_FIELDS, row_text

SUFFIXES = (".jsonl", ".json", ".parquet")
VERIFIERS = "verifiers:"  # a verifiers environment's tasks: verifiers:<id>[?<json taskset options>]
BATCH = 4096


@dataclass(frozen=True)
class Batch:
    """Training rows of one file: ``first`` is the file row (0-based) of ``texts[0]``."""

    path: Path
    first: int
    texts: list[str]


def data_files(source: Path | str) -> list[Path]:
    """The data files of ``source``: itself, or the JSONL/JSON/parquet files under a directory (a
    ``verifiers:<id>`` source: itself). FileNotFoundError / ValueError name ``source`` and what is wrong."""
    if str(source).startswith(VERIFIERS):
        return [Path(str(source))]
    source = Path(source).expanduser()
    if source.is_dir():
        found = sorted(p for p in source.rglob("*") if p.suffix in SUFFIXES and p.is_file())
        if not found:
            raise ValueError(f"{source}: training data directory holds no {'/'.join(SUFFIXES)} files")
        return found
    if not source.exists():
        raise FileNotFoundError(f"{source}: training data file not found")
    if source.suffix not in SUFFIXES:
        raise ValueError(f"{source}: training data must be {', '.join(SUFFIXES)} (or a directory of them)")
    return [source]


def batches(path: Path, field: str | None = None, size: int = BATCH) -> Iterator[Batch]:
    """The prompt texts of ``path`` (:func:`~ckpteval.jobs.eval.contamination.text.row_text`) in batches."""
    if str(path).startswith(VERIFIERS):
        reader = _taskset_texts
    else:
        reader = {".jsonl": _jsonl_rows, ".json": _json_rows, ".parquet": _parquet_texts}[path.suffix]
    texts: list[str] = []
    first = 0
    for text in reader(path, field):
        texts.append(text)
        if len(texts) == size:
            yield Batch(path, first, texts)
            first, texts = first + size, []
    if texts:
        yield Batch(path, first, texts)


def _jsonl_rows(path: Path, field: str | None) -> Iterator[str]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}:{lineno}: not a JSON line ({e})") from None
            yield row_text(row, field)


def _json_rows(path: Path, field: str | None) -> Iterator[str]:
    try:
        data: Any = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise ValueError(f"{path}: a JSON object of training data must hold exactly one list of rows")
        data = lists[0]
    if not isinstance(data, list):
        raise ValueError(f"{path}: training data JSON must be a list of rows (or an object holding one)")
    for row in data:
        yield row_text(row, field)


def _parquet_texts(path: Path, field: str | None) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RuntimeError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        pf = pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"{path}: not a readable parquet file ({e})") from None
    names = pf.schema_arrow.names
    wanted = [field] if field else [n for n in PROMPT_FIELDS if n in names][:1] or names
    if field and field not in names:
        raise ValueError(f"{path}: no column {field!r} (columns: {', '.join(names)})")
    for batch in pf.iter_batches(columns=wanted, batch_size=BATCH):
        for row in batch.to_pylist():
            yield row_text(row, field)


def parse_verifiers(source: str) -> tuple[str, dict[str, Any]]:
    """``verifiers:<id>[?<json options>]`` -> (id, options); ValueError naming the source."""
    env_id, _, options = source.removeprefix(VERIFIERS).partition("?")
    try:
        parsed = json.loads(options) if options else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: the options after '?' are not JSON ({e})") from None
    if not env_id or not isinstance(parsed, dict):
        raise ValueError(f"{source}: expected verifiers:<id>[?<json object of taskset options>]")
    return env_id, parsed


def _taskset_texts(path: Path, field: str | None) -> Iterator[str]:
    from ckpteval.jobs.eval.kinds.env.verifiers_env import taskset_prompts

    env_id, options = parse_verifiers(str(path))
    try:
        prompts = taskset_prompts(env_id, options)
    except Exception as e:  # user code: the environment's own loading
        raise RuntimeError(f"{path}: the verifiers environment {env_id!r} did not load its tasks ({e})") from e
    for prompt in prompts:
        yield row_text({"prompt": prompt}, None)
