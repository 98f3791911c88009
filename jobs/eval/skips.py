"""The unit outcome that is a skip: what every evaluator, scorer and check raises to skip a unit with a
reason (the reasons themselves are the subclasses', next to what detects them). A leaf: imports nothing."""

from __future__ import annotations


class WorkerSkip(RuntimeError):
    """A unit outcome that is a skip with :attr:`reason`; :attr:`blame` names user code that failed
    (a scorer, a library task): such a skip is written at once, never retried elsewhere."""

    reason = "crashed"
    blame: str | None = None
