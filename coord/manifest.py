"""The run manifest, ``run.json``: the single source of eval config for every consumer.

Owns the schema of ``run.json`` and its validation. Trainer, fleet workers, the service and backfill
all read the eval config (datasets, sampling, engine settings, adapters, lease settings) from here
and nowhere else, so they score exactly the same thing — a hand-copied default once made LoRA evals
silently score bare base weights.

Guarantee: :func:`load_manifest` returns a fully validated :class:`RunManifest` or raises
``ValueError`` naming the file and the offending field path (``eval.datasets[0].top_p``): sampling
settings must be finite and in range (temperature >= 0, top_p in (0, 1], top_k >= 1 or -1 for off,
max_new_tokens >= 1), so a run.json that every engine would refuse is refused before anything runs;
an unknown key of a dataset entry (``temprature``) is refused naming the closest valid one. Each
dataset setting and its default is declared once, on :class:`DatasetSpec`'s fields; the parser
(:func:`parse_dataclass`) derives from them.

Scorers: coord knows no scorer (it imports nothing from ``jobs/``). The scorer registry
(:mod:`ckpteval.jobs.eval.scorers`) installs a pure function with :func:`set_scorer_check` when it is imported
(``import jobs`` imports it, so every ckpteval program has it before it reads a run.json); the parser
calls it with a dataset's ``scorer`` name and its ``scorer_options`` block, so a scorer added to the
registry is accepted — and its settings validated, unknown keys refused — wherever run.json is parsed.
Limits: a process that imports only ``coord`` (no ``jobs``) checks scorer names and options
structurally only (a non-empty name, an object); the manifest is written once at run creation;
changing it under running workers is not detected (workers read it at start).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import math
import re
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ckpteval.coord import PROTOCOL_VERSION
from ckpteval.coord.atomic import read_json_object, write_json_atomic

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
PROMPT_FORMATS = ("raw", "chat")
CANARY_ON_FAIL = ("skip", "flag")


class FieldError(ValueError):
    """A dataclass's own check (``__post_init__``) failing on field ``key``; the parser names the file
    and the field path (``run.json: field eval.datasets[0].top_p must be ...``)."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key} {why}")
        self.key, self.why = key, why


@dataclass(frozen=True)
class DatasetSpec:
    """One ``generate`` eval set: a JSONL file of ``{"prompt" | "messages", "answer", ...}`` rows and how
    to sample and score it.

    Every setting and its default is declared here, once: the run.json parser
    (:func:`parse_dataclass`) derives the accepted keys, their types and defaults from these fields, and
    unknown keys are refused with the closest valid one. The checks are in ``__post_init__``.
    """

    name: str
    """``[A-Za-z0-9_-]{1,64}``: used in file and metric names."""
    path: str
    """The JSONL file; relative paths are relative to the run directory."""
    n_prompts: int
    """Rows evaluated: the file's row count, or ``subset``. Required in run.json; an eval config may leave
    it out (it is filled from the file when the run is created)."""
    kind: str = "generate"
    """The dataset kind (``generate``)."""
    scorer: str = "exact"
    """A name of the scorer registry (:mod:`ckpteval.jobs.eval.scorers`: exact, math, ...) or ``module:function``."""
    scorer_options: dict[str, Any] = field(default_factory=dict, hash=False)
    """The scorer's own settings, validated by its ``parse_options`` (unknown keys refused)."""
    shard_size: int = 64
    """Prompts per work unit."""
    n_samples: int = 1
    """Completions per prompt."""
    samples_per_unit: int | None = None
    """Split each prompt shard's ``n_samples`` over several units of this many samples each (it must divide
    ``n_samples``; None: one unit holds all samples of its prompts). For long generations (30 prompts x 64
    samples): more GPUs share a point. Every sample keeps its seed and every metric is pooled per prompt
    across the units, so the point is identical to the unsplit one."""
    max_new_tokens: int = 16
    """Generation budget per completion (>= 1)."""
    temperature: float = 0.0
    """Sampling temperature (>= 0; 0 is greedy)."""
    top_p: float = 1.0
    """Nucleus sampling, in (0, 1]."""
    top_k: int = -1
    """Top-k sampling (>= 1, or -1 for off; engines reject 0)."""
    seed: int = 0
    """The dataset's sampling seed (>= 0; per-sample seeds derive from it)."""
    prompt_format: str = "raw"
    """``raw`` sends a row's ``prompt`` as is; ``chat`` renders the row's ``messages`` (or its ``prompt``
    as one user message), after an optional ``system_prompt``, with the snapshot's chat template."""
    system_prompt: str | None = None
    """``chat`` only: a system turn put first."""
    pass_k: tuple[int, ...] = ()
    """The k of the ``eval/<ds>/pass@k`` metrics (each in 1..n_samples)."""
    every: int = 1
    """Due at steps that are multiples of it (a multiple of the run's eval interval; 1: every point)."""
    grader_timeout_s: float = 10.0
    """Scorer ``math``: an answer not graded in time scores 0 and is counted (``grader_timeouts``)."""
    subset: int | None = None
    """Evaluate only N rows of the file: the first N, or a seeded sample of N (``subset_seed``)."""
    subset_seed: int | None = None
    """With ``subset``: pick the N rows by this seed (:func:`subset_rows`; kept in file order); None: the first N."""
    generate_timeout_s: float | None = None
    """Seconds one ``/generate`` request of an HTTP engine (sglang, ``ckpteval serve``) may take, for this
    dataset's batches; None: the engine derives it from ``max_new_tokens`` and the batch
    (:func:`ckpteval.jobs.eval.engines.http_limits.generate_timeout`). In-process engines ignore it."""

    KIND: ClassVar[str] = "generate"  # the kind this class holds (a subclass: another kind, same settings)

    def __post_init__(self) -> None:
        if self.kind != self.KIND:
            raise FieldError("kind", f"{self.kind!r} is not the kind of a {self.KIND} dataset")
        if not NAME_RE.match(self.name):
            raise FieldError("name", f"{self.name!r} must match {NAME_RE.pattern} (it is used in file and metric names)")
        object.__setattr__(self, "pass_k", tuple(self.pass_k))
        for key in ("n_prompts", "shard_size", "n_samples", "max_new_tokens", "every"):
            if getattr(self, key) < 1:
                raise FieldError(key, f"must be >= 1, got {getattr(self, key)}")
        for key in ("temperature", "top_p", "grader_timeout_s"):
            if not math.isfinite(getattr(self, key)):
                raise FieldError(key, f"must be a finite number, got {getattr(self, key)}")
        if self.temperature < 0:
            raise FieldError("temperature", f"must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise FieldError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise FieldError("top_k", f"must be >= 1, or -1 for off (engines reject 0), got {self.top_k}")
        if self.seed < 0:
            raise FieldError("seed", f"must be >= 0, got {self.seed}")
        if not self.scorer:
            raise FieldError("scorer", "must name a scorer")
        if not self.grader_timeout_s > 0:
            raise FieldError("grader_timeout_s", f"must be > 0 seconds, got {self.grader_timeout_s}")
        if self.prompt_format not in PROMPT_FORMATS:
            raise FieldError("prompt_format", f"{self.prompt_format!r} must be one of {', '.join(PROMPT_FORMATS)}")
        if self.system_prompt is not None and self.prompt_format != "chat":
            raise FieldError("system_prompt", "needs prompt_format 'chat' (a raw prompt has no system turn)")
        self._check_samples_per_unit()
        for k in self.pass_k:
            if not 1 <= k <= self.n_samples:
                raise FieldError("pass_k", f"has k={k}; each k must be in 1..n_samples ({self.n_samples})")
        if len(set(self.pass_k)) != len(self.pass_k):
            raise FieldError("pass_k", f"lists a k twice: {list(self.pass_k)}")
        if self.subset is not None and self.subset < 1:
            raise FieldError("subset", f"must be >= 1 rows, got {self.subset}")
        if self.subset is not None and self.subset != self.n_prompts:
            raise FieldError("n_prompts", f"is {self.n_prompts} but subset is {self.subset}: they must agree")
        if self.subset_seed is not None and self.subset is None:
            raise FieldError("subset_seed", "needs subset (the number of rows to sample)")
        if self.generate_timeout_s is not None and not (math.isfinite(self.generate_timeout_s)
                                                        and self.generate_timeout_s > 0):
            raise FieldError("generate_timeout_s", f"must be a finite number of seconds > 0 (or null: derived), "
                                                   f"got {self.generate_timeout_s}")

    def _check_samples_per_unit(self) -> None:
        m = self.samples_per_unit
        if m is None:
            return
        if not 1 <= m <= self.n_samples:
            raise FieldError("samples_per_unit", f"must be in 1..n_samples ({self.n_samples}), got {m}")
        if self.n_samples % m:
            raise FieldError("samples_per_unit", f"must divide n_samples ({self.n_samples}) so every unit holds "
                                                 f"as many samples, got {m}")

    @property
    def n_shards(self) -> int:
        return -(-self.n_prompts // self.shard_size)

    @property
    def sample_parts(self) -> int:
        """Units per prompt shard: ``n_samples // samples_per_unit`` (1 when samples are not split)."""
        return self.n_samples // (self.samples_per_unit or self.n_samples)

    def due(self, step: int) -> bool:
        """Whether this dataset is evaluated at ``step`` (its cadence, ``every``)."""
        return step % self.every == 0


@dataclass(frozen=True)
class HarnessSpec:
    """An ``lm_eval`` entry of ``eval.datasets``: EleutherAI lm-evaluation-harness tasks, one unit per task.

    The fields other than ``name``, ``tasks``, ``include_path`` and ``include_defaults`` are passed to
    ``lm_eval.simple_evaluate``.
    """

    name: str
    """``[A-Za-z0-9_-]{1,64}``: the units' dataset name."""
    tasks: tuple[str, ...]
    """lm-eval task names; shard ``i`` of the entry runs ``tasks[i]``."""
    kind: str = "lm_eval"
    """The dataset kind."""
    include_path: str | None = None
    """A dir or YAML file of local task configs (relative to the run dir unless absolute)."""
    include_defaults: bool = True
    """Also index lm-eval's built-in tasks (about 10 s of CPU at worker start)."""
    num_fewshot: int | None = None
    """Few-shot examples (None: the task's own)."""
    limit: int | None = None
    """Docs per task (None: all)."""
    batch_size: int = 16
    """lm-eval's batch size."""
    gen_kwargs: dict[str, Any] | None = None
    """Overrides every task's ``generation_kwargs``."""
    apply_chat_template: bool = False
    """Render prompts with the snapshot's chat template."""
    bootstrap_iters: int = 0
    """Stderr bootstraps (0: none)."""
    seed: int = 0
    """lm-eval's random, numpy, torch and few-shot seeds."""

    def __post_init__(self) -> None:
        if self.kind != "lm_eval":
            raise FieldError("kind", f"{self.kind!r} is not the kind of an lm_eval entry")
        if not NAME_RE.match(self.name):
            raise FieldError("name", f"{self.name!r} must match {NAME_RE.pattern} (it is used in file and metric names)")
        object.__setattr__(self, "tasks", tuple(self.tasks))
        if not self.tasks or not all(isinstance(t, str) and t and "/" not in t for t in self.tasks):
            raise FieldError("tasks", "must be a non-empty list of lm-eval task names (strings without '/')")
        if len(set(self.tasks)) != len(self.tasks):
            raise FieldError("tasks", f"has duplicates: {list(self.tasks)}")
        for key, low in (("limit", 1), ("num_fewshot", 0), ("batch_size", 1), ("bootstrap_iters", 0)):
            value = getattr(self, key)
            if value is not None and value < low:
                raise FieldError(key, f"must be >= {low}, got {value}")
        if not self.include_defaults and self.include_path is None:
            raise FieldError("include_defaults", "is false but no include_path is given: no task could be found")

    @property
    def n_shards(self) -> int:
        """One unit per task: shard ``i`` of the entry is ``tasks[i]``."""
        return len(self.tasks)


def subset_rows(n_rows: int, spec: DatasetSpec) -> list[int]:
    """The file rows (0-based, in file order) a dataset evaluates: all, the first ``subset``, or the
    ``subset`` rows whose ``blake2b(f"ckpteval-subset:{subset_seed}:{i}")`` sort first. Every worker
    derives the same rows from run.json and the run's copy of the file. ValueError if the file is short."""
    if spec.subset is None:
        return list(range(n_rows))
    if spec.subset > n_rows:
        raise ValueError(f"dataset {spec.name!r}: subset {spec.subset} but the file has {n_rows} rows")
    if spec.subset_seed is None:
        return list(range(spec.subset))

    def key(i: int) -> bytes:
        return hashlib.blake2b(f"ckpteval-subset:{spec.subset_seed}:{i}".encode(), digest_size=8).digest()

    return sorted(sorted(range(n_rows), key=key)[: spec.subset])


@dataclass(frozen=True)
class EnvSpec(DatasetSpec):
    """An ``env`` entry: multi-turn episodes of a Python environment (:mod:`ckpteval.jobs.eval.envs`) on the pinned
    engine, ``n_samples`` episodes per row of the JSONL file ``path``, each of at most ``max_turns`` model
    turns sampled with the entry's sampling settings (``max_new_tokens`` per turn). The reward of an
    episode is its score: ``eval/<name>`` and ``eval/<name>/reward`` are the mean reward, ``pass@k``
    counts an episode with reward >= ``pass_threshold`` as passed. ``scorer`` is unused (the environment
    rewards)."""

    KIND: ClassVar[str] = "env"
    kind: str = "env"
    """The dataset kind (``env``)."""
    env: str = ""
    """The environment: a name of :data:`ckpteval.jobs.eval.envs.ENVIRONMENTS` (``arithmetic``, ``guess``) or
    ``module:Class`` (imported under the run-code trust rule)."""
    env_options: dict[str, Any] = field(default_factory=dict, hash=False)
    """The environment's own settings (passed to its constructor as keyword arguments)."""
    max_turns: int = 4
    """Model turns per episode (>= 1); an episode not done by then ends ``out_of_turns`` (the model's, reward 0)."""
    infra_retries: int = 2
    """Times an episode that ended ``infra`` (a tool, the sandbox or the environment failed) is re-run; one
    still ``infra`` after that makes its unit an ``env_failed`` skip (never a score)."""
    tool_timeout_s: float = 10.0
    """Wall-clock deadline of one tool call in the sandbox; a tool past it is an infra failure."""
    pass_threshold: float = 1.0
    """``pass@k``: an episode passes when its reward is at least this (default: full reward)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.env:
            raise FieldError("env", "must name an environment (a registered name or module:Class)")
        if self.max_turns < 1:
            raise FieldError("max_turns", f"must be >= 1, got {self.max_turns}")
        if self.infra_retries < 0:
            raise FieldError("infra_retries", f"must be >= 0, got {self.infra_retries}")
        if not (math.isfinite(self.tool_timeout_s) and self.tool_timeout_s > 0):
            raise FieldError("tool_timeout_s", f"must be > 0 seconds, got {self.tool_timeout_s}")
        if not math.isfinite(self.pass_threshold):
            raise FieldError("pass_threshold", f"must be a finite number, got {self.pass_threshold}")


# kind -> its settings dataclass (see :mod:`ckpteval.jobs.eval.kinds` for how a kind is evaluated; adding one)
DATASET_KINDS: dict[str, type] = {"generate": DatasetSpec, "lm_eval": HarnessSpec, "env": EnvSpec}


@dataclass(frozen=True)
class LeaseSettings:
    """Lease timing every participant of a run must share (filelock refuses mismatches)."""

    duration_s: float = 60.0
    heartbeat_s: float = 10.0


@dataclass(frozen=True)
class CanarySettings:
    """``eval.canary`` in run.json: what a unit whose engine disagrees with the trainer on the canary
    (teacher-forced log-probs of a probe stored with the snapshot, :mod:`ckpteval.jobs.eval.canary`) becomes."""

    max_abs_logprob_diff: float | None = None
    """The largest max |Δ log-prob| over the probe tokens a unit may show; None: the measured default
    for the engine's dtype against the trainer's (0.001 same dtype, 0.05 a narrower one such as bf16 vs
    an fp32 trainer: bench/RESULTS.md "Canary"); 0: compare and record only, never fail."""
    on_fail: str = "skip"
    """``skip``: the unit is skipped ``canary_failed`` (never a scored point); ``flag``: it is scored and
    the failure only logged (``eval/fidelity/flagged``, a line on the worker's stderr)."""

    def __post_init__(self) -> None:
        if self.max_abs_logprob_diff is not None and not (
            math.isfinite(self.max_abs_logprob_diff) and self.max_abs_logprob_diff >= 0
        ):
            raise FieldError("max_abs_logprob_diff", f"must be a number >= 0 (or null), got {self.max_abs_logprob_diff}")
        if self.on_fail not in CANARY_ON_FAIL:
            raise FieldError("on_fail", f"{self.on_fail!r} must be one of {', '.join(CANARY_ON_FAIL)}")


@dataclass(frozen=True)
class EvalSpec:
    datasets: tuple[DatasetSpec, ...]
    engine: dict[str, Any] = field(default_factory=dict)
    adapters: tuple[dict[str, Any], ...] = ()
    harness: tuple[HarnessSpec, ...] = ()  # the ``kind: lm_eval`` entries of ``datasets`` on disk
    # Absolute path of the fixed base model (an HF model dir) when every snapshot of the run is a LoRA
    # adapter (``adapter_config.json`` + ``adapter_model.safetensors``); None: snapshots are full models.
    base_model: str | None = None
    canary: CanarySettings = CanarySettings()


@dataclass(frozen=True)
class RunManifest:
    run_id: str
    eval: EvalSpec
    snapshot_roots: tuple[str, ...]  # absolute dirs where this run's snapshots appear
    trainer: dict[str, Any] = field(default_factory=dict)
    lease: LeaseSettings = LeaseSettings()
    created: float = 0.0
    protocol: int = PROTOCOL_VERSION

    @property
    def per_step_dirs(self) -> bool:
        """Always True (protocol 2 is the only one read). Kept for one reader outside this branch
        (``jobs/views/status.py``); to be deleted with it (MOVES.md)."""
        return True

    def dataset(self, name: str) -> DatasetSpec:
        for ds in self.eval.datasets:
            if ds.name == name:
                return ds
        raise KeyError(f"run {self.run_id}: no dataset named {name!r}")

    def entries(self) -> tuple[DatasetSpec | HarnessSpec, ...]:
        """Every entry of ``eval.datasets``, of any kind (each has ``name``, ``kind``, ``n_shards``)."""
        return (*self.eval.datasets, *self.eval.harness)

    def entry(self, name: str) -> DatasetSpec | HarnessSpec:
        for spec in self.entries():
            if spec.name == name:
                return spec
        raise KeyError(f"run {self.run_id}: no dataset named {name!r}")

    def harness_entry(self, name: str) -> HarnessSpec | None:
        """The ``lm_eval`` entry named ``name``, or None (a JSONL dataset or unknown)."""
        return next((h for h in self.eval.harness if h.name == name), None)

    def to_json(self) -> dict[str, Any]:
        obj = json.loads(json.dumps(asdict(self)))  # tuples become lists, as on disk
        obj["eval"]["datasets"] += obj["eval"].pop("harness")  # lm_eval entries live in datasets on disk
        return obj


class Fields:
    """Typed field access that names the file and the field path in every error.

    What a scorer's ``parse_options`` receives (its settings block, ``...scorer_options``): use
    :meth:`get`/:meth:`sub`/:meth:`error`, :meth:`reject_unknown`, or :func:`parse_dataclass`.
    """

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
        return self.check(key, self.obj[key], kind)

    def check(self, key: str, value: Any, kind: type | tuple[type, ...]) -> Any:
        """``value`` (of field ``key``) if it is of ``kind`` (a bool is not an int); else ValueError."""
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise self.error(key, f"must be {_kind_name(kind)}, got a boolean")
        if not isinstance(value, kind):
            raise self.error(key, f"must be {_kind_name(kind)}, got {type(value).__name__}")
        return value

    def sub(self, key: str, default: Any = ...) -> Fields:
        return Fields(self.source, self.get(key, dict, default), self._path(key))

    def reject_unknown(self, allowed: Iterable[str], what: str = "") -> None:
        """ValueError naming the first key not in ``allowed`` and the closest valid one (a typo such as
        ``temprature`` must not run silently with the default)."""
        allowed = sorted(allowed)
        for key in sorted(self.obj):
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise self.error(key, f"is not a setting{' of ' + what if what else ''} ({hint}valid: "
                                      f"{', '.join(allowed) or 'none'})")


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _convert(f: Fields, key: str, value: Any, hint: Any) -> Any:
    """``value`` checked (and converted: int -> float, list -> tuple) against the type hint ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"parse_dataclass: unsupported type {hint} for {key}")
        return _convert(f, key, value, rest[0])
    if origin is tuple:
        items = f.check(key, value, (list, tuple))
        return tuple(_convert(f, f"{key}[{i}]", v, args[0]) for i, v in enumerate(items))
    if origin is list:
        items = f.check(key, value, list)
        return [_convert(f, f"{key}[{i}]", v, args[0]) for i, v in enumerate(items)]
    if origin is dict or hint is dict:
        return dict(f.check(key, value, dict))
    if hint is float:
        return float(f.check(key, value, (int, float)))
    if hint in (int, str, bool):
        return f.check(key, value, hint)
    raise TypeError(f"parse_dataclass: unsupported type {hint} for {key}")


T = typing.TypeVar("T")


@functools.lru_cache(maxsize=64)
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def parse_dataclass(f: Fields, cls: type[T], *, what: str = "", exclude: Iterable[str] = ()) -> T:
    """An instance of dataclass ``cls`` from the object ``f``: the keys, their types and defaults are
    the dataclass's fields (declared once, there); unknown keys are refused naming the closest valid
    one; a missing required field, a wrong type or a :class:`FieldError` from the class's
    ``__post_init__`` is a ValueError naming the file and the field path. ``exclude``: fields the
    object may not set (left at their defaults)."""
    hints = _type_hints(cls)
    settable = [fl for fl in dataclasses.fields(cls) if fl.init and fl.name not in set(exclude)]  # type: ignore[arg-type]
    f.reject_unknown([fl.name for fl in settable], what)
    kwargs = {}
    for fl in settable:
        if fl.name in f.obj:
            kwargs[fl.name] = _convert(f, fl.name, f.obj[fl.name], hints[fl.name])
        elif fl.default is dataclasses.MISSING and fl.default_factory is dataclasses.MISSING:
            raise f.error(fl.name, "is missing")
    try:
        return cls(**kwargs)
    except FieldError as e:
        raise f.error(e.key, e.why) from None


# -- the scorer registry's hook (coord knows no scorer; see the module docstring) ------------------------
ScorerCheck = Callable[[str, Fields], None]
_scorer_check: list[ScorerCheck] = []


def set_env_check(check: ScorerCheck) -> None:
    """Install the environment registry's check of an ``env`` entry's ``env`` name and ``env_options``
    (:mod:`ckpteval.jobs.eval.envs` installs it when imported, as the scorer registry does its own)."""
    _env_check[:] = [check]


_env_check: list[ScorerCheck] = []


def set_scorer_check(check: ScorerCheck) -> None:
    """Install the scorer registry's check of a dataset's ``scorer`` and ``scorer_options``
    (``check(name, options_fields)`` raises ValueError). :mod:`ckpteval.jobs.eval.scorers` installs its own when
    it is imported (``import jobs`` does that)."""
    _scorer_check[:] = [check]


def _parse_dataset(f: Fields) -> DatasetSpec:
    spec = parse_dataclass(f, DatasetSpec, what="a generate dataset")
    if _scorer_check:
        try:
            _scorer_check[0](spec.scorer, f.sub("scorer_options", {}))
        except FieldError as e:  # the registry's verdict on the name itself (key "scorer")
            raise f.error(e.key, e.why) from None
    return spec


def _parse_env(f: Fields) -> EnvSpec:
    spec = parse_dataclass(f, EnvSpec, what="an env dataset")
    if _env_check:
        try:
            _env_check[0](spec.env, f.sub("env_options", {}))
        except FieldError as e:
            raise f.error(e.key, e.why) from None
    return spec


def _split_datasets(f: Fields, raw: list[Any]) -> tuple[tuple[DatasetSpec, ...], tuple[HarnessSpec, ...]]:
    """``generate`` datasets and ``lm_eval`` entries of ``eval.datasets``, each validated by its kind."""
    datasets, harness = [], []
    for i, d in enumerate(raw):
        sub = Fields(f.source, d, f"{f._path('datasets')}[{i}]")
        kind = sub.get("kind", str, "generate")
        if kind not in DATASET_KINDS:
            close = difflib.get_close_matches(kind, list(DATASET_KINDS), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise sub.error("kind", f"{kind!r} must be one of {', '.join(DATASET_KINDS)} ({hint}default generate)")
        if kind == "generate":
            datasets.append(_parse_dataset(sub))
        elif kind == "env":
            datasets.append(_parse_env(sub))
        else:
            harness.append(parse_dataclass(sub, DATASET_KINDS[kind], what=f"a dataset of kind {kind!r}"))
    return tuple(datasets), tuple(harness)


def _parse_eval(f: Fields) -> EvalSpec:
    f.reject_unknown(["datasets", "engine", "adapters", "base_model", "canary"], "the eval section")
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
        base_model=base_model, canary=parse_dataclass(f.sub("canary", {}), CanarySettings, what="eval.canary"),
    )


def parse_manifest(obj: Any, source: Path) -> RunManifest:
    """Validate a decoded ``run.json``; every error names ``source`` and the field."""
    f = Fields(source, obj, "")
    f.reject_unknown([fl.name for fl in dataclasses.fields(RunManifest)], "run.json")
    protocol = f.get("protocol", int, PROTOCOL_VERSION)  # every run.json ckpteval writes names it
    if protocol != PROTOCOL_VERSION:
        raise f.error("protocol", f"is {protocol}; this ckpteval reads only protocol {PROTOCOL_VERSION} run dirs "
                                  f"(protocol {protocol} was never released: create the run again)")
    run_id = f.get("run_id", str)
    if not NAME_RE.match(run_id):
        raise f.error("run_id", f"{run_id!r} must match {NAME_RE.pattern}")
    roots = f.get("snapshot_roots", list)
    for i, r in enumerate(roots):
        if not isinstance(r, str) or not Path(r).is_absolute():
            raise f.error(f"snapshot_roots[{i}]", f"must be an absolute path, got {r!r}")
    lease_f = f.sub("lease", {})
    lease_f.reject_unknown([fl.name for fl in dataclasses.fields(LeaseSettings)], "lease")
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
