"""Real scorers for the registry tests: a ``module:function`` that raises, and a registered-style class
scorer with options, a required row field, counters, extras and an identity (registered into
``ckpteval.jobs.eval.scorers.SCORERS`` by the tests that use it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpteval.coord.run.manifest import FieldError, Fields, parse_dataclass
from ckpteval.jobs.eval.scorers import BaseScorer, Sample, Scored


def raise_always(completion: str, answer: str) -> float:
    """A user scorer with a bug: raises on every sample."""
    raise KeyError(f"no grading rule for {answer!r}")


@dataclass(frozen=True)
class LengthOptions:
    limit: int = 2
    """Completions longer than this many characters are counted as ``long``."""
    tag: str = "a"
    """Recorded in the identity (two tags: two identities)."""

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise FieldError("limit", f"must be >= 0, got {self.limit}")


class LengthScorer(BaseScorer):
    """Scores 1 when the completion's length equals the row's ``want_len``; counts long completions,
    reports each completion's length as an extra."""

    required_row_fields = ("want_len",)
    needs_answer = False

    @classmethod
    def parse_options(cls, f: Fields) -> LengthOptions:
        return parse_dataclass(f, LengthOptions, what="scorer 'length'")

    def score(self, samples: list[Sample]) -> list[Scored]:
        return [
            Scored(float(len(s.completion) == s.row["want_len"]), str(len(s.completion)),
                   counters={"long": int(len(s.completion) > self.options.limit)},
                   extras={"length": float(len(s.completion))})
            for s in samples
        ]

    def identity(self) -> dict[str, Any]:
        return {"name": "length", "tag": self.options.tag}
