"""Checkpoint layouts of the trainers people run: a registry of name -> lazily imported ``module:Class``.

What it owns: for a watched directory (``ckpteval worker --watch``, ``backfill``), how to find each save's
step, the directory holding its Hugging Face weights, and the trainer's own "this save is finished"
signal (:class:`ckpteval.coord.layouts.base.Layout`). Discovery (:mod:`ckpteval.coord.snapshots.discovery`) admits a save as soon as
the signal is there and every indexed shard is present, and falls back to quiescence only for a
trainer that gives no signal.

Names (``--layout NAME``): ``plain`` (step dirs, no signal), ``hf-trainer`` (HF Trainer / TRL),
``verl``, ``openrlhf``, ``prime-rl``, ``nemo-rl``, ``miles`` (and slime's ``--save-hf``, which falls back to
quiescence). ``auto`` (the default) asks every layout but ``plain`` whether the dir holds a save only its
trainer writes (:func:`detect_layouts`): one answer is used from then on; none leaves ``plain`` in
effect and asks again next poll (a first save is often not finished yet); two or more is refused with
one line (:func:`resolve_layout`) — give ``--layout NAME``.

Guarantee: importing this module imports no layout; a layout module imports nothing of engines or
SLURM. Limits: a layout reads names and small files only; it cannot tell a crashed trainer's
never-finished save from a slow one (such a save simply never becomes admissible).

Adding a layout (a trainer not listed):

1. Read the trainer's save code for the dir names, where the HF weights go, the order files are
   written in, any marker or tracker written last, and its rotation; cite what you read in the module
   docstring.
2. Write ``coord/layouts/<trainer>.py`` with a :class:`~ckpteval.coord.layouts.base.Layout` subclass: ``name``,
   ``signal`` and ``no_weights_hint`` (what to run when a finished save has no HF weights), ``locate``
   (entry -> :class:`~ckpteval.coord.layouts.base.Located`, ``complete=None`` only if the trainer gives no
   signal) and ``looks_like`` (true only for saves no other trainer writes).
3. Add ``("<name>", "ckpteval.coord.layouts.<trainer>:<Class>")`` to :data:`LAYOUTS`.
4. Add the trainer's exact tree to ``tests/test_layouts.py`` (``TREES``): written slowly and rotated.
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
