"""A work unit: one prompt shard (and sample range) of one entry at one step, and its names on disk.

Guarantee: :attr:`WorkUnit.id` and :meth:`WorkUnit.from_id` round-trip, and a unit's result file names
(:attr:`WorkUnit.result_name`, :meth:`WorkUnit.result_name_at`) derive from its id alone, so every reader
and writer of a run agrees on them. Which units a step has is the entries' answer
(:mod:`ckpteval.coord.entries`); who holds one is :mod:`ckpteval.coord.work.claims`'. Limits: a dataset name is
not checked here (the manifest checks names).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SAMPLES_RE = re.compile(r"s(\d+)-(\d+)")  # the sample range of a split unit's id: s<start>-<stop>
REPLAY_RE = re.compile(r"r([1-9]\d*)")  # a replay's copy number in a unit id: r<k>, k >= 1


@dataclass(frozen=True, order=True)
class WorkUnit:
    """One unit of work: a prompt shard of a dataset at a step, and — when the dataset splits samples
    (``samples_per_unit``) — the half-open sample range ``[sample_start, sample_stop)`` of each of its
    prompts. ``sample_stop == 0``: every sample of the prompts (the unsplit unit, whose id has no range).

    ``replay`` k >= 1: the k-th *replay* of that unit — the same snapshot, prompts, samples and seeds
    evaluated again to measure the engine's own noise (``eval.replay``, :mod:`ckpteval.coord.results.replays`); its id
    ends ``.r<k>``. A replay is claimed, leased and published like any unit (its own lease and result
    file, exactly once), and never pooled into the point's scores. 0: the unit itself."""

    step: int
    dataset: str
    shard: int
    sample_start: int = 0
    sample_stop: int = 0
    replay: int = 0

    @property
    def id(self) -> str:
        base = f"{self.step:010d}.{self.dataset}.{self.shard:05d}"
        base = f"{base}.s{self.sample_start:05d}-{self.sample_stop:05d}" if self.sample_stop else base
        return f"{base}.r{self.replay}" if self.replay else base

    @classmethod
    def from_id(cls, unit_id: str) -> WorkUnit:
        parts = unit_id.split(".")
        replay = REPLAY_RE.fullmatch(parts[-1]) if len(parts) > 3 else None
        if replay is not None:
            parts = parts[:-1]
        samples = SAMPLES_RE.fullmatch(parts[3]) if len(parts) == 4 else None
        if len(parts) not in (3, 4) or not parts[0].isdigit() or not parts[2].isdigit() or (
            len(parts) == 4 and (samples is None or int(samples[1]) >= int(samples[2]))
        ):
            raise ValueError(f"{unit_id!r} is not a unit id (<step>.<dataset>.<shard>[.s<start>-<stop>][.r<k>])")
        start, stop = (int(samples[1]), int(samples[2])) if samples else (0, 0)
        return cls(int(parts[0]), parts[1], int(parts[2]), start, stop, int(replay[1]) if replay else 0)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"step": self.step, "dataset": self.dataset, "shard": self.shard}
        if self.sample_stop:
            out["samples"] = [self.sample_start, self.sample_stop]
        if self.replay:
            out["replay"] = self.replay
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> WorkUnit:
        """The unit of a result's ``unit`` object (KeyError/TypeError/ValueError when malformed)."""
        start, stop = obj.get("samples") or (0, 0)
        unit = cls(int(obj["step"]), str(obj["dataset"]), int(obj["shard"]), int(start), int(stop),
                   int(obj.get("replay", 0)))
        if unit.sample_stop and not 0 <= unit.sample_start < unit.sample_stop:
            raise ValueError(f"samples {[start, stop]} is not a sample range [start, stop)")
        if unit.replay < 0:
            raise ValueError(f"replay {unit.replay} must be >= 0")
        return unit

    def as_replay(self, k: int) -> WorkUnit:
        """The ``k``-th replay of this unit (k >= 1; 0: the unit itself)."""
        return WorkUnit(self.step, self.dataset, self.shard, self.sample_start, self.sample_stop, k)

    @property
    def label(self) -> str:
        """How logs name the unit: ``addition[0]``, ``aime[3] samples 16-32`` when split, ``... replay 1``."""
        where = f"{self.dataset}[{self.shard}]"
        where = f"{where} samples {self.sample_start}-{self.sample_stop}" if self.sample_stop else where
        return f"{where} replay {self.replay}" if self.replay else where

    def sample_range(self, n_samples: int) -> range:
        """The sample indices (of each of its prompts) this unit generates: absolute, so seeds never change."""
        return range(self.sample_start, self.sample_stop) if self.sample_stop else range(n_samples)

    @property
    def result_name(self) -> str:
        """File name of this unit's result under ``results/``."""
        return f"{self.id}.json"

    def result_name_at(self, generation: int) -> str:
        """File name of the unit's result of ``generation`` (0: :attr:`result_name`; k > 0: a re-evaluation
        after an infrastructure skip, ``<id>.retry<k>.json``, see :mod:`ckpteval.coord.results.files`)."""
        return self.result_name if generation == 0 else f"{self.id}.retry{generation}.json"
