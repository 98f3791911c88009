"""Discovery: which complete snapshots exist under a root, cheaply and repeatedly.

Owns listing a root (``.complete`` markers; marker-less foreign saves through their layout, after quiescence or
their trainer's signal), adoption records and :func:`refuse_other_runs` (an output dir holding another run's
snapshots). Guarantee: only complete snapshots are reported. Limits: a reported directory is not re-verified
here (the worker verifies before use). See docs/PROTOCOL.md §4.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckpteval.coord.atomic import read_json_object, write_json_atomic
from ckpteval.coord.layouts import AUTO, FALLBACK, Layout, Located, get_layout, resolve_layout
from ckpteval.coord.layouts.plain import step_from_dir
from ckpteval.coord.run.identity import weight_version
from ckpteval.coord.snapshots.saves import FOREIGN_TEMP_PREFIXES, file_names, shards_present, tree_signature
from ckpteval.coord.snapshots.snapshot import (
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

CAPTURED = "captured"  # RUN/captured/step_N: ephemeral saves (prime-rl broadcasts) taken before cleanup
CONFIG = "config.json"


@dataclass(frozen=True)
class SnapshotRef:
    step: int
    path: Path
    marker: Marker

    @property
    def foreign(self) -> bool:
        return self.marker.mode == "foreign"


@dataclass
class _Pending:
    signature: tuple[tuple[str, int, int], ...]
    since: float
    step: int


@dataclass
class SnapshotDiscovery:
    """Polls one root for snapshots; keep one instance per root for the cache to pay off."""

    root: Path
    admit_foreign: bool = False
    quiescence_s: float = 30.0
    adoption_dir: Path | None = None
    clock: Callable[[], float] = time.monotonic
    run: str | None = None  # this run's key (ckpteval.coord.run.identity): another run's marker is not ours
    adopt_only: str | None = None  # under a foreign root, adopt only markers naming this key (None: any marked)
    layout: str = FALLBACK  # ckpteval.coord.layouts name, or "auto": how foreign saves under root are laid out
    lost_dir: Path | None = None  # where a save lost to rotation before admission is recorded (<step>.json)
    wanted: Callable[[int], bool] | None = None  # steps worth capturing (ephemeral saves); None: every step
    _known: dict[str, SnapshotRef] = field(default_factory=dict)
    _pending: dict[str, _Pending] = field(default_factory=dict)
    lost: dict[str, int] = field(default_factory=dict)  # entry -> step of saves seen, gone before admission
    problems: dict[str, str] = field(default_factory=dict)  # key -> one line, for the consumer to print once

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if self.admit_foreign and self.adoption_dir is None:
            raise ValueError("admitting foreign checkpoints needs an adoption_dir to record their checksums")
        self._layout: Layout | None = None if self.layout == AUTO else get_layout(self.layout)

    @property
    def active_layout(self) -> Layout:
        """The layout in effect: the one given or detected, else ``plain`` (``auto`` not decided yet)."""
        if self._layout is None and self.admit_foreign:
            try:
                self._layout = resolve_layout(self.root, AUTO)
            except ValueError as e:
                self.problems.setdefault("layout", str(e))  # admit nothing through a guessed layout
                return get_layout(FALLBACK)
        return self._layout or get_layout(FALLBACK)

    @property
    def awaiting_quiescence(self) -> list[str]:
        """Names of marker-less dirs seen but not admitted yet (still changing, too fresh, shards missing).

        A one-pass consumer (``--once``, backfill) needs this to know that waiting may still admit one:
        quiescence is measured from this instance's first observation, so no first poll admits anything.
        """
        return sorted(self._pending)

    def poll(self) -> list[SnapshotRef]:
        """All complete snapshots now under the root, sorted by step."""
        listing = self._listing()
        for gone in set(self._known) - set(listing):
            if self._known[gone].path.is_relative_to(self.root) or not self._known[gone].path.is_dir():
                del self._known[gone]  # a capture (RUN/captured) outlives the trainer's cleanup of its source
        for gone in set(self._pending) - set(listing):
            self._lose(gone, self._pending.pop(gone).step)
        for name in set(listing) - set(self._known):
            if (ref := self._examine(listing[name])) is not None:
                self._known[name] = ref
                self._pending.pop(name, None)
        self._add_captures()
        return sorted(self._known.values(), key=lambda r: r.step)

    def _add_captures(self) -> None:
        """Captures of this root's ephemeral saves (``RUN/captured``) whose source is gone: a process that
        starts after the trainer's cleanup finds them through their adoption records (``origin``)."""
        if not self.admit_foreign or self.adoption_dir is None:
            return
        if not (self.adoption_dir.parent / CAPTURED).is_dir():
            return  # one stat per poll when nothing was ever captured
        known = {r.step for r in self._known.values()}
        for ref in adopted_refs(self.adoption_dir, origin=str(self.root)):
            if ref.step not in known and ref.path.is_dir():
                self._known[f"{CAPTURED}:{ref.step}"] = ref

    def _listing(self) -> dict[str, Path]:
        """Entry key (path relative to root) -> path, over the layout's containers (foreign roots)."""
        containers = self.active_layout.containers(self.root) if self.admit_foreign else [self.root]
        found: dict[str, Path] = {}
        for container in containers:
            try:
                scan = list(os.scandir(container))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for e in scan:
                if not e.name.startswith(".") and not e.is_symlink():
                    path = Path(e.path)
                    found[str(path.relative_to(self.root))] = path
        return found

    def _lose(self, name: str, step: int) -> None:
        """A save seen but gone before admission: counted and recorded, unless someone adopted it."""
        if self.adoption_dir is not None and self._adoption_path(step).exists():
            return
        self.lost[name] = step
        if self.lost_dir is not None:
            self.lost_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.lost_dir / f"{step:010d}.json",
                              {"step": step, "source": str(self.root / name), "layout": self.active_layout.name,
                               "time": time.time()})

    def _examine(self, path: Path) -> SnapshotRef | None:
        try:
            marker = read_marker(path)
        except (FileNotFoundError, NotADirectoryError):
            return self._examine_foreign(path) if self.admit_foreign else None
        except ValueError:
            if self.admit_foreign and self.active_layout.owns_marker_name:
                return self._examine_foreign(path)  # the trainer's own .complete (miles), not ours
            return None  # a malformed marker is never trusted; the worker's verify reports it
        if (named := step_from_name(path)) is not None and named != marker.step:
            return None  # a marked dir under another step's name (copied, moved, planted): not trusted
        if self.run is None or marker.run == self.run:
            return SnapshotRef(marker.step, path, marker)
        if self.admit_foreign and self.adopt_only is not None and marker.run != self.adopt_only:
            self.problems.setdefault(f"notsource:{path.name}", f"{path}: ignored: its marker names "
                                     f"{marker.run or 'no run'}, not the re-evaluated run {self.adopt_only}")
            return None
        if self.admit_foreign:
            # another run's finished checkpoint under a watched dir: adopted into this run's own record;
            # a run-less one there is a finished checkpoint as it is (module docstring)
            return self._adopt_marked(path, marker) if marker.run is not None else SnapshotRef(marker.step, path, marker)
        if marker.run is None:  # in this run's own root every marker its trainer writes names the run
            self.problems.setdefault(f"runless:{path.name}", f"{path}: ignored: marker without a run key: written by "
                                     f"an older ckpteval or another tool; not this run's ({self.run}) snapshot")
        elif marker.mode == "reuse":  # a trainer's save dir (checkpoint-N) of another run in this run's root
            self.problems.setdefault(f"otherrun:{path.name}", overwritten(path, marker.run, self.run))
        return None  # another run's snapshot (a shared staging dir): never ours

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
        if (found := self.active_layout.locate(path)) is None:
            return None
        key = str(path.relative_to(self.root))
        if found.ephemeral and self.wanted is not None and not self.wanted(found.step):
            return None  # a broadcast of a step with nothing to evaluate: never captured
        if self._adoption_path(found.step).exists():
            return self._adopted(found.step, self._capture_path(found.step) if found.ephemeral else found.weights)
        if found.complete is None:
            return self._quiesced(key, path, found)
        self._pending.setdefault(key, _Pending((), self.clock(), found.step))
        if not found.complete:
            return None  # the trainer has not said it is finished yet
        if not path.is_dir():
            self._lose(key, self._pending.pop(key).step)
            return None
        origin = None
        if found.ephemeral and shards_present(found.weights, file_names(found.weights)):
            if (captured := self._capture(found, key)) is None:
                return None
            found, origin = Located(found.step, captured, True), str(self.root)
        if not shards_present(found.weights, file_names(found.weights)):
            self.problems.setdefault(f"noweights:{key}", f"{path}: the {self.active_layout.name} save is finished "
                                     f"but {found.weights} holds no HF weights ({self.active_layout.no_weights_hint})")
            return None
        return self._adopt(found.weights, found.step, key, origin)

    def _capture_path(self, step: int) -> Path:
        return self._adoption_path(step).parent.parent / CAPTURED / f"step_{step:010d}"

    def _capture(self, found: Located, key: str) -> Path | None:
        """An ephemeral save (a prime-rl broadcast) linked (else copied) into ``RUN/captured/step_N`` and
        checked unchanged afterwards (the layout's completion marker and every file: inode, size, mtime); the run's config and
        tokenizer (``RUN/base``) fill in what the save lacks. A race with the trainer's cleanup is a loss
        (recorded), never a half capture: the temp dir is renamed into place only once it is whole."""
        target = self._capture_path(found.step)
        if target.is_dir():
            return target
        tmp = target.parent / f".tmp-{target.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        marker = self.active_layout.completion_marker(found.weights)
        try:
            if marker is None:
                raise FileNotFoundError(found.weights)  # finished when located, gone (or reset) since
            signal = _identity(marker)
            seen = {name: _link_or_copy(found.weights / name, tmp / name) for name in sorted(file_names(found.weights))}
            unchanged = signal == _identity(marker) and all(
                _identity(found.weights / n) == i for n, i in seen.items())
        except (FileNotFoundError, NotADirectoryError):
            unchanged = False
        if not unchanged:
            shutil.rmtree(tmp, ignore_errors=True)
            self._lose(key, self._pending.pop(key, _Pending((), 0.0, found.step)).step)
            return None
        base = target.parent.parent / "base"
        for name in sorted(file_names(base) - file_names(tmp)):
            shutil.copy2(base / name, tmp / name)
        names = file_names(tmp)
        if CONFIG not in names and ADAPTER_WEIGHTS not in names:
            shutil.rmtree(tmp, ignore_errors=True)
            self.problems.setdefault(f"noconfig:{key}", f"{found.weights}: the {self.active_layout.name} save holds "
                                     f"weights only; put the model's {CONFIG} and tokenizer files in {base}/")
            return None
        try:
            os.rename(tmp, target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not target.is_dir():
                raise
            # another watcher of this run captured it first: its capture is the same files, use it
        return target

    def _quiesced(self, key: str, path: Path, found: Located) -> SnapshotRef | None:
        """A save whose trainer gives no completion signal: admitted once quiet with every shard present."""
        signature = tree_signature(path)
        if signature is None:
            if key in self._pending:
                self._lose(key, self._pending.pop(key).step)  # vanished (rotated away) before admission
            return None
        now = self.clock()
        pending = self._pending.get(key)
        if pending is None or pending.signature != signature:
            self._pending[key] = _Pending(signature, now, found.step)
            return None
        if now - pending.since < self.quiescence_s or not shards_present(found.weights, file_names(found.weights)):
            return None
        return self._adopt(found.weights, found.step, key)

    def _adopt(self, path: Path, step: int, key: str | None = None, origin: str | None = None) -> SnapshotRef | None:
        """Checksum what eval loads (only that: :func:`ckpteval.coord.snapshots.snapshot.is_eval_file`) and record it.

        A checkpoint that vanishes while it is read (rotation) is counted lost, nothing recorded."""
        key = path.name if key is None else key
        try:
            infos = describe_files(path, None, eval_only=True)
        except (FileNotFoundError, NotADirectoryError):
            if key in self._pending:
                self._lose(key, self._pending.pop(key).step)
            return None
        if not shards_present(path, set(infos)):
            return None  # deleted under us between the listing and the checksums
        return self._record(path, Marker(step, self._version(step), infos, producer_identity(), "foreign",
                                         time.time(), self.run), origin)

    def _adopt_marked(self, path: Path, marker: Marker) -> SnapshotRef | None:
        """Another run's complete snapshot under a watched dir: its checksums, this run's record."""
        if (ref := self._adopted(marker.step, path)) is not None:
            return ref
        files = {n: i for n, i in marker.files.items() if is_eval_file(n)}
        return self._record(path, Marker(marker.step, self._version(marker.step), files, producer_identity(),
                                         "foreign", time.time(), self.run))

    def _version(self, step: int) -> str:
        return str(step) if self.run is None else weight_version(self.run, step)

    def _record(self, path: Path, marker: Marker, origin: str | None = None) -> SnapshotRef:
        record = self._adoption_path(marker.step)
        record.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(record, {**marker.to_json(), "source": str(path), **({"origin": origin} if origin else {})})
        return SnapshotRef(marker.step, path, marker)


def overwritten(path: Path, other: str, own: str) -> str:
    """One line: ``path``, in run ``own``'s own snapshot root, holds run ``other``'s snapshot."""
    return (f"{path}: ignored: its marker names run {other}, not this run's {own}: overwritten by that run "
            "(two runs given one output dir); never scored as this run's step")


def other_runs(root: Path, own: str | None) -> dict[str, str]:
    """Marked snapshot dirs directly under ``root`` whose marker names a run other than ``own`` (None: a
    run not created yet, so any run): dir name -> that run's key. Unreadable markers are skipped here."""
    try:
        names = sorted(e.name for e in os.scandir(root) if not e.name.startswith(".") and e.is_dir(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    found = {}
    for name in names:
        try:
            marker = read_marker(Path(root) / name)
        except (OSError, ValueError):
            continue
        if marker.run is not None and marker.run != own:
            found[name] = marker.run
    return found


def refuse_other_runs(root: Path, own: str | None, what: str) -> None:
    """ValueError when the output dir ``root`` (named ``what``, e.g. ``--save-hf``) holds another run's
    snapshots: this run would overwrite them, and that run's evaluation would score this run's weights."""
    found = other_runs(root, own)
    if found:
        name, other = next(iter(found.items()))
        raise ValueError(f"{what} {root} holds {len(found)} checkpoint(s) of another run ({name}: run {other}): "
                         "this run would overwrite them, and that run's evaluation would score this run's "
                         "weights as its own; give this run an output dir of its own (or remove them)")


def adopted_refs(adoption_dir: Path, origin: str | None = None) -> list[SnapshotRef]:
    """The foreign checkpoints this run adopted (``RUN/adopted/<step>.json``), as snapshot refs (a torn or
    foreign file is left out); with ``origin``, only the captures of that watched root."""
    refs = []
    try:
        names = sorted(n for n in os.listdir(adoption_dir) if n.endswith(".json") and n[:-5].isdigit())
    except FileNotFoundError:
        return []
    for name in names:
        try:
            record = read_json_object(adoption_dir / name)
            marker = parse_marker(record, adoption_dir / name)
        except (FileNotFoundError, ValueError):
            continue
        if origin is None or record.get("origin") == origin:
            refs.append(SnapshotRef(marker.step, Path(str(record.get("source", ""))), marker))
    return refs


def _identity(path: Path) -> tuple[int, int, int]:
    """(inode, size, mtime) of ``path``: the same file, unchanged, when equal before and after."""
    st = os.stat(path, follow_symlinks=False)
    return st.st_ino, st.st_size, st.st_mtime_ns


def _link_or_copy(src: Path, dst: Path) -> tuple[int, int, int]:
    """Hardlink ``src`` to ``dst`` (a copy across filesystems); returns ``src``'s identity as it was taken."""
    before = _identity(src)
    try:
        os.link(src, dst)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        shutil.copy2(src, dst)
    return before


__all__ = ["MARKER", "SnapshotDiscovery", "SnapshotRef", "adopted_refs", "other_runs", "overwritten", "refuse_other_runs", "shards_present", "step_from_dir"]
