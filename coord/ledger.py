"""The trainer's ledger, ``ledger.jsonl``: what it dispatched, ingested and retired.

Append-only, one JSON object per line: ``{"event": "dispatched"|"ingested"|"retired", "step": N,
...}``. Replaying it on restart tells a requeued trainer which points it already logged (so each is
ingested exactly once) and which are still pending (re-adopted).

Guarantees: each append is one ``write`` of a whole line followed by fsync, and "ingested" is appended
only *after* the point's metrics were written, so a crash between the two re-ingests at most the
metrics line the crash interrupted — callers make metric logging idempotent per step (see
``jobs.metrics``). Read with :func:`coord.atomic.read_jsonl_numbered`: a torn last line (crash
mid-append) is detected on open and cut off (repaired); a malformed line anywhere else is an error
naming the file and line, never silently skipped.

Only the writer repairs: a reader of a live run (status, a worker) opens it with ``repair=False``,
which ignores an incomplete last line instead of truncating the file — on a shared filesystem a
reader can see an append half-arrived, and cutting it off would destroy the writer's record.

Limits: one writer per ledger (the trainer); concurrent appenders are not coordinated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coord.atomic import append_line, read_jsonl_numbered

EVENTS = ("dispatched", "ingested", "retired")


class LedgerError(ValueError):
    """A ledger line that cannot be trusted (malformed JSON or fields); the message names file and line."""


@dataclass
class LedgerState:
    dispatched: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> dispatch record
    ingested: set[int] = field(default_factory=set)
    retired: set[int] = field(default_factory=set)

    @property
    def pending(self) -> list[int]:
        return sorted(set(self.dispatched) - self.ingested)


class Ledger:
    def __init__(self, path: Path, repair: bool = True) -> None:
        self.path = Path(path)
        self.repair = repair
        self.repaired_bytes = 0
        self.state = LedgerState()
        self._replay()

    def _replay(self) -> None:
        try:
            records, torn = read_jsonl_numbered(self.path, repair=self.repair, what="ledger line")
        except ValueError as e:
            raise LedgerError(str(e)) from None
        if self.repair:
            self.repaired_bytes = torn
        for lineno, rec in records:
            self._apply(self._check(rec, lineno))

    def _check(self, rec: dict[str, Any], lineno: int) -> dict[str, Any]:
        if rec.get("event") not in EVENTS or not isinstance(rec.get("step"), int):
            raise LedgerError(f"{self.path}:{lineno}: ledger line needs an 'event' in {EVENTS} and an integer 'step'")
        return rec

    def _apply(self, rec: dict[str, Any]) -> None:
        step = rec["step"]
        if rec["event"] == "dispatched":
            self.state.dispatched[step] = rec
        elif rec["event"] == "ingested":
            self.state.ingested.add(step)
        else:
            self.state.retired.add(step)

    def append(self, event: str, step: int, **fields: Any) -> None:
        if event not in EVENTS:
            raise ValueError(f"unknown ledger event {event!r}; expected one of {EVENTS}")
        rec = {"event": event, "step": step, **fields}
        append_line(self.path, (json.dumps(rec, sort_keys=True) + "\n").encode())
        self._apply(rec)
