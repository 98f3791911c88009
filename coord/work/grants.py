"""Grants: the units adaptive evaluation adds to a step (``RUN/grants.jsonl``), and why.

A grant gives one dataset at one step more samples of *every* prompt: the sample range ``[start, stop)``
beyond its ``n_samples`` (absolute sample indices, so per-sample seeds never repeat), as one unit per prompt
shard (:class:`~ckpteval.coord.work.workunit.WorkUnit` with that range). Those units are claimed, leased and
published like any unit; a point pools them (:func:`topups`) only once every shard of a range has an ok
result and the ranges are contiguous from ``n_samples``, so every prompt of a point has the same samples.
Which prompts, and in which order, never changes: only how many samples each gets.

Format (docs/PROTOCOL.md "Grants"): append-only JSON lines, one writer (the trainer's dispatcher,
:mod:`ckpteval.jobs.trainer.adaptive`), fsync'd; read by every worker each poll. Fields: ``step``,
``dataset``, ``samples`` ``[start, stop]``, ``reason`` (a sentence: why the decision at that step is still
open), ``time``. Guarantee: a torn last line is ignored (an append arriving); any other bad line is a
ValueError naming ``path:line``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import append_line, read_jsonl_numbered
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.work.workunit import WorkUnit

GRANTS_FILE = "grants.jsonl"


@dataclass(frozen=True)
class Grant:
    step: int
    dataset: str
    start: int
    stop: int
    reason: str

    def units(self, manifest: RunManifest) -> list[WorkUnit]:
        """One unit per prompt shard of the dataset, with this grant's sample range."""
        entry = manifest.entry(self.dataset)
        return [WorkUnit(self.step, self.dataset, shard, self.start, self.stop) for shard in range(entry.n_shards)]

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "dataset": self.dataset, "samples": [self.start, self.stop],
                "reason": self.reason, "time": time.time()}


@dataclass
class Grants:
    """Every grant of a run, by step; :meth:`refresh` re-reads the file when it changed."""

    path: Path
    by_step: dict[int, list[Grant]] = field(default_factory=dict)
    _seen: tuple[int, int] = (-1, -1)

    @classmethod
    def of(cls, run_path: Path) -> Grants:
        return cls(Path(run_path) / GRANTS_FILE).refresh()

    def refresh(self) -> Grants:
        """Re-read the file if its size or mtime changed (one ``stat`` otherwise)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.by_step, self._seen = {}, (-1, -1)
            return self
        if (st.st_size, st.st_mtime_ns) != self._seen:
            self.by_step = {}
            for lineno, rec in read_jsonl_numbered(self.path, what="grant")[0]:
                grant = parse_grant(rec, f"{self.path}:{lineno}")
                self.by_step.setdefault(grant.step, []).append(grant)
            self._seen = (st.st_size, st.st_mtime_ns)
        return self

    @property
    def version(self) -> tuple[int, int]:
        """What the last read saw (size, mtime): changes when a grant is appended."""
        return self._seen

    def units(self, manifest: RunManifest, step: int) -> list[WorkUnit]:
        return [u for g in self.by_step.get(step, []) for u in g.units(manifest)]

    def samples(self, step: int, dataset: str) -> int:
        """The end of the granted sample ranges of ``dataset`` at ``step`` (0: none)."""
        return max((g.stop for g in self.by_step.get(step, []) if g.dataset == dataset), default=0)

    def append(self, grant: Grant) -> None:
        """Record ``grant`` (the one writer): one fsync'd line, then this reader's view."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        append_line(self.path, (json.dumps(grant.to_json(), sort_keys=True) + "\n").encode())
        self.refresh()


def parse_grant(rec: Mapping[str, Any], where: str) -> Grant:
    """A grant record, or ValueError naming ``where`` and the field."""
    samples = rec.get("samples")
    if not isinstance(rec.get("step"), int) or rec["step"] < 0:
        raise ValueError(f"{where}: grant field step must be an integer >= 0, got {rec.get('step')!r}")
    if not isinstance(rec.get("dataset"), str):
        raise ValueError(f"{where}: grant field dataset must be a name, got {rec.get('dataset')!r}")
    if not (isinstance(samples, list) and len(samples) == 2 and all(isinstance(s, int) for s in samples)
            and 0 <= samples[0] < samples[1]):
        raise ValueError(f"{where}: grant field samples must be [start, stop) with 0 <= start < stop, got {samples!r}")
    return Grant(rec["step"], rec["dataset"], samples[0], samples[1], str(rec.get("reason", "")))


def topups(n_samples: int, step: int, dataset: str, results: Mapping[WorkUnit, Any],
           shards: int) -> list[Any]:
    """The ok results of ``dataset``'s granted sample ranges at ``step`` that a point pools: the ranges
    contiguous from ``n_samples`` whose every shard has an ok result, in (range, shard) order."""
    ranges: dict[tuple[int, int], dict[int, Any]] = {}
    for unit, result in results.items():
        if unit.step == step and unit.dataset == dataset and not unit.replay and unit.sample_start >= n_samples > 0:
            ranges.setdefault((unit.sample_start, unit.sample_stop), {})[unit.shard] = result
    out: list[Any] = []
    edge = n_samples
    for start, stop in sorted(ranges):
        parts = ranges[(start, stop)]
        if start != edge or len(parts) != shards or not all(parts[s].ok for s in range(shards) if s in parts):
            break
        out += [parts[s] for s in range(shards)]
        edge = stop
    return out
