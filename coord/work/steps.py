"""Step selections: which steps of a run a consumer evaluates (``--steps``, ``run.json``'s ``trainer.steps``).

Grammar (one string, as typed on the command line and as stored in ``run.json``)::

    all                      every step
    latest                   the newest step present (resolved to a number before it is stored)
    N                        one step
    START:STOP[:EVERY]       START, START+EVERY, ... up to STOP, both ends inclusive; START may be
                             empty (0), STOP may be empty (no end), EVERY defaults to 1
    ITEM,ITEM,...            the union of numbers and ranges

Guarantee: :func:`parse_steps` accepts exactly this grammar and raises one ``ValueError`` naming the
text and what is wrong otherwise; :meth:`StepSelection.text` is canonical, so a parsed, stored and
re-parsed selection is equal. Limits: ``latest`` needs the steps present (:meth:`StepSelection.resolve`);
an unresolved ``latest`` selects nothing on its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

NO_END = -1
REEVAL_KIND = "reeval"  # run.json trainer.kind of a run that re-evaluates another run's snapshots


@dataclass(frozen=True)
class StepRange:
    start: int
    stop: int  # inclusive; NO_END: unbounded
    every: int = 1

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int) or step < self.start or (self.stop != NO_END and step > self.stop):
            return False
        return (step - self.start) % self.every == 0

    @property
    def text(self) -> str:
        if self.start == self.stop:
            return str(self.start)
        stop = "" if self.stop == NO_END else str(self.stop)
        return f"{self.start}:{stop}" + (f":{self.every}" if self.every != 1 else "")


@dataclass(frozen=True)
class StepSelection:
    ranges: tuple[StepRange, ...] = ()
    everything: bool = False
    latest: bool = False

    def __contains__(self, step: object) -> bool:
        return self.everything or any(step in r for r in self.ranges)

    @property
    def text(self) -> str:
        if self.everything:
            return "all"
        return ",".join(["latest"] * self.latest + [r.text for r in self.ranges])

    def resolve(self, present: Iterable[int]) -> StepSelection:
        """``latest`` replaced by the newest of ``present`` (ValueError when nothing is present)."""
        if not self.latest:
            return self
        steps = sorted(present)
        if not steps:
            raise ValueError("--steps latest: no step is present to be the latest")
        return StepSelection(ranges=(*self.ranges, StepRange(steps[-1], steps[-1])))

    def select(self, present: Iterable[int]) -> list[int]:
        """The steps of ``present`` this selection takes, sorted."""
        resolved = self.resolve(present) if self.latest else self
        return sorted(s for s in set(present) if s in resolved)


def _int(text: str, whole: str, what: str) -> int:
    if not text.isdigit():
        raise ValueError(f"--steps {whole!r}: {what} {text!r} is not a non-negative integer")
    return int(text)


def _parse_item(item: str, whole: str) -> StepRange:
    parts = item.split(":")
    if len(parts) == 1:
        step = _int(parts[0], whole, "step")
        return StepRange(step, step)
    if len(parts) > 3:
        raise ValueError(f"--steps {whole!r}: {item!r} has more than START:STOP:EVERY")
    start = _int(parts[0], whole, "START") if parts[0] else 0
    stop = _int(parts[1], whole, "STOP") if parts[1] else NO_END
    every = _int(parts[2], whole, "EVERY") if len(parts) == 3 and parts[2] else 1
    if every < 1:
        raise ValueError(f"--steps {whole!r}: EVERY must be >= 1")
    if stop != NO_END and stop < start:
        raise ValueError(f"--steps {whole!r}: STOP {stop} is below START {start}")
    return StepRange(start, stop, every)


def parse_steps(text: str) -> StepSelection:
    """Parse a step selection (grammar in the module docstring); ValueError names the text."""
    whole = text
    items = [i.strip() for i in text.split(",")]
    if not text.strip() or any(not i for i in items):
        raise ValueError(f"--steps {whole!r}: empty selection or empty item (expected all, latest, N or START:STOP:EVERY)")
    if "all" in items:
        if len(items) > 1:
            raise ValueError(f"--steps {whole!r}: 'all' cannot be combined with other items")
        return StepSelection(everything=True)
    latest = "latest" in items
    ranges = tuple(_parse_item(i, whole) for i in items if i != "latest")
    return StepSelection(ranges=ranges, latest=latest)


def run_step_selection(trainer: dict[str, Any], source: str) -> StepSelection | None:
    """The steps a run is limited to: ``trainer.steps`` of a re-evaluation run (None: every step).

    ``trainer`` is run.json's ``trainer`` section; ValueError names ``source`` (the run.json path).
    """
    if trainer.get("kind") != REEVAL_KIND or trainer.get("steps") is None:
        return None
    text = trainer["steps"]
    if not isinstance(text, str):
        raise ValueError(f"{source}: field trainer.steps must be a string, got {text!r}")
    try:
        return parse_steps(text)
    except ValueError as e:
        raise ValueError(f"{source}: field trainer.steps: {e}") from None
