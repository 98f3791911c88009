"""The trainer's ledger, ``ledger.jsonl``: what it dispatched, exported, skipped, ingested and retired.

Guarantee: each append is one whole line and fsync; "ingested" follows the point's metrics, so a crash
re-ingests at most one metrics line. Limits: one writer (the trainer). See docs/PROTOCOL.md §8.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import append_line, read_jsonl_numbered

EVENTS = ("dispatched", "exported", "evaluated_shared", "skipped", "ingested", "retired", "stop_requested")
RECORD_EVENTS = ("exported", "evaluated_shared", "skipped")  # fold their fields into the step's record


class LedgerError(ValueError):
    """A ledger line that cannot be trusted (malformed JSON or fields); the message names file and line."""


@dataclass
class LedgerState:
    dispatched: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> its folded record
    skipped: dict[int, tuple[str, str]] = field(default_factory=dict)  # step -> (reason, message)
    ingested: set[int] = field(default_factory=set)
    retired: set[int] = field(default_factory=set)
    stop_requested: dict[int, dict[str, Any]] = field(default_factory=dict)  # step whose point met --eval-stop-when
    ingested_gpu_s: dict[int, float] = field(default_factory=dict)  # step -> its point's eval GPU-seconds (recorded)

    @property
    def pending(self) -> list[int]:
        return sorted(set(self.dispatched) - self.ingested)

    def apply(self, rec: dict[str, Any]) -> None:
        step, event = rec["step"], rec["event"]
        fields = {k: v for k, v in rec.items() if k not in {"event", "step"}}
        if event == "dispatched":
            self.dispatched[step] = fields
            self.skipped.pop(step, None)
        elif event in RECORD_EVENTS:
            self.dispatched.setdefault(step, {}).update(fields)
            if event == "skipped":
                self.skipped[step] = (str(fields.get("reason", "unknown")), str(fields.get("message", "")))
        elif event == "ingested":
            self.ingested.add(step)
            gpu_s = fields.get("eval_gpu_s")
            if isinstance(gpu_s, int | float) and not isinstance(gpu_s, bool) and math.isfinite(gpu_s):
                self.ingested_gpu_s[step] = float(gpu_s)
        elif event == "stop_requested":
            self.stop_requested[step] = fields
        else:
            self.retired.add(step)


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
            self.state.apply(self._check(rec, lineno))

    def _check(self, rec: dict[str, Any], lineno: int) -> dict[str, Any]:
        if rec.get("event") not in EVENTS or not isinstance(rec.get("step"), int):
            raise LedgerError(f"{self.path}:{lineno}: ledger line needs an 'event' in {EVENTS} and an integer 'step'")
        return rec

    def append(self, event: str, step: int, **fields: Any) -> None:
        if event not in EVENTS:
            raise ValueError(f"unknown ledger event {event!r}; expected one of {EVENTS}")
        rec = {"event": event, "step": step, **fields}
        append_line(self.path, (json.dumps(rec, sort_keys=True, allow_nan=False) + "\n").encode())
        self.state.apply(rec)
