"""A ``generate`` entry (the default kind): a JSONL file of ``{"prompt" | "messages", "answer", ...}`` rows,
sampled on an engine and scored by a scorer (:mod:`ckpteval.jobs.eval.kinds.generate`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ckpteval.coord.entries.rows import RowsEntry
from ckpteval.coord.run.fields import FieldError


@dataclass(frozen=True)
class GenerateEntry(RowsEntry):
    """One ``generate`` eval set: :class:`RowsEntry`'s settings and its scorer's."""

    kind: str = "generate"
    """The entry's kind (``generate``)."""
    scorer: str = "exact"
    """A name of the scorer registry (:mod:`ckpteval.jobs.eval.scorers`: exact, math, ...) or ``module:function``."""
    scorer_options: dict[str, Any] = field(default_factory=dict, hash=False)
    """The scorer's own settings, validated by its ``parse_options`` (unknown keys refused)."""
    grader_timeout_s: float = 10.0
    """Scorer ``math``: an answer not graded in time scores 0 and is counted (``grader_timeouts``)."""

    KIND: ClassVar[str] = "generate"
    CHECKED: ClassVar[tuple[tuple[str, str], ...]] = (("scorer", "scorer_options"),)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.scorer:
            raise FieldError("scorer", "must name a scorer")
        if not math.isfinite(self.grader_timeout_s):
            raise FieldError("grader_timeout_s", f"must be a finite number, got {self.grader_timeout_s}")
        if not self.grader_timeout_s > 0:
            raise FieldError("grader_timeout_s", f"must be > 0 seconds, got {self.grader_timeout_s}")

    @property
    def pass_threshold(self) -> float:
        """A sample counts as passed (``pass@k``) when its score is >= this (1.0: correct)."""
        return 1.0

    def user_code(self) -> set[str]:
        """The names of code it asks a worker to run (a scorer; a registry name or ``module:function``)."""
        return {self.scorer}
