"""Garbage collection of a staging root (and of a run's captures, :class:`CaptureGC`), and the free-space
check before export.

Rules (each a guarantee):
- Only direct children of the staging root that are real directories are candidates; a symlink is
  never followed or deleted, and a candidate whose *resolved* path is not inside the resolved root is
  refused. Nothing outside the staging root is ever deleted.
- Only snapshots whose marker says ``mode == "staging"`` are deleted; reused checkpoints (``reuse``)
  and foreign ones are never touched, nor are directories without a readable marker (that could be
  someone's data) — except our own temp dirs (``.tmp-step-*``) older than ``stale_tmp_s``.
- Only this run's snapshots: a snapshot whose marker has no run key (written by an older ckpteval or
  another tool: it cannot be attributed) is never deleted, and with ``run`` (the run's key,
  :mod:`ckpteval.coord.run.identity`) neither is one whose marker names another run, so runs sharing one
  staging dir never collect each other's snapshots.
- Only *retired* steps (their point has settled, any outcome) are deleted, and the newest ``keep``
  retired ones are kept; so is every step in ``protected`` (the trainer's best ``--eval-keep-best K``),
  on top of those ``keep``.
- A snapshot with a live lease on any of its units is never deleted. Liveness is judged like
  a contender judges it (:mod:`ckpteval.coord.work.lease`): a lease file counts as live until this collector has seen it unchanged for the
  lease duration on its own monotonic clock, so clock skew cannot make a live lease look expired.
  Call :meth:`StagingGC.collect` repeatedly with one instance for those observations to accumulate.

Limits: a worker that loaded a snapshot into memory and released its lease is not protected (it
no longer needs the files). Free-space checks are advisory: another writer can fill the disk after
the check.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from ckpteval.coord.atomic import TMP_PREFIX
from ckpteval.coord.run.rundir import step_dir_name, step_of_dir
from ckpteval.coord.snapshots.snapshot import read_marker


@dataclass
class GCReport:
    deleted: list[Path] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)
    refused: list[tuple[Path, str]] = field(default_factory=list)
    freed_bytes: int = 0


def _lease_entries(leases_dir: Path, steps: Collection[int] | None) -> list[os.DirEntry[str]]:
    """The lease files under ``leases/step-<N>/``: with ``steps`` those of each of them, else of every step."""
    dirs = ([leases_dir / step_dir_name(s) for s in steps] if steps is not None else
            [e.path for e in _scan(leases_dir) if step_of_dir(e.name) is not None and e.is_dir()])
    return [e for d in dirs for e in _scan(Path(d)) if e.name.endswith(".lock") and e.name[:10].isdigit()]


def _scan(path: Path) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


@dataclass
class StagingGC:
    root: Path
    leases_dir: Path
    lease_duration_s: float
    keep: int = 2
    stale_tmp_s: float = 3600.0
    clock: Callable[[], float] = time.monotonic
    run: str | None = None  # the run's key: only snapshots marked with it are deleted (None: any run's)
    _seen: dict[str, tuple[tuple[int, int], float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.keep < 0:
            raise ValueError(f"keep must be >= 0, got {self.keep}")
        self.root = Path(self.root)
        self.leases_dir = Path(self.leases_dir)

    def _inside_root(self, path: Path) -> bool:
        return path.resolve().is_relative_to(self.root.resolve()) and path.resolve() != self.root.resolve()

    def live_lease_steps(self, steps: Collection[int] | None = None) -> set[int]:
        """Steps with at least one lease this collector cannot yet call expired; only the directories of
        ``steps`` (None: all) are listed."""
        now, live, current = self.clock(), set(), set()
        for e in _lease_entries(self.leases_dir, steps):
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            key = (st.st_ino, st.st_mtime_ns)
            current.add(e.path)
            seen = self._seen.get(e.path)
            if seen is None or seen[0] != key:
                self._seen[e.path] = (key, now)
                seen = self._seen[e.path]
            if now - seen[1] < self.lease_duration_s:
                live.add(int(e.name[:10]))
        for gone in set(self._seen) - current:
            del self._seen[gone]
        return live

    def collect(self, retired_steps: set[int], protected: frozenset[int] | set[int] = frozenset()) -> GCReport:
        """Delete retired staging snapshots beyond the newest ``keep``, never one of ``protected``."""
        report = GCReport()
        candidates: list[tuple[int, Path]] = []
        for entry in sorted(os.scandir(self.root), key=lambda e: e.name) if self.root.is_dir() else []:
            path = Path(entry.path)
            if entry.is_symlink():
                report.refused.append((path, "symlink: never followed or deleted"))
                continue
            if not entry.is_dir(follow_symlinks=False):
                continue
            if entry.name.startswith(TMP_PREFIX):
                self._collect_stale_tmp(path, report)
                continue
            if not self._inside_root(path):
                report.refused.append((path, "resolves outside the staging root"))
                continue
            step = self._step_of(path, report)
            if step is not None and step in protected:
                report.kept.append(path)
            elif step is not None and step in retired_steps:
                candidates.append((step, path))
        candidates.sort()
        doomed = candidates[: max(0, len(candidates) - self.keep)]
        report.kept.extend(p for _, p in candidates[len(doomed) :])
        live = self.live_lease_steps({step for step, _ in doomed}) if doomed else set()
        for step, path in doomed:
            if step in live:
                report.refused.append((path, "under a live lease"))
                continue
            self._delete(path, report)
        return report

    def _step_of(self, path: Path, report: GCReport) -> int | None:
        """The step of a candidate dir, or None (with the reason in ``report``) when it is not ours to delete:
        no valid marker, not a staging snapshot, another run's."""
        try:
            marker = read_marker(path)
        except (FileNotFoundError, ValueError):
            report.refused.append((path, "no valid marker: not ours to delete"))
            return None
        if marker.mode != "staging":
            report.refused.append((path, f"mode {marker.mode}: never deleted"))
            return None
        if marker.run is None:
            report.refused.append((path, "marker without a run key: written by an older ckpteval or another tool; "
                                         "never deleted"))
            return None
        if self.run is not None and marker.run != self.run:
            report.refused.append((path, f"run {marker.run}: not this run's ({self.run}) to delete"))
            return None
        return marker.step

    def _collect_stale_tmp(self, path: Path, report: GCReport) -> None:
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return
        if age > self.stale_tmp_s and self._inside_root(path):
            self._delete(path, report)

    def _delete(self, path: Path, report: GCReport) -> None:
        if not self._inside_root(path) or path.is_symlink():
            report.refused.append((path, "resolves outside the staging root"))
            return
        size = dir_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            report.deleted.append(path)
            report.freed_bytes += size


@dataclass
class CaptureGC(StagingGC):
    """``RUN/captured/``: the run's captures of ephemeral saves (prime-rl broadcasts, taken by discovery
    before the trainer's cleanup; :mod:`ckpteval.coord.snapshots.discovery`). :meth:`collect` takes the *final* steps —
    every unit has a result that no later evaluation will supersede — and deletes their captures beyond the
    newest ``keep`` (default 0: the trainer keeps its newest broadcast anyway).

    The staging rules hold here too: only direct children of the (resolved) root, each resolving inside it;
    a symlink is never followed or deleted; never a capture under a live lease; a dead process's
    ``.tmp-`` capture once older than ``stale_tmp_s``. A capture has no marker (its record is
    ``RUN/adopted/<step>.json``): a candidate is a dir named ``step_<10 digits>``, anything else is left alone.
    The adoption record stays, so the step is never captured again (its broadcast may still be listed).
    """

    keep: int = 0

    def _step_of(self, path: Path, report: GCReport) -> int | None:
        if (match := CAPTURE_NAME.fullmatch(path.name)) is None:
            report.refused.append((path, "not a capture (step_<10 digits>): not ours to delete"))
            return None
        return int(match.group(1))


CAPTURE_NAME = re.compile(r"step_(\d{10})")  # coord.discovery's RUN/captured/step_<N:010d>


def has_room(path: Path, nbytes: int, margin_fraction: float = 0.05, margin_bytes: int = 64 << 20) -> bool:
    """Whether ``nbytes`` fit on ``path``'s filesystem and still leave a safety margin free.

    A full /dev/shm takes the node down, so export refuses to start without room.
    """
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    total = st.f_blocks * st.f_frsize
    return free - nbytes >= max(margin_bytes, margin_fraction * total)
