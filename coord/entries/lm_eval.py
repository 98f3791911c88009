"""An ``lm_eval`` entry: EleutherAI lm-evaluation-harness tasks, one unit per task (:mod:`ckpteval.jobs.eval.kinds.lm_eval`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ckpteval.coord.entries import EngineNeed, PointRule, check_kind_and_name
from ckpteval.coord.run.chat_settings import check_rendered_kwargs
from ckpteval.coord.run.fields import FieldError
from ckpteval.coord.work.workunit import WorkUnit


@dataclass(frozen=True)
class LmEvalEntry:
    """An ``lm_eval`` entry of ``eval.datasets``: EleutherAI lm-evaluation-harness tasks, one unit per task.

    The fields other than ``name``, ``tasks``, ``include_path`` and ``include_defaults`` are passed to
    ``lm_eval.simple_evaluate``.
    """

    name: str
    """``[A-Za-z0-9_-]{1,64}``: the units' dataset name."""
    tasks: tuple[str, ...]
    """lm-eval task names; shard ``i`` of the entry runs ``tasks[i]``."""
    kind: str = "lm_eval"
    """The entry's kind (``lm_eval``)."""
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
    POINT_RULE: ClassVar[PointRule] = PointRule.METRICS  # each task's own metrics, ``<task>/<metric>``
    ENGINES: ClassVar[EngineNeed] = EngineNeed.ONE  # lm-eval's own adapter over exactly one hf, http or sglang engine, no pool
    CHECKED: ClassVar[tuple[tuple[str, str], ...]] = ()
    every: ClassVar[int] = 1  # due at every point
    samples_randomly: ClassVar[bool] = False  # not considered when a launched server is made deterministic

    def __post_init__(self) -> None:
        check_kind_and_name(self, "an lm_eval entry")
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
