"""Checkpoint layouts of the trainers people run: the registry :data:`LAYOUTS` (name -> lazily imported class).

A layout tells, for a watched directory, each save's step, where its Hugging Face weights are and the trainer's own
"this save is finished" signal (:class:`ckpteval.coord.layouts.base.Layout`). ``auto`` asks every layout but
``plain`` (:func:`detect_layouts`, :func:`resolve_layout`). Names, detection and adding a layout (a module, one line
in :data:`LAYOUTS`, its tree in ``tests/test_layouts.py``): docs/USER_GUIDE.md "Checkpoint layouts".

Guarantee: importing this module imports no layout; a layout module imports nothing of engines or
SLURM. Limits: a layout reads names and small files only; it cannot tell a crashed trainer's
never-finished save from a slow one (such a save simply never becomes admissible).
"""

from __future__ import annotations

import functools
from pathlib import Path

from ckpteval.coord.layouts.base import Layout, Located
from ckpteval.coord.registry import Registry

AUTO = "auto"
FALLBACK = "plain"
LAYOUTS: Registry[str] = Registry(
    "a layout",
    ("plain", "ckpteval.coord.layouts.plain:PlainLayout"),
    ("hf-trainer", "ckpteval.coord.layouts.hf_trainer:HFTrainerLayout"),
    ("verl", "ckpteval.coord.layouts.verl:VerlLayout"),
    ("openrlhf", "ckpteval.coord.layouts.openrlhf:OpenRLHFLayout"),
    ("prime-rl", "ckpteval.coord.layouts.prime_rl:PrimeRLLayout"),
    ("nemo-rl", "ckpteval.coord.layouts.nemo_rl:NemoRLLayout"),
    ("miles", "ckpteval.coord.layouts.miles:MilesLayout"),
    unknown="--layout {name!r}: unknown; expected one of " + AUTO + ", {known} ({hint}see --help)",
)


def layout_choices() -> tuple[str, ...]:
    """``auto`` and every registered name (the ``--layout`` choices)."""
    return (AUTO, *LAYOUTS)


@functools.cache
def get_layout(name: str) -> Layout:
    """The layout registered as ``name`` (imported on first use); ValueError names the known ones."""
    return LAYOUTS.load(name)()  # type: ignore[no-any-return]


def detect_layouts(root: Path) -> list[str]:
    """The specific layouts (all but ``plain``) whose trainer-only saves ``root`` holds."""
    return [name for name in LAYOUTS if name != FALLBACK and get_layout(name).looks_like(Path(root))]


def resolve_layout(root: Path, name: str) -> Layout | None:
    """The layout to use for ``root``: ``name`` itself, or under ``auto`` the one detected (None: nothing
    told yet, use ``plain`` and ask again). ValueError (one line) when ``auto`` finds several."""
    if name != AUTO:
        return get_layout(name)
    found = detect_layouts(root)
    if len(found) > 1:
        raise ValueError(f"--watch {root}: --layout auto is ambiguous, the dir holds saves of "
                         f"{' and '.join(found)}; give --layout NAME")
    return get_layout(found[0]) if found else None


__all__ = ["AUTO", "FALLBACK", "LAYOUTS", "Layout", "Located", "detect_layouts", "get_layout",
           "layout_choices", "resolve_layout"]
