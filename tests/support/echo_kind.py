"""``echo``: a dataset kind defined only in the tests — one module and one registry line (issue 27).

Both halves of the kind are here: the settings dataclass (:class:`EchoEntry`, the coord side) and the
functions the worker calls (:func:`evaluate` on an engine pinned to the unit's step, :func:`check` at worker
start). ``tests/test_entry_kinds.py`` registers it with one line in :data:`ckpteval.coord.entries.KINDS` and
runs it end to end: run.json, units, a real in-process worker on the tiny model, the derived point.

A unit greedily generates one token from the entry's ``prompt``; its one sample scores 1.0 when the engine
produced it from the weights the unit was evaluated at (the generation's version is the pin) and 0.0 otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ckpteval.coord.entries import EngineNeed, PointRule
from ckpteval.coord.run.fields import NAME_RE, FieldError
from ckpteval.coord.work.workunit import WorkUnit
from ckpteval.jobs.eval.engines.base import SamplingParams
from ckpteval.jobs.eval.kinds.evaluate import Evaluation

CHECKED: list[str] = []  # the entries check() saw: the proof the jobs-side check ran at worker start


@dataclass(frozen=True)
class EchoEntry:
    """An ``echo`` entry: ``n_prompts`` units per point, one sample each."""

    name: str
    """``[A-Za-z0-9_-]{1,64}``."""
    prompt: str = "1 + 1 ="
    """What each unit sends the engine."""
    n_prompts: int = 2
    """Units per point (one prompt each)."""
    kind: str = "echo"
    """The kind."""
    every: int = 1
    """Due at steps that are multiples of it."""

    KIND: ClassVar[str] = "echo"
    POINT_RULE: ClassVar[PointRule] = PointRule.SAMPLES
    ENGINES: ClassVar[EngineNeed] = EngineNeed.GENERATING
    CHECKED: ClassVar[tuple[tuple[str, str], ...]] = ()
    shard_size: ClassVar[int] = 1
    n_samples: ClassVar[int] = 1
    sample_parts: ClassVar[int] = 1
    pass_k: ClassVar[tuple[int, ...]] = (1,)
    pass_threshold: ClassVar[float] = 1.0
    samples_randomly: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.kind != self.KIND:
            raise FieldError("kind", f"{self.kind!r} is not the kind of an echo entry")
        if not NAME_RE.match(self.name):
            raise FieldError("name", f"{self.name!r} must match {NAME_RE.pattern}")
        if self.n_prompts < 1 or self.every < 1:
            raise FieldError("n_prompts", "and every must be >= 1")

    @property
    def n_shards(self) -> int:
        return self.n_prompts

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def units(self, step: int) -> list[WorkUnit]:
        return [WorkUnit(step, self.name, i) for i in range(self.n_prompts)]

    def metric_roots(self) -> tuple[str, ...]:
        return (self.name,)

    def user_code(self) -> set[str]:
        return set()


def evaluate(engine: Any, cache: Any, spec: EchoEntry, unit: WorkUnit, snapshot: str, want: str) -> Evaluation:
    """One greedy token from the pinned engine; 1.0 when it came from the weights of ``want``."""
    (generation,) = engine.generate([spec.prompt], SamplingParams(max_new_tokens=1, temperature=0.0))
    ok = generation.weight_version == want and generation.n_tokens == 1
    return Evaluation(scores=[1.0 if ok else 0.0], weight_versions=[generation.weight_version])


def check(cache: Any, spec: EchoEntry) -> None:
    CHECKED.append(spec.name)
