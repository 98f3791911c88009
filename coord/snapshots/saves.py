"""What a watched root holds before discovery admits it, read only: the saves found but waiting (what
``ckpteval status`` shows), whether a save's weight files are all there, a tree's change signature (the
quiescence test) and the steps recorded as lost to rotation (``RUN/lost/<step>.json``, written by
:class:`ckpteval.coord.snapshots.discovery.SnapshotDiscovery`).

Guarantees: names and stats only — nothing here reads weights, writes, or trusts a save (admission and
its checksums are discovery's). A file or dir that vanishes mid-read is silence (left out), never an
exception.

Limits: a listing is a moment's view; a save rotated away just after it is still shown once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import read_json_object
from ckpteval.coord.layouts import AUTO, FALLBACK, Layout, Located, get_layout, resolve_layout
from ckpteval.coord.layouts.base import entries as layout_entries
from ckpteval.coord.snapshots.snapshot import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MARKER

FOREIGN_TEMP_PREFIXES = ("tmp-", "tmp_", "temp-")  # a trainer's save in progress (HF Trainer's tmp-checkpoint-N)


def shards_present(path: Path, names: set[str]) -> bool:
    """Every weight file the checkpoint promises is there (index-named shards or a single file; for a
    LoRA adapter checkpoint, its weights and its config)."""
    if ADAPTER_WEIGHTS in names:
        return ADAPTER_CONFIG in names
    index = path / "model.safetensors.index.json"
    if "model.safetensors.index.json" in names:
        try:
            weight_map = read_json_object(index).get("weight_map")
        except (FileNotFoundError, ValueError):
            return False
        return isinstance(weight_map, dict) and bool(weight_map) and set(weight_map.values()) <= names
    return "model.safetensors" in names


def waiting_saves(root: Path, layout: str = AUTO, adoption_dir: Path | None = None) -> list[dict[str, Any]]:
    """Saves under the watched ``root`` that are found but not admitted: what ``ckpteval status`` shows.

    One row per save its layout places (step, path, layout, ``waits_for`` — the trainer's signal, quiescence,
    HF weights, or a worker to admit it — and ``since``: the newest mtime of the save dir and its weights
    dir, wall clock). Admitted saves (``adoption_dir`` records, ckpteval markers) are left out. Only reads
    names and stats; an ambiguous ``auto`` is one row naming the layouts. Stateless: a save a watcher saw
    and lost to rotation is in ``RUN/lost/`` (:func:`lost_steps`), not here."""
    root = Path(root)
    try:
        chosen = resolve_layout(root, layout) or get_layout(FALLBACK)
    except ValueError as e:
        return [{"step": None, "path": str(root), "layout": layout, "waits_for": str(e), "since": None}]
    rows = []
    for container in chosen.containers(root):
        for entry in layout_entries(container):
            if entry.name.startswith(FOREIGN_TEMP_PREFIXES) or (found := chosen.locate(entry)) is None:
                continue
            if adoption_dir is not None and (adoption_dir / f"{found.step:010d}.json").exists():
                continue
            if not chosen.owns_marker_name and (entry / MARKER).is_file():
                continue  # a ckpteval snapshot (reuse mode, another run's): discovered as such
            rows.append({"step": found.step, "path": str(entry), "layout": chosen.name,
                         "waits_for": _waits_for(chosen, found), "since": _newest_mtime(entry, found.weights)})
    return sorted(rows, key=lambda r: r["step"])


def _waits_for(layout: Layout, found: Located) -> str:
    """What an unadmitted save waits for, in words."""
    weights = shards_present(found.weights, file_names(found.weights))
    if found.complete is False:
        return f"the trainer's signal: {layout.signal}"
    if found.complete is None:
        return "quiescence (no change for --quiescence s)" + ("" if weights else " and its HF weights/indexed shards")
    if not weights:
        return f"HF weights in {found.weights.name}/ ({layout.no_weights_hint})"
    return "a worker to admit it (none is polling this dir with --watch?)"


def _newest_mtime(*paths: Path) -> float | None:
    """The newest mtime of ``paths`` and the files directly in them (None if all are gone)."""
    times = []
    for path in paths:
        try:
            times.append(path.stat().st_mtime)
            times += [e.stat(follow_symlinks=False).st_mtime for e in os.scandir(path)]
        except (FileNotFoundError, NotADirectoryError):
            continue
    return max(times) if times else None


def lost_steps(lost_dir: Path) -> list[int]:
    """The steps recorded in ``lost_dir`` (``RUN/lost/``) as seen but rotated away before admission."""
    try:
        names = os.listdir(lost_dir)
    except FileNotFoundError:
        return []
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())


def file_names(path: Path) -> set[str]:
    """File names directly in ``path`` (empty if it is gone)."""
    try:
        return {e.name for e in os.scandir(path) if e.is_file(follow_symlinks=False)}
    except (FileNotFoundError, NotADirectoryError):
        return set()


def tree_signature(path: Path) -> tuple[tuple[str, int, int], ...] | None:
    """(relative name, size, mtime) of every file under ``path``, subdirectories included (a trainer's
    ``global_stepN/`` shards are written after the weights); None if ``path`` itself is gone. A file
    deleted between the listing and its stat is left out (the next poll sees the change)."""
    if not path.is_dir():
        return None
    found = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in files:
            full = os.path.join(root, name)
            try:
                st = os.stat(full, follow_symlinks=False)
            except FileNotFoundError:
                continue
            found.append((os.path.relpath(full, path), st.st_size, st.st_mtime_ns))
    return tuple(sorted(found)) if path.is_dir() else None
