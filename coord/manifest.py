"""The run manifest, ``run.json``: the single source of eval config for every consumer.

Owns the schema of ``run.json`` and its validation. Trainer, fleet workers, the service and backfill
all read the eval config (datasets, sampling, engine settings, adapters, lease settings) from here
and nowhere else, so they score exactly the same thing — a hand-copied default once made LoRA evals
silently score bare base weights.

Guarantee: :func:`load_manifest` returns a fully validated :class:`RunManifest` or raises
``ValueError`` naming the file and the offending field path (``eval.datasets[0].top_p``): sampling
settings must be finite and in range (temperature >= 0, top_p in (0, 1], top_k >= 1 or -1 for off,
max_new_tokens >= 1), so a run.json that every engine would refuse is refused before anything runs. Limits: the manifest is written once at run
creation; changing it under running workers is not detected (workers read it at start).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from coord import PROTOCOL_VERSION
from coord.atomic import read_json_object, write_json_atomic

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
PROMPT_FORMATS = ("raw", "chat")


@dataclass(frozen=True)
class DatasetSpec:
    """One eval set: a JSONL file of ``{"prompt" | "messages", "answer"}`` rows and how to sample and score it.

    ``prompt_format`` ``raw`` sends a row's ``prompt`` as is; ``chat`` renders the row's ``messages``
    (or its ``prompt`` as one user message), after an optional ``system_prompt``, with the snapshot's
    own tokenizer chat template. ``pass_k`` lists the k of the ``eval/<ds>/pass@k`` metrics (each
    ``<= n_samples``). ``every``: the dataset is due at steps that are multiples of it (a multiple of
    the run's eval interval; 1: every point).
    """

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
    prompt_format: str = "raw"  # raw | chat
    system_prompt: str | None = None
    pass_k: tuple[int, ...] = ()
    every: int = 1
    grader_timeout_s: float = 10.0  # scorer "math": an answer not graded in time scores 0 and is counted

    @property
    def n_shards(self) -> int:
        return -(-self.n_prompts // self.shard_size)

    def due(self, step: int) -> bool:
        """Whether this dataset is evaluated at ``step`` (its cadence, ``every``)."""
        return step % self.every == 0


@dataclass(frozen=True)
class HarnessSpec:
    """An ``lm_eval`` entry of ``eval.datasets``: EleutherAI lm-evaluation-harness tasks, one unit per task.

    ``include_path`` (a dir or YAML file of local task configs; relative to the run dir unless absolute)
    is scanned in addition to lm-eval's built-in tasks unless ``include_defaults`` is false. The other
    fields are passed to ``lm_eval.simple_evaluate``: ``num_fewshot`` (None: the task's own),
    ``limit`` (docs per task, None: all), ``gen_kwargs`` (overrides every task's generation_kwargs),
    ``apply_chat_template``, ``bootstrap_iters`` (stderr bootstraps; 0: none), ``seed``.
    """

    name: str
    tasks: tuple[str, ...]
    include_path: str | None = None
    include_defaults: bool = True
    num_fewshot: int | None = None
    limit: int | None = None
    batch_size: int = 16
    gen_kwargs: dict[str, Any] | None = None
    apply_chat_template: bool = False
    bootstrap_iters: int = 0
    seed: int = 0
    kind: str = "lm_eval"

    @property
    def n_shards(self) -> int:
        """One unit per task: shard ``i`` of the entry is ``tasks[i]``."""
        return len(self.tasks)


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
    harness: tuple[HarnessSpec, ...] = ()  # the ``kind: lm_eval`` entries of ``datasets`` on disk
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

    def harness_entry(self, name: str) -> HarnessSpec | None:
        """The ``lm_eval`` entry named ``name``, or None (a JSONL dataset or unknown)."""
        return next((h for h in self.eval.harness if h.name == name), None)

    def to_json(self) -> dict[str, Any]:
        obj = json.loads(json.dumps(asdict(self)))  # tuples become lists, as on disk
        obj["eval"]["datasets"] += obj["eval"].pop("harness")  # lm_eval entries live in datasets on disk
        return obj


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
        prompt_format=f.get("prompt_format", str, "raw"),
        system_prompt=f.get("system_prompt", (str, type(None)), None),
        pass_k=tuple(_int_list(f, "pass_k")),
        every=f.get("every", int, 1),
        grader_timeout_s=float(f.get("grader_timeout_s", num, 10.0)),
    )
    for key in ("n_prompts", "shard_size", "n_samples", "max_new_tokens", "every"):
        if getattr(ds, key) < 1:
            raise f.error(key, f"must be >= 1, got {getattr(ds, key)}")
    for key in ("temperature", "top_p"):
        if not math.isfinite(getattr(ds, key)):
            raise f.error(key, f"must be a finite number, got {getattr(ds, key)}")
    if ds.temperature < 0:
        raise f.error("temperature", f"must be >= 0 (0 means greedy), got {ds.temperature}")
    if not 0 < ds.top_p <= 1:
        raise f.error("top_p", f"must be in (0, 1], got {ds.top_p}")
    if ds.top_k == 0 or ds.top_k < -1:
        raise f.error("top_k", f"must be >= 1, or -1 for off (engines reject 0), got {ds.top_k}")
    if ds.seed < 0:
        raise f.error("seed", f"must be >= 0, got {ds.seed}")
    if ds.scorer not in {"exact", "math"} and ":" not in ds.scorer:
        raise f.error("scorer", f"{ds.scorer!r} must be 'exact', 'math' or 'module:function'")
    if not ds.grader_timeout_s > 0:
        raise f.error("grader_timeout_s", f"must be > 0 seconds, got {ds.grader_timeout_s}")
    if ds.prompt_format not in PROMPT_FORMATS:
        raise f.error("prompt_format", f"{ds.prompt_format!r} must be one of {', '.join(PROMPT_FORMATS)}")
    if ds.system_prompt is not None and ds.prompt_format != "chat":
        raise f.error("system_prompt", "needs prompt_format 'chat' (a raw prompt has no system turn)")
    for k in ds.pass_k:
        if not 1 <= k <= ds.n_samples:
            raise f.error("pass_k", f"has k={k}; each k must be in 1..n_samples ({ds.n_samples})")
    if len(set(ds.pass_k)) != len(ds.pass_k):
        raise f.error("pass_k", f"lists a k twice: {list(ds.pass_k)}")
    return ds


def _int_list(f: _Fields, key: str) -> list[int]:
    values = f.get(key, list, [])
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int):
            raise f.error(f"{key}[{i}]", f"must be an integer, got {v!r}")
    return values


def _parse_harness(f: _Fields) -> HarnessSpec:
    """A ``{"kind": "lm_eval", "name", "tasks": [...], ...}`` entry of ``eval.datasets``."""
    name = f.get("name", str)
    if not NAME_RE.match(name):
        raise f.error("name", f"{name!r} must match {NAME_RE.pattern} (it is used in file and metric names)")
    tasks = f.get("tasks", list)
    if not tasks or not all(isinstance(t, str) and t and "/" not in t for t in tasks):
        raise f.error("tasks", "must be a non-empty list of lm-eval task names (strings without '/')")
    if len(set(tasks)) != len(tasks):
        raise f.error("tasks", f"has duplicates: {tasks}")
    limit, fewshot = f.get("limit", (int, type(None)), None), f.get("num_fewshot", (int, type(None)), None)
    spec = HarnessSpec(
        name=name,
        tasks=tuple(tasks),
        include_path=f.get("include_path", (str, type(None)), None),
        include_defaults=f.get("include_defaults", bool, True),
        num_fewshot=fewshot,
        limit=limit,
        batch_size=f.get("batch_size", int, 16),
        gen_kwargs=f.get("gen_kwargs", (dict, type(None)), None),
        apply_chat_template=f.get("apply_chat_template", bool, False),
        bootstrap_iters=f.get("bootstrap_iters", int, 0),
        seed=f.get("seed", int, 0),
    )
    for key, low in (("limit", 1), ("num_fewshot", 0), ("batch_size", 1), ("bootstrap_iters", 0)):
        value = getattr(spec, key)
        if value is not None and value < low:
            raise f.error(key, f"must be >= {low}, got {value}")
    if not spec.include_defaults and spec.include_path is None:
        raise f.error("include_defaults", "is false but no include_path is given: no task could be found")
    unknown = sorted(set(f.obj) - {k for k in HarnessSpec.__dataclass_fields__})
    if unknown:
        raise f.error(unknown[0], f"is not a field of an lm_eval entry (fields: {sorted(HarnessSpec.__dataclass_fields__)})")
    return spec


def _split_datasets(f: _Fields, raw: list[Any]) -> tuple[tuple[DatasetSpec, ...], tuple[HarnessSpec, ...]]:
    """JSONL datasets and ``kind: lm_eval`` entries of ``eval.datasets``, each validated."""
    datasets, harness = [], []
    for i, d in enumerate(raw):
        sub = _Fields(f.source, d, f"{f._path('datasets')}[{i}]")
        kind = sub.get("kind", str, "jsonl")
        if kind == "lm_eval":
            harness.append(_parse_harness(sub))
        elif kind == "jsonl":
            datasets.append(_parse_dataset(sub))
        else:
            raise sub.error("kind", f"{kind!r} must be 'jsonl' (the default) or 'lm_eval'")
    return tuple(datasets), tuple(harness)


def _parse_eval(f: _Fields) -> EvalSpec:
    raw_datasets = f.get("datasets", list)
    if not raw_datasets:
        raise f.error("datasets", "must list at least one dataset")
    datasets, harness = _split_datasets(f, raw_datasets)
    names = [d.name for d in datasets] + [h.name for h in harness]
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
        datasets=datasets, engine=f.get("engine", dict, {}), adapters=tuple(adapters), harness=harness,
        base_model=base_model,
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
    if not (math.isfinite(lease.duration_s) and 0 < lease.heartbeat_s < lease.duration_s):
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
