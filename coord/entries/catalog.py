"""A ``catalog`` entry: a benchmark of ckpteval's catalog (``{"catalog": "math500"}`` in an eval config), a
``generate`` entry whose data, template, grader and default settings come from the catalog
(:mod:`ckpteval.jobs.eval.catalog`; docs/USER_GUIDE.md "The benchmark catalog")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.run.fields import NAME_RE, FieldError


@dataclass(frozen=True)
class CatalogEntry(GenerateEntry):
    """A catalog benchmark, written into run.json in full (every setting explicit, the eval config's
    overrides applied): evaluated exactly as a ``generate`` entry; ``catalog`` and ``template`` say which
    set and which of its prompt templates it is, for the published-reference check."""

    kind: str = "catalog"
    """The entry's kind (``catalog``)."""
    catalog: str = ""
    """The catalog set (``gsm8k``, ``math500``, ``aime24``, ``aime25``, ``humaneval``, ``mbpp``, ``mmlu_stem``)."""
    template: str = ""
    """The set's prompt template the rows were rendered with (``qwen25-math-cot``, ``deepseek-r1``, ...)."""
    model: str | None = None
    """The published name of the model at step 0 (``deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B``): status checks
    the step-0 point against the catalog's published score for it (docs/USER_GUIDE.md "Published references")."""

    KIND: ClassVar[str] = "catalog"

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("catalog", "template"):
            if not NAME_RE.match(getattr(self, key)):
                raise FieldError(key, f"must name a catalog {key} ({NAME_RE.pattern}), got {getattr(self, key)!r}")
