"""Kept completions: every sample's text beside its unit's result, gzip-compressed JSON.

A unit of a ``generate`` entry keeps what its engine produced in ``results/step-<N>/<unit>.completions.json.gz``
(generation ``k`` > 0: ``<unit>.retry<k>.completions.json.gz``; :func:`completions_name`), so a new scorer, new
scorer options or a reasoning setting can be applied later on CPU (``ckpteval rescore``) and a completion store
(:mod:`ckpteval.jobs.eval.kinds.generate.store`) can answer an identical unit of another run. One gzip'd JSON object, columnar
(one list per field, one entry per sample, prompt-major):

``{"format": "ckpteval-completions", "version": 1, "unit": {...}, "generation": k, "lease_token": t,
"rows_sha256": h, "prompts": [one rendered prompt per prompt row], "text": [...], "finish_reason": [...],
"n_tokens": [...], "prompt_tokens": [...], "seed": [...], "weight_version": [...], "sha256": d}`` (a completion
store's entry adds ``"store_key"``, the content key it is filed under). ``sha256`` (:func:`content_digest`) is
over everything but the stamps; the unit's result records it too (``completions_sha256``), so the kept text is
bound to the number scored from it: a file whose text was edited is refused by its reader, and one rewritten
whole (text and digest) no longer matches its result (``ckpteval rescore`` refuses it, naming the file).

Guarantees: the file is published after its unit's result won first-writer-wins, itself first-writer-wins (temp
name, fsync, ``renameat2(RENAME_NOREPLACE)`` or link), so a name never holds a torn file and never a loser's
samples; its ``lease_token`` is the result's, so a reader can tell it belongs to that result. A reader
(:func:`read_completions`) trusts nothing partial: a truncated or corrupt gzip stream (CRC-32 and length
trailer), a JSON error, a wrong format or a field whose length is not one per sample is a ``ValueError`` naming
the file, never a default.

Limits: the result is published first, so a worker that dies between the two writes leaves a result without kept
completions (``rescore`` skips that unit, saying so). Nothing here is a pickle: text and numbers only. The name
does not end in ``.json``, so result readers never take it for a result.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import publish_exclusive, write_bytes_atomic
from ckpteval.coord.run.rundir import unit_dir
from ckpteval.coord.work.units import WorkUnit

FORMAT = "ckpteval-completions"
VERSION = 1
SUFFIX = ".completions.json.gz"
PER_SAMPLE = ("text", "finish_reason", "n_tokens", "prompt_tokens", "seed", "weight_version")
GZIP_LEVEL = 6  # level 9 saved under 2% more on completions, at twice the time


def completions_name(unit: WorkUnit, generation: int = 0) -> str:
    """The kept completions of ``unit``'s result of ``generation``: ``<result name less .json>.completions.json.gz``."""
    return unit.result_name_at(generation)[: -len(".json")] + SUFFIX


def completions_path(results_dir: Path, unit: WorkUnit, generation: int = 0) -> Path:
    return unit_dir(results_dir, unit.step) / completions_name(unit, generation)


def rows_digest(rows: Sequence[Any]) -> str:
    """SHA-256 of the canonical JSON of a unit's rows (sorted keys, no whitespace, UTF-8): what the kept
    completions answered, so a re-score on edited rows is refused rather than scored against new gold."""
    blob = json.dumps(list(rows), sort_keys=True, separators=(",", ":"), allow_nan=False)  # ASCII: a lone
    return hashlib.sha256(blob.encode()).hexdigest()  # surrogate (a "\ud800" escape in a row) still encodes


@dataclass(frozen=True)
class Completions:
    """One unit's samples as its engine produced them (prompt-major; ``prompts``: one per prompt row)."""

    unit: WorkUnit
    prompts: tuple[str, ...]
    text: tuple[str, ...]
    finish_reason: tuple[str | None, ...]
    n_tokens: tuple[int, ...]
    prompt_tokens: tuple[int | None, ...]
    seed: tuple[int | None, ...]
    weight_version: tuple[str | None, ...]
    rows_sha256: str
    generation: int = 0
    lease_token: str | None = None
    store_key: str | None = None  # a completion store entry's content key (ckpteval.jobs.eval.kinds.generate.store); None elsewhere

    def __post_init__(self) -> None:
        n = len(self.text)
        for name in PER_SAMPLE:
            if len(getattr(self, name)) != n:
                raise ValueError(f"unit {self.unit.id}: {n} texts but {len(getattr(self, name))} {name}")
        if n and (not self.prompts or n % len(self.prompts)):
            raise ValueError(f"unit {self.unit.id}: {n} samples do not split over {len(self.prompts)} prompts")

    @property
    def per_prompt(self) -> int:
        return len(self.text) // len(self.prompts) if self.prompts else 0

    def sample_prompts(self) -> list[str]:
        """The rendered prompt of every sample (prompt-major)."""
        return [p for p in self.prompts for _ in range(self.per_prompt)]

    def content(self) -> dict[str, Any]:
        """What the samples are (unit, rows, prompts, every per-sample field): the record less its stamps
        (generation, lease token, store key), which are set after the text is."""
        return {"unit": self.unit.to_json(), "rows_sha256": self.rows_sha256, "prompts": list(self.prompts),
                **{name: list(getattr(self, name)) for name in PER_SAMPLE}}

    def to_json(self) -> dict[str, Any]:
        content = self.content()
        return {"format": FORMAT, "version": VERSION, "generation": self.generation, "lease_token": self.lease_token,
                **content, "sha256": content_digest(content),
                **({"store_key": self.store_key} if self.store_key is not None else {})}


def content_digest(content: Completions | dict[str, Any]) -> str:
    """SHA-256 of a record's :meth:`Completions.content` (canonical JSON): what a result binds its kept text by
    (``Result.completions_sha256``) and what each file carries as ``sha256``, checked when it is read."""
    obj = content.content() if isinstance(content, Completions) else content
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()).hexdigest()


def encode(record: Completions) -> bytes:
    """The file's bytes: gzip (mtime 0, so equal records give equal bytes) of compact, NaN-free, ASCII JSON (an
    engine's text may hold a lone surrogate, which UTF-8 cannot carry; escaped, it round-trips)."""
    blob = json.dumps(record.to_json(), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return gzip.compress(blob.encode(), compresslevel=GZIP_LEVEL, mtime=0)


def decode(data: bytes, source: Path) -> Completions:
    """Parse a kept-completions file; ValueError naming ``source`` for anything partial, corrupt or malformed."""
    try:
        obj = json.loads(gzip.decompress(data))
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError) as e:  # BadGzipFile is an OSError
        raise ValueError(f"{source}: not a whole kept-completions file ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT or obj.get("version") != VERSION:
        raise ValueError(f"{source}: not a {FORMAT} v{VERSION} file")
    try:
        record = Completions(
            unit=WorkUnit.from_json(obj["unit"]),
            prompts=tuple(_strs(obj["prompts"], "prompts", nullable=False)),
            text=tuple(_strs(obj["text"], "text", nullable=False)),
            finish_reason=tuple(_strs(obj["finish_reason"], "finish_reason")),
            n_tokens=tuple(_ints(obj["n_tokens"], "n_tokens", nullable=False)),
            prompt_tokens=tuple(_ints(obj["prompt_tokens"], "prompt_tokens")),
            seed=tuple(_ints(obj["seed"], "seed")),
            weight_version=tuple(_strs(obj["weight_version"], "weight_version")),
            rows_sha256=_str(obj["rows_sha256"], "rows_sha256"),
            generation=int(obj.get("generation", 0)),
            lease_token=obj.get("lease_token") if isinstance(obj.get("lease_token"), str) else None,
            store_key=obj.get("store_key") if isinstance(obj.get("store_key"), str) else None,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{source}: malformed kept completions ({type(e).__name__}: {e})") from None
    if "sha256" not in obj:  # every writer writes it: a file without one was edited (or is no ckpteval file)
        raise ValueError(f"{source}: no sha256 written with its text (edited, or not written by ckpteval)")
    if obj["sha256"] != content_digest(record):
        raise ValueError(f"{source}: its text does not match the sha256 written with it (edited or damaged)")
    return record


def _str(v: Any, name: str) -> str:
    if not isinstance(v, str):
        raise ValueError(f"field {name} must be a string")
    return v


def _strs(values: Any, name: str, nullable: bool = True) -> list[str | None]:
    if not isinstance(values, list) or not all(isinstance(v, str) or (nullable and v is None) for v in values):
        raise ValueError(f"field {name} must be a list of strings{' or nulls' if nullable else ''}")
    return values


def _ints(values: Any, name: str, nullable: bool = True) -> list[int | None]:
    def ok(v: Any) -> bool:
        return (isinstance(v, int) and not isinstance(v, bool)) or (nullable and v is None)

    if not isinstance(values, list) or not all(ok(v) for v in values):
        raise ValueError(f"field {name} must be a list of integers{' or nulls' if nullable else ''}")
    return values


def publish_completions(results_dir: Path, record: Completions) -> bool:
    """Publish ``record`` beside its result (first writer wins); True if this call wrote it."""
    return publish_exclusive(completions_path(results_dir, record.unit, record.generation), encode(record))


def replace_completions(path: Path, record: Completions) -> None:
    """Write ``record`` at ``path`` whole (temp, fsync, rename over): for a store entry that failed to read."""
    write_bytes_atomic(path, encode(record))


def read_completions(path: Path) -> Completions:
    """Read and check a kept-completions file (FileNotFoundError when there is none)."""
    return decode(Path(path).read_bytes(), Path(path))


def keep_beside(results_dir: Path, record: Completions, generation: int, lease_token: str | None, n_scores: int) -> bool:
    """Publish a just-won result's completions (:func:`ckpteval.coord.results.files.write_result`); never raises for
    the disk: a failure to keep (a full disk, a read-only dir) is one line on stderr and the result stands."""
    import dataclasses
    import sys

    if len(record.text) != n_scores:
        print(f"ckpteval: unit {record.unit.id}: {len(record.text)} completions for {n_scores} scores; not kept",
              file=sys.stderr, flush=True)
        return False
    stamped = dataclasses.replace(record, generation=generation, lease_token=lease_token)
    try:
        return publish_completions(results_dir, stamped)
    except (OSError, ValueError) as e:  # a full disk, a read-only dir; a value JSON cannot carry
        print(f"ckpteval: {completions_path(results_dir, record.unit, generation)}: completions not kept ({e})",
              file=sys.stderr, flush=True)
        return False


def record_generations(unit: WorkUnit, prompts: Sequence[str], rows_sha256: str, seeds: Sequence[int] | None,
                       generations: Sequence[Any]) -> Completions:
    """The record of an engine's generations (objects with ``text``, ``weight_version``, ``n_tokens``,
    ``prompt_tokens`` and optionally ``finish_reason``: :class:`ckpteval.jobs.eval.engines.base.Generation`);
    ``prompts``: one per prompt row; ``seeds``: one per sample, or None (greedy: no seeds sent)."""
    return Completions(
        unit=unit,
        prompts=tuple(prompts),
        text=tuple(g.text for g in generations),
        finish_reason=tuple(getattr(g, "finish_reason", None) for g in generations),
        n_tokens=tuple(int(g.n_tokens) for g in generations),
        prompt_tokens=tuple(g.prompt_tokens for g in generations),
        seed=tuple(seeds) if seeds is not None else (None,) * len(generations),
        weight_version=tuple(g.weight_version for g in generations),
        rows_sha256=rows_sha256,
    )
