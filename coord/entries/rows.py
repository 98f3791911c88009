"""What the two kinds sampled from a JSONL file's rows share (``generate``, ``env``): :class:`RowsEntry`."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ckpteval.coord.entries import EngineNeed, PointRule, check_kind_and_name
from ckpteval.coord.run.chat_settings import check_reasoning, check_template_kwargs
from ckpteval.coord.run.fields import FieldError
from ckpteval.coord.work.workunit import WorkUnit

PROMPT_FORMATS = ("raw", "chat")


@dataclass(frozen=True)
class RowsEntry:
    """The settings an entry whose units are shards of a JSONL file's rows, sampled on an engine, shares
    (:class:`~ckpteval.coord.entries.generate.GenerateEntry`, :class:`~ckpteval.coord.entries.env.EnvEntry`).

    Every setting and its default is declared once, as a field: the run.json parser derives the accepted keys,
    their types and defaults from them (unknown keys refused naming the closest). Checks: ``__post_init__``.
    """

    name: str
    """``[A-Za-z0-9_-]{1,64}``: used in file and metric names."""
    path: str
    """The JSONL file; relative paths are relative to the run directory."""
    n_prompts: int
    """Rows evaluated: the file's row count, or ``subset``. Required in run.json; an eval config may leave
    it out (it is filled from the file when the run is created)."""
    kind: str = ""
    """The entry's kind (each subclass's default: its own)."""
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

    KIND: ClassVar[str] = ""
    POINT_RULE: ClassVar[PointRule] = PointRule.SAMPLES  # pooled per-sample scores (points.dataset_score)
    ENGINES: ClassVar[EngineNeed] = EngineNeed.ANY
    CHECKED: ClassVar[tuple[tuple[str, str], ...]] = ()  # (name, options) fields run through a registry check

    def __post_init__(self) -> None:
        check_kind_and_name(self, f"a {self.KIND} dataset")
        object.__setattr__(self, "pass_k", tuple(self.pass_k))
        for key in ("n_prompts", "shard_size", "n_samples", "max_new_tokens", "every"):
            if getattr(self, key) < 1:
                raise FieldError(key, f"must be >= 1, got {getattr(self, key)}")
        for key in ("temperature", "top_p"):
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
    def samples_randomly(self) -> bool:
        """Whether its sampling is random (temperature > 0: an engine must honour per-sample seeds)."""
        return self.temperature > 0

    def metric_roots(self) -> tuple[str, ...]:
        """The names its metrics start with (``eval/<name>...``)."""
        return (self.name,)


def subset_rows(n_rows: int, spec: RowsEntry) -> list[int]:
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
