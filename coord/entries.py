"""Entries of run.json's ``eval.datasets``: one settings dataclass per kind, registered in :data:`KINDS`.

Each kind is one frozen dataclass whose fields are its run.json settings (parsed by
:func:`ckpteval.coord.run.fields.parse_dataclass`; its checks in ``__post_init__``) and which answers, for
everyone who would otherwise branch on ``kind`` (the :class:`Entry` protocol):

- which units it has at a step (:meth:`Entry.due`, :meth:`Entry.units`),
- its point rule (:attr:`Entry.POINT_RULE`: ``samples``, pooled per-sample scores, or ``metrics``, a task's own
  metrics per unit; :mod:`ckpteval.coord.results.files`) and the names its metrics start with,
- which engines can run it (:attr:`Entry.ENGINES`), the user code it names (trust), the registry hooks its
  parse runs (:attr:`Entry.CHECKED`).

:data:`KINDS` maps a kind's name to both halves as ``module:attribute`` strings, imported on first use
(lm-evaluation-harness's ``lm_eval/models/__init__.py`` pattern): the settings class (coord side) and the
jobs-side functions that evaluate one unit on a pinned engine and check an entry at worker start
(:mod:`ckpteval.jobs.eval.kinds.evaluate` loads them; coord itself never imports ``jobs``).

Adding a kind:

1. one module holding its settings dataclass (the fields, ``KIND``, ``POINT_RULE``, ``ENGINES``, ``CHECKED``,
   and ``due``/``units``/``metric_roots``/``user_code``; a ``samples`` kind also has the fields
   :func:`ckpteval.coord.results.files.dataset_score` reads: ``n_prompts``, ``shard_size``, ``n_samples``,
   ``sample_parts``, ``pass_k``, ``pass_threshold``, ``every``) and its jobs-side
   ``evaluate(engine, cache, spec, unit, snapshot, want) -> Evaluation`` (and optionally ``check(cache, spec)``);
2. one line in :data:`KINDS`.

``tests/support/echo_kind.py`` is such a kind, defined only in the tests (``tests/test_entry_kinds.py``).

Guarantee: an entry is validated when run.json is parsed; an unknown kind is refused naming the closest one.
Limits: a kind's module is imported by every process that parses a run.json using it.
"""

from __future__ import annotations

import hashlib
import importlib
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from ckpteval.coord.run.chat_settings import check_reasoning, check_rendered_kwargs, check_template_kwargs
from ckpteval.coord.run.fields import NAME_RE, FieldError
from ckpteval.coord.work.workunit import WorkUnit

PROMPT_FORMATS = ("raw", "chat")


class Entry(Protocol):
    """What every kind's settings dataclass answers (see the module docstring)."""

    KIND: ClassVar[str]
    POINT_RULE: ClassVar[str]  # "samples" | "metrics"
    ENGINES: ClassVar[str]  # "any" (fn: backends too) | "generating" (an engine) | "one" (exactly one, no pool)
    CHECKED: ClassVar[tuple[tuple[str, str], ...]]  # (name field, options field) run through a registry hook
    name: str
    kind: str

    @property
    def n_shards(self) -> int: ...

    @property
    def samples_randomly(self) -> bool: ...

    def due(self, step: int) -> bool: ...

    def units(self, step: int) -> list[WorkUnit]: ...

    def metric_roots(self) -> tuple[str, ...]: ...

    def user_code(self) -> set[str]: ...


@dataclass(frozen=True)
class Kind:
    """One registry line: where a kind's halves live (``module:attribute``, imported on first use)."""

    settings: str
    """The settings dataclass (an :class:`Entry`)."""
    evaluate: str
    """``evaluate(engine, cache, spec, unit, snapshot, want) -> Evaluation`` on an engine pinned to ``want``."""
    check: str = ""
    """``check(cache, spec)`` at worker start (rows, scorer, library present); "": none."""


KINDS: dict[str, Kind] = {
    "generate": Kind("ckpteval.coord.entries:DatasetSpec", "ckpteval.jobs.eval.kinds.generate.scoring:evaluate_generate",
                     "ckpteval.jobs.eval.kinds.generate.scoring:check_generate"),
    "lm_eval": Kind("ckpteval.coord.entries:HarnessSpec", "ckpteval.jobs.eval.kinds.lm_eval:evaluate_harness",
                    "ckpteval.jobs.eval.kinds.lm_eval:check_harness_entry"),
    "env": Kind("ckpteval.coord.entries:EnvSpec", "ckpteval.jobs.eval.kinds.env.runner:evaluate_env",
                "ckpteval.jobs.eval.kinds.env.runner:check_env_entry"),
}


def load_target(target: str) -> Any:
    """The attribute a ``module:attribute`` string names (ImportError/AttributeError when it is not there)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def entry_class(kind: str) -> type:
    """The settings dataclass of ``kind`` (KeyError when the kind is not registered)."""
    return load_target(KINDS[kind].settings)  # type: ignore[no-any-return]


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
    (:func:`ckpteval.jobs.eval.engines.http.limits.generate_timeout`). In-process engines ignore it."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    """``chat`` only: keyword arguments every rendering of the chat template gets, as sglang's
    ``chat_template_kwargs`` (``{"enable_thinking": false}``, ``{"reasoning_effort": "low"}``); recorded in
    each result's scoring identity, so units rendered with different ones never pool."""
    reasoning: dict[str, Any] | None = field(default=None, hash=False)
    """Where a completion's reasoning ends (:mod:`ckpteval.jobs.eval.kinds.generate.reasoning`): ``{"end": "</think>"}``
    (``"start"``: the opening tag; ``"always"``: every completion begins in reasoning), or ``{"end":
    "tokenizer"}`` (the snapshot tokenizer's own pair). Scorers and judges see only the text after it; a
    completion whose reasoning never ends has no answer (scores 0). None: the whole completion is scored."""
    deterministic: bool = True
    """Run on the engine's batch-invariant mode where it has one (sglang ``--enable-deterministic-inference``:
    a completion does not depend on its batch-mates, so a re-evaluation repeats it); greedy sets too. False
    opts this set out (recorded in run.json; each result records whether the engine ran the mode, and the
    mode is server-wide, so it is off only when every set opts out). A set that samples cannot opt out:
    sglang applies per-sample seeds only in that mode."""

    KIND: ClassVar[str] = "generate"  # the kind this class holds (a subclass: another kind, same settings)
    POINT_RULE: ClassVar[str] = "samples"  # pooled per-sample scores (ckpteval.coord.results.files.dataset_score)
    ENGINES: ClassVar[str] = "any"  # an engine or an fn: backend (which scores whole units)
    CHECKED: ClassVar[tuple[tuple[str, str], ...]] = (("scorer", "scorer_options"),)  # (name, options) hooks
    SCORER_ROWS: ClassVar[bool] = True  # each row is checked against the scorer's needs

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
        check_template_kwargs(self.chat_template_kwargs, self.prompt_format)
        check_reasoning(self.reasoning)
        if not self.deterministic and self.samples_randomly:
            raise FieldError("deterministic", "cannot be false on a set that samples (temperature > 0): sglang "
                                              "applies its per-sample seeds only in deterministic mode")
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

    def units(self, step: int) -> list[WorkUnit]:
        """The units of this dataset at ``step``, shard-major, each shard's sample ranges in order."""
        if self.sample_parts == 1:
            return [WorkUnit(step, self.name, s) for s in range(self.n_shards)]
        m = self.n_samples // self.sample_parts
        return [WorkUnit(step, self.name, s, k * m, (k + 1) * m)
                for s in range(self.n_shards) for k in range(self.sample_parts)]

    @property
    def pass_threshold(self) -> float:
        """A sample counts as passed (``pass@k``) when its score is >= this (1.0: correct)."""
        return 1.0

    @property
    def samples_randomly(self) -> bool:
        """Whether its sampling is random (temperature > 0: an engine must honour per-sample seeds)."""
        return self.temperature > 0

    def metric_roots(self) -> tuple[str, ...]:
        """The names its metrics start with (``eval/<name>...``)."""
        return (self.name,)

    def user_code(self) -> set[str]:
        """The names of code it asks a worker to run (a scorer; a registry name or ``module:function``)."""
        return {self.scorer}



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
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)
    """With ``apply_chat_template``: keyword arguments every rendering of the chat template gets, as a
    ``generate`` set's (``{"enable_thinking": false}``), passed through lm-eval's own chat path
    (:mod:`ckpteval.jobs.eval.kinds.lm_eval`)."""
    bootstrap_iters: int = 0
    """Stderr bootstraps (0: none)."""
    seed: int = 0
    """lm-eval's random, numpy, torch and few-shot seeds."""
    deterministic: bool = True
    """As a ``generate`` set's: run on the engine's deterministic mode (false: opt out, recorded)."""

    KIND: ClassVar[str] = "lm_eval"
    POINT_RULE: ClassVar[str] = "metrics"  # each task's own metrics, ``<task>/<metric>``
    ENGINES: ClassVar[str] = "one"  # lm-eval's own adapter over exactly one hf, http or sglang engine, no pool
    CHECKED: ClassVar[tuple[tuple[str, str], ...]] = ()
    samples_randomly: ClassVar[bool] = False  # not considered when a launched server is made deterministic

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
        check_rendered_kwargs(self.chat_template_kwargs, self.apply_chat_template,
                              "needs apply_chat_template true (lm-eval renders no template without it)")
        if not self.include_defaults and self.include_path is None:
            raise FieldError("include_defaults", "is false but no include_path is given: no task could be found")

    @property
    def n_shards(self) -> int:
        """One unit per task: shard ``i`` of the entry is ``tasks[i]``."""
        return len(self.tasks)

    def due(self, step: int) -> bool:
        """Evaluated at every point."""
        return True

    def units(self, step: int) -> list[WorkUnit]:
        """Shard ``i`` runs ``tasks[i]``."""
        return [WorkUnit(step, self.name, i) for i in range(self.n_shards)]

    def metric_roots(self) -> tuple[str, ...]:
        """Its metrics are the tasks' (``eval/<task>/<metric>``), shard ``i``'s under ``tasks[i]``."""
        return self.tasks

    def user_code(self) -> set[str]:
        """None by name (its task configs are files, read by lm-eval)."""
        return set()



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
    """An ``env`` entry: multi-turn episodes of a Python environment (:mod:`ckpteval.jobs.eval.kinds.env`) on the pinned
    engine, ``n_samples`` episodes per row of the JSONL file ``path``, each of at most ``max_turns`` model
    turns sampled with the entry's sampling settings (``max_new_tokens`` per turn). The reward of an
    episode is its score: ``eval/<name>`` and ``eval/<name>/reward`` are the mean reward, ``pass@k``
    counts an episode with reward >= ``pass_threshold`` as passed. ``scorer`` is unused (the environment
    rewards). ``reasoning`` is applied to every turn before the environment reads it (a turn whose reasoning
    never ends ends its episode ``no_answer``, reward 0: :mod:`ckpteval.jobs.eval.kinds.env.runner`)."""

    KIND: ClassVar[str] = "env"
    ENGINES: ClassVar[str] = "generating"  # episodes need an engine, not an fn: backend
    CHECKED: ClassVar[tuple[tuple[str, str], ...]] = (("env", "env_options"),)
    SCORER_ROWS: ClassVar[bool] = False  # any JSON objects: its environment reads them (checked at worker start)
    kind: str = "env"
    """The dataset kind (``env``)."""
    env: str = ""
    """The environment: a name of :data:`ckpteval.jobs.eval.kinds.env.ENVIRONMENTS` (``arithmetic``, ``guess``) or
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

    def user_code(self) -> set[str]:
        """Its scorer (unused, still imported by name) and its environment."""
        return {self.scorer, self.env}
