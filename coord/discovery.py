"""Discovery: which complete snapshots exist under a root, cheaply and repeatedly.

Guarantees:
- Only directories with a valid ``.complete`` marker are reported (``.tmp-*`` and dot names are never
  looked at), so a torn or unfinished snapshot is never discovered.
- An idle poll costs one directory listing: a directory already known complete is not re-read; a
  vanished one is dropped from the cache. Metadata calls are the expensive thing on Lustre.
- Foreign checkpoints without a marker (an HF Trainer ``checkpoint-500/``) are admitted only when
  ``admit_foreign`` is on, after quiescence: no file's size or mtime changed for ``quiescence_s``
  (measured on this process's monotonic clock) *and* every shard named by
  ``model.safetensors.index.json`` (or ``model.safetensors``; for a LoRA adapter checkpoint
  ``adapter_model.safetensors`` + ``adapter_config.json``) is present. The admission computes full
  checksums once and records an *adopted* marker in ``adoption_dir`` — the foreign dir is never
  written to — so later verification has something to compare against.

- Never trusted: symlinked entries (a link can point anywhere; publish and checkpoint saves create
  real directories), and a marked directory whose name's trailing digits disagree with its marker's
  step (a snapshot copied or moved under another step's name would be scored as the wrong step).

Limits: a directory already reported is not re-verified here (the worker verifies before use); the
step of a foreign dir comes from trailing digits of its name or ``trainer_state.json``'s
``global_step``; dirs with neither are ignored. Pending foreign dirs cost one listing + one stat per
file per poll until admitted.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from coord.atomic import read_json_object, write_json_atomic
from coord.snapshot import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MARKER,
    Marker,
    describe_files,
    parse_marker,
    producer_identity,
    read_marker,
)

TRAILING_DIGITS = re.compile(r"(\d+)$")
FOREIGN_TEMP_PREFIXES = ("tmp-", "tmp_", "temp-")


@dataclass(frozen=True)
class SnapshotRef:
    step: int
    path: Path
    marker: Marker

    @property
    def foreign(self) -> bool:
        return self.marker.mode == "foreign"


def step_from_name(path: Path) -> int | None:
    """The trailing digits of a dir name (``step-0000000100``, ``checkpoint-100``), if any."""
    m = TRAILING_DIGITS.search(path.name)
    return int(m.group(1)) if m else None


def step_from_dir(path: Path) -> int | None:
    """Step of a checkpoint dir from its name's trailing digits, else ``trainer_state.json``."""
    if (step := step_from_name(path)) is not None:
        return step
    try:
        state = read_json_object(path / "trainer_state.json")
    except (FileNotFoundError, ValueError):
        return None
    step = state.get("global_step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


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


@dataclass
class _Pending:
    signature: tuple[tuple[str, int, int], ...]
    since: float


@dataclass
class SnapshotDiscovery:
    """Polls one root for snapshots; keep one instance per root for the cache to pay off."""

    root: Path
    admit_foreign: bool = False
    quiescence_s: float = 30.0
    adoption_dir: Path | None = None
    clock: Callable[[], float] = time.monotonic
    _known: dict[str, SnapshotRef] = field(default_factory=dict)
    _pending: dict[str, _Pending] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if self.admit_foreign and self.adoption_dir is None:
            raise ValueError("admitting foreign checkpoints needs an adoption_dir to record their checksums")

    @property
    def awaiting_quiescence(self) -> list[str]:
        """Names of marker-less dirs seen but not admitted yet (still changing, too fresh, shards missing).

        A one-pass consumer (``--once``, backfill) needs this to know that waiting may still admit one:
        quiescence is measured from this instance's first observation, so no first poll admits anything.
        """
        return sorted(self._pending)

    def poll(self) -> list[SnapshotRef]:
        """All complete snapshots now under the root, sorted by step."""
        try:
            names = {
                e.name for e in os.scandir(self.root) if not e.name.startswith(".") and not e.is_symlink()
            }
        except FileNotFoundError:
            names = set()
        for gone in set(self._known) - names:
            del self._known[gone]
        for gone in set(self._pending) - names:
            del self._pending[gone]
        for name in names - set(self._known):
            if (ref := self._examine(self.root / name)) is not None:
                self._known[name] = ref
                self._pending.pop(name, None)
        return sorted(self._known.values(), key=lambda r: r.step)

    def _examine(self, path: Path) -> SnapshotRef | None:
        try:
            marker = read_marker(path)
        except (FileNotFoundError, NotADirectoryError):
            return self._examine_foreign(path) if self.admit_foreign else None
        except ValueError:
            return None  # a malformed marker is never trusted; the worker's verify reports it
        if (named := step_from_name(path)) is not None and named != marker.step:
            return None  # a marked dir under another step's name (copied, moved, planted): not trusted
        return SnapshotRef(marker.step, path, marker)

    def _adoption_path(self, step: int) -> Path:
        if self.adoption_dir is None:
            raise ValueError("no adoption_dir")
        return self.adoption_dir / f"{step:010d}.json"

    def _examine_foreign(self, path: Path) -> SnapshotRef | None:
        if path.name.startswith(FOREIGN_TEMP_PREFIXES) or not path.is_dir():
            return None  # e.g. HF Trainer's tmp-checkpoint-500/, renamed to checkpoint-500/ when done
        if (step := step_from_dir(path)) is None:
            return None
        adopted = self._adoption_path(step)
        if adopted.exists():
            try:
                return SnapshotRef(step, path, parse_marker(read_json_object(adopted), adopted))
            except ValueError:
                return None
        try:
            signature = tuple(
                sorted((e.name, st.st_size, st.st_mtime_ns) for e in os.scandir(path) if (st := e.stat()))
            )
        except FileNotFoundError:
            return None
        now = self.clock()
        pending = self._pending.get(path.name)
        if pending is None or pending.signature != signature:
            self._pending[path.name] = _Pending(signature, now)
            return None
        if now - pending.since < self.quiescence_s or not shards_present(path, {s[0] for s in signature}):
            return None
        return self._adopt(path, step, adopted)

    def _adopt(self, path: Path, step: int, record: Path) -> SnapshotRef:
        infos = describe_files(path, None)
        marker = Marker(step, str(step), infos, producer_identity(), "foreign", time.time())
        record.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(record, {**marker.to_json(), "source": str(path)})
        return SnapshotRef(step, path, marker)


__all__ = ["MARKER", "SnapshotDiscovery", "SnapshotRef", "shards_present", "step_from_dir"]
