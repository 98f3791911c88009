"""Per-dataset columns of the points table beyond the score: the derived metrics (``pass@k``, ``pass^k``,
``maj@n``) and the length numbers of a generated set (truncated and no-answer shares, mean completion and
reasoning tokens: :mod:`ckpteval.jobs.eval.answering`).

Pure functions of ``status`` data (:func:`ckpteval.jobs.views.status.collect_status`); no I/O.
"""

from __future__ import annotations

from typing import Any


def derived_keys(status: dict[str, Any]) -> dict[str, list[str]]:
    """Per dataset, the derived metrics (``pass@k``, ``pass^k``, ``maj@n``) any of its points has, in that order."""
    keys: dict[str, set[str]] = {ds: set() for ds in status["datasets"]}
    for p in status["points"]:
        for ds, d in p["datasets"].items():
            keys.setdefault(ds, set()).update(d.get("derived", {}))

    def order(key: str) -> tuple[int, int]:
        k = key[5:] if key.startswith(("pass@", "pass^")) else key.partition("@")[2]
        return ({"pass@": 0, "pass^": 1}.get(key[:5], 2), int(k) if k.isdigit() else 0)

    return {ds: sorted(ks, key=order) for ds, ks in keys.items()}


LENGTH_CELL = (("truncated", "trunc", 2), ("no_answer", "noans", 2), ("completion_tokens", "tok", 0),
               ("reasoning_tokens", "think", 0))
"""The ``<ds> length`` cell: share cut at the length limit, share with no answer, mean tokens, mean reasoning tokens."""


def length_cell(d: dict[str, Any]) -> str:
    """The ``<ds> length`` cell of one dataset at one point ("-": none of :data:`LENGTH_CELL`'s numbers)."""
    extras = d.get("extras", {})
    parts = [f"{short}={extras[key]:.{digits}f}" for key, short, digits in LENGTH_CELL if key in extras]
    return " ".join(parts) or "-"
