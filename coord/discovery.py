"""Discovery: which complete snapshots exist under a root, cheaply and repeatedly.

Guarantees:
- Only directories with a valid ``.complete`` marker are reported (``.tmp-*`` and dot names are never
  looked at), so a torn or unfinished snapshot is never discovered.
- An idle poll costs one directory listing: a directory already known complete is not re-read; a
  vanished one is dropped from the cache. Metadata calls are the expensive thing on Lustre.
- Foreign checkpoints without a marker (an HF Trainer ``checkpoint-500/``) are admitted only when
  ``admit_foreign`` is on, after quiescence: no file's size or mtime changed for ``quiescence_s``
  (measured on this process's monotonic clock), *subdirectories included* (DeepSpeed's
  ``global_stepN/`` optimizer shards come after the weights), *and* every shard named by
  ``model.safetensors.index.json`` (or ``model.safetensors``; for a LoRA adapter checkpoint
  ``adapter_model.safetensors`` + ``adapter_config.json``) is present. The admission computes full
  checksums once, of exactly the files eval loads (:func:`coord.snapshot.is_eval_file`: config,
  tokenizer, weights + index — not optimizer shards, ``rng_state*.pth``, ``trainer_state.json``), and
  records an *adopted* marker in ``adoption_dir`` — the foreign dir is never written to — so later
  verification has something to compare against. A checkpoint that vanishes at any moment (rotation by
  ``save_total_limit``: before, during or after admission) is silence here, never an exception.
- Run identity: with ``run`` (this run's key, :mod:`coord.identity`), a snapshot whose marker names
  another run is never reported as this run's — under a watched (foreign) root it is adopted like any
  finished checkpoint into this run's own ``adoption_dir``, elsewhere ignored. Legacy markers (no
  ``run`` field, written before run identity) are reported as before.

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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from coord.atomic import read_json_object, write_json_atomic
from coord.identity import weight_version
from coord.snapshot import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MARKER,
    Marker,
    describe_files,
    is_eval_file,
    parse_marker,
    producer_identity,
    read_marker,
    step_from_name,
)

FOREIGN_TEMP_PREFIXES = ("tmp-", "tmp_", "temp-")


@dataclass(frozen=True)
class SnapshotRef:
    step: int
    path: Path
    marker: Marker

    @property
    def foreign(self) -> bool:
        return self.marker.mode == "foreign"


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
    run: str | None = None  # this run's key (coord.identity): another run's marker is not ours
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
        if self.run is not None and marker.run is not None and marker.run != self.run:
            # another run's snapshot (a shared staging dir): never ours; under a watched dir it is a
            # finished checkpoint like any other, adopted into this run's own record
            return self._adopt_marked(path, marker) if self.admit_foreign else None
        return SnapshotRef(marker.step, path, marker)

    def _adoption_path(self, step: int) -> Path:
        if self.adoption_dir is None:
            raise ValueError("no adoption_dir")
        return self.adoption_dir / f"{step:010d}.json"

    def _adopted(self, step: int, path: Path) -> SnapshotRef | None:
        """This run's record of an already adopted checkpoint of ``step`` (None if none or unreadable)."""
        adopted = self._adoption_path(step)
        try:
            return SnapshotRef(step, path, parse_marker(read_json_object(adopted), adopted))
        except (FileNotFoundError, ValueError):
            return None

    def _examine_foreign(self, path: Path) -> SnapshotRef | None:
        if path.name.startswith(FOREIGN_TEMP_PREFIXES) or not path.is_dir():
            return None  # e.g. HF Trainer's tmp-checkpoint-500/, renamed to checkpoint-500/ when done
        if (step := step_from_dir(path)) is None:
            return None
        if self._adoption_path(step).exists():
            return self._adopted(step, path)
        signature = tree_signature(path)
        if signature is None:
            self._pending.pop(path.name, None)  # vanished (rotated away): silence
            return None
        now = self.clock()
        pending = self._pending.get(path.name)
        if pending is None or pending.signature != signature:
            self._pending[path.name] = _Pending(signature, now)
            return None
        if now - pending.since < self.quiescence_s or not shards_present(path, {s[0] for s in signature}):
            return None
        return self._adopt(path, step)

    def _adopt(self, path: Path, step: int) -> SnapshotRef | None:
        """Checksum what eval loads (only that: :func:`coord.snapshot.is_eval_file`) and record it.

        A checkpoint that vanishes while it is read (rotation) is silence: None, nothing recorded."""
        try:
            infos = describe_files(path, None, eval_only=True)
        except (FileNotFoundError, NotADirectoryError):
            self._pending.pop(path.name, None)
            return None
        if not shards_present(path, set(infos)):
            return None  # deleted under us between the listing and the checksums
        return self._record(path, Marker(step, self._version(step), infos, producer_identity(), "foreign",
                                         time.time(), self.run))

    def _adopt_marked(self, path: Path, marker: Marker) -> SnapshotRef | None:
        """Another run's complete snapshot under a watched dir: its checksums, this run's record."""
        if (ref := self._adopted(marker.step, path)) is not None:
            return ref
        files = {n: i for n, i in marker.files.items() if is_eval_file(n)}
        return self._record(path, Marker(marker.step, self._version(marker.step), files, producer_identity(),
                                         "foreign", time.time(), self.run))

    def _version(self, step: int) -> str:
        return str(step) if self.run is None else weight_version(self.run, step)

    def _record(self, path: Path, marker: Marker) -> SnapshotRef:
        record = self._adoption_path(marker.step)
        record.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(record, {**marker.to_json(), "source": str(path)})
        return SnapshotRef(marker.step, path, marker)


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


__all__ = ["MARKER", "SnapshotDiscovery", "SnapshotRef", "shards_present", "step_from_dir", "tree_signature"]
