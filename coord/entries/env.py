"""An ``env`` entry: multi-turn episodes of a Python environment on the pinned engine (:mod:`ckpteval.jobs.eval.kinds.env`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ckpteval.coord.entries import EngineNeed
from ckpteval.coord.entries.rows import RowsEntry
from ckpteval.coord.run.fields import FieldError


@dataclass(frozen=True)
class EnvEntry(RowsEntry):
    """An ``env`` entry: multi-turn episodes of a Python environment (:mod:`ckpteval.jobs.eval.kinds.env`) on the pinned
    engine, ``n_samples`` episodes per row of the JSONL file ``path``, each of at most ``max_turns`` model
    turns sampled with the entry's sampling settings (``max_new_tokens`` per turn). The reward of an
    episode is its score: ``eval/<name>`` and ``eval/<name>/reward`` are the mean reward, ``pass@k``
    counts an episode with reward >= ``pass_threshold`` as passed (the environment rewards: no scorer).
    ``reasoning`` is applied to every turn before the environment reads it (a turn whose reasoning
    never ends ends its episode ``no_answer``, reward 0: :mod:`ckpteval.jobs.eval.kinds.env.runner`)."""

    KIND: ClassVar[str] = "env"
    ENGINES: ClassVar[EngineNeed] = EngineNeed.GENERATING  # episodes need an engine, not an fn: backend
    CHECKED: ClassVar[tuple[tuple[str, str], ...]] = (("env", "env_options"),)
    kind: str = "env"
    """The entry's kind (``env``)."""
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
        """Its environment."""
        return {self.env}
