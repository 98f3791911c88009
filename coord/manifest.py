"""The run manifest, ``run.json``: the single source of eval config for every consumer.

Owns the schema of ``run.json`` and its validation. Trainer, fleet workers, the service and backfill
all read the eval config (datasets, sampling, engine settings, adapters, lease settings) from here
and nowhere else, so they score exactly the same thing — a hand-copied default once made LoRA evals
silently score bare base weights.

Guarantee: :func:`load_manifest` returns a fully validated :class:`RunManifest` or raises
``ValueError`` naming the file and the offending field. Limits: the manifest is written once at run
creation; changing it under running workers is not detected (workers read it at start).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from coord import PROTOCOL_VERSION
from coord.atomic import read_json_object, write_json_atomic

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class DatasetSpec:
    """One eval set: a JSONL file of ``{"prompt", "answer"}`` rows and how to sample and score it."""

    name: str
    path: str  # JSONL; relative paths are relative to the run directory
    n_prompts: int
    scorer: str = "exact"  # exact | math | module:function
    shard_size: int = 64
    n_samples: int = 1
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0

    @property
    def n_shards(self) -> int:
        return -(-self.n_prompts // self.shard_size)


@dataclass(frozen=True)
class LeaseSettings:
    """Lease timing every participant of a run must share (filelock refuses mismatches)."""

    duration_s: float = 60.0
    heartbeat_s: float = 10.0


@dataclass(frozen=True)
class EvalSpec:
    datasets: tuple[DatasetSpec, ...]
    engine: dict[str, Any] = field(default_factory=dict)
    adapters: tuple[dict[str, Any], ...] = ()
    # Absolute path of the fixed base model (an HF model dir) when every snapshot of the run is a LoRA
    # adapter (``adapter_config.json`` + ``adapter_model.safetensors``); None: snapshots are full models.
    base_model: str | None = None


@dataclass(frozen=True)
class RunManifest:
    run_id: str
    eval: EvalSpec
    snapshot_roots: tuple[str, ...]  # absolute dirs where this run's snapshots appear
    trainer: dict[str, Any] = field(default_factory=dict)
    lease: LeaseSettings = LeaseSettings()
    created: float = 0.0
    protocol: int = PROTOCOL_VERSION

    def dataset(self, name: str) -> DatasetSpec:
        for ds in self.eval.datasets:
            if ds.name == name:
                return ds
        raise KeyError(f"run {self.run_id}: no dataset named {name!r}")

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self)))  # tuples become lists, as on disk


class _Fields:
    """Typed field access that names the file and the field path in every error."""

    def __init__(self, source: Path, obj: Any, where: str) -> None:
        if not isinstance(obj, dict):
            raise ValueError(f"{source}: field {where or '<top>'} must be an object")
        self.source, self.obj, self.where = source, obj, where

    def _path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def error(self, key: str, why: str) -> ValueError:
        return ValueError(f"{self.source}: field {self._path(key)} {why}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        if key not in self.obj:
            if default is ...:
                raise self.error(key, "is missing")
            return default
        value = self.obj[key]
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise self.error(key, f"must be {_kind_name(kind)}, got a boolean")
        if not isinstance(value, kind):
            raise self.error(key, f"must be {_kind_name(kind)}, got {type(value).__name__}")
        return value

    def sub(self, key: str, default: Any = ...) -> _Fields:
        return _Fields(self.source, self.get(key, dict, default), self._path(key))


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _parse_dataset(f: _Fields) -> DatasetSpec:
    name = f.get("name", str)
    if not NAME_RE.match(name):
        raise f.error("name", f"{name!r} must match {NAME_RE.pattern} (it is used in file and metric names)")
    num = (int, float)
    ds = DatasetSpec(
        name=name,
        path=f.get("path", str),
        n_prompts=f.get("n_prompts", int),
        scorer=f.get("scorer", str, "exact"),
        shard_size=f.get("shard_size", int, 64),
        n_samples=f.get("n_samples", int, 1),
        max_new_tokens=f.get("max_new_tokens", int, 16),
        temperature=float(f.get("temperature", num, 0.0)),
        top_p=float(f.get("top_p", num, 1.0)),
        top_k=f.get("top_k", int, -1),
        seed=f.get("seed", int, 0),
    )
    for key in ("n_prompts", "shard_size", "n_samples", "max_new_tokens"):
        if getattr(ds, key) < 1:
            raise f.error(key, "must be >= 1")
    if ds.temperature < 0:
        raise f.error("temperature", "must be >= 0 (0 means greedy)")
    if not 0 < ds.top_p <= 1:
        raise f.error("top_p", "must be in (0, 1]")
    if ds.scorer not in {"exact", "math"} and ":" not in ds.scorer:
        raise f.error("scorer", f"{ds.scorer!r} must be 'exact', 'math' or 'module:function'")
    return ds


def _parse_eval(f: _Fields) -> EvalSpec:
    raw_datasets = f.get("datasets", list)
    if not raw_datasets:
        raise f.error("datasets", "must list at least one dataset")
    datasets = tuple(
        _parse_dataset(_Fields(f.source, d, f"{f._path('datasets')}[{i}]")) for i, d in enumerate(raw_datasets)
    )
    names = [d.name for d in datasets]
    if len(set(names)) != len(names):
        raise f.error("datasets", f"has duplicate names: {names}")
    adapters = f.get("adapters", list, [])
    for i, a in enumerate(adapters):
        if not isinstance(a, dict):
            raise f.error(f"adapters[{i}]", "must be an object")
    base_model = f.get("base_model", (str, type(None)), None)
    if base_model is not None and not Path(base_model).is_absolute():
        raise f.error("base_model", f"must be an absolute path (the base model dir), got {base_model!r}")
    return EvalSpec(
        datasets=datasets, engine=f.get("engine", dict, {}), adapters=tuple(adapters), base_model=base_model
    )


def parse_manifest(obj: Any, source: Path) -> RunManifest:
    """Validate a decoded ``run.json``; every error names ``source`` and the field."""
    f = _Fields(source, obj, "")
    protocol = f.get("protocol", int, PROTOCOL_VERSION)
    if protocol != PROTOCOL_VERSION:
        raise f.error("protocol", f"is {protocol}; this ckpteval speaks protocol {PROTOCOL_VERSION}")
    run_id = f.get("run_id", str)
    if not NAME_RE.match(run_id):
        raise f.error("run_id", f"{run_id!r} must match {NAME_RE.pattern}")
    roots = f.get("snapshot_roots", list)
    for i, r in enumerate(roots):
        if not isinstance(r, str) or not Path(r).is_absolute():
            raise f.error(f"snapshot_roots[{i}]", f"must be an absolute path, got {r!r}")
    lease_f = f.sub("lease", {})
    lease = LeaseSettings(
        duration_s=float(lease_f.get("duration_s", (int, float), 60.0)),
        heartbeat_s=float(lease_f.get("heartbeat_s", (int, float), 10.0)),
    )
    if not 0 < lease.heartbeat_s < lease.duration_s:
        raise lease_f.error("heartbeat_s", "must be > 0 and below lease.duration_s")
    return RunManifest(
        run_id=run_id,
        eval=_parse_eval(f.sub("eval")),
        snapshot_roots=tuple(roots),
        trainer=f.get("trainer", dict, {}),
        lease=lease,
        created=float(f.get("created", (int, float), 0.0)),
        protocol=protocol,
    )


def load_manifest(path: Path) -> RunManifest:
    """Read and validate ``run.json`` (FileNotFoundError / ValueError name the file)."""
    return parse_manifest(read_json_object(path), Path(path))


def save_manifest(path: Path, manifest: RunManifest) -> None:
    """Validate (round-trip) and write ``run.json`` atomically."""
    obj = manifest.to_json()
    parse_manifest(obj, Path(path))
    write_json_atomic(path, obj)
