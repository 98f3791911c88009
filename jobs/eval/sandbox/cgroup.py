"""Memory cgroups for sandboxed programs: one memory limit for a program and every process it starts.

Guarantee: where :meth:`MemoryCgroup.find` returns a group (cgroup v2 with the memory controller delegated to
this process's cgroup, or v1's memory hierarchy, writable here), :meth:`MemoryCgroup.create` makes a child
limited to ``memory_mb`` MiB (swap included where the node accounts it) that the kernel enforces on all its
processes together, counts the OOM kills in it (:meth:`MemoryCgroup.oom_kills`) and can kill all of them
(:meth:`MemoryCgroup.kill`). Children are named ``ckpteval-<pid>-<n>``; those of dead processes are
removed by the next :meth:`MemoryCgroup.find` on the node.

Limits: None where neither version is usable (then the sandbox states a per-process bound instead). v1 charges
pages to the cgroup that first touched them and does not move them with a process (pages a process touched
before it joined stay charged where they were). The cgroup v2 path is the same code with v2's file names;
it is exercised only on nodes that delegate the memory controller.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
from pathlib import Path


class MemoryCgroup:
    """Memory cgroups, one per program, under a cgroup this process may create children in (v2 with the
    memory controller delegated, or v1's memory hierarchy): the program and every process it starts share
    one memory limit, and the cgroup is how a program whose processes left the process group is killed.
    :meth:`find` returns None where the node allows neither (then memory is bounded per process only)."""

    def __init__(self, version: str, parent: Path) -> None:
        self.version, self.parent = version, parent
        self._n = itertools.count()
        self._stale: list[Path] = []  # children whose last processes were still dying when their run ended
        self._lock = threading.Lock()

    @classmethod
    def find(cls) -> MemoryCgroup | None:
        """This process's own memory cgroup, if it can make a child there and limit it; else None."""
        for version, parent in own_cgroups():
            group = cls(version, parent)
            try:
                probe = group.create(64)
            except OSError:
                continue
            group.remove(probe)
            group.sweep()
            return group
        return None

    def sweep(self) -> None:
        """Remove children left by processes that died before removing them (``ckpteval-<pid>-<n>``)."""
        for child in self.parent.glob("ckpteval-*-*"):
            pid = child.name.split("-")[1]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                self.remove(child, wait_s=0.0)

    def create(self, memory_mb: int) -> Path:
        """A new child limited to ``memory_mb`` MiB (swap included where the node has it)."""
        path = self.parent / f"ckpteval-{os.getpid()}-{next(self._n)}"
        path.mkdir()
        try:
            self.limit(path, memory_mb, raising=False)  # from unlimited
        except OSError:
            path.rmdir()
            raise
        return path

    def limit(self, path: Path, memory_mb: int, raising: bool) -> None:
        """Set the child's limit to ``memory_mb`` MiB (OSError when the kernel refuses, e.g. usage above it).
        v1 keeps memory+swap >= memory: raised, memsw goes first; lowered, memory goes first."""
        limit = str(memory_mb << 20)
        if self.version == "v2":
            (path / "memory.max").write_text(limit)
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
            return
        memsw = path / "memory.memsw.limit_in_bytes"
        order = [path / "memory.limit_in_bytes", *([memsw] if memsw.exists() else [])]
        for file in reversed(order) if raising else order:
            file.write_text(limit)

    def oom_kills(self, path: Path) -> int:
        """Processes of this child the kernel killed for memory."""
        events = path / ("memory.events" if self.version == "v2" else "memory.oom_control")
        try:
            for line in events.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            return 0
        return 0

    def procs(self, path: Path) -> set[int]:
        """The processes in the child (empty when it is gone)."""
        try:
            return {int(pid) for pid in (path / "cgroup.procs").read_text().split()}
        except (OSError, ValueError):
            return set()

    def kill(self, path: Path, spare: int = -1) -> None:
        """SIGKILL every process in the child but ``spare`` (the spawner that lives there)."""
        for pid in self.procs(path) - {spare}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def discard(self, path: Path) -> None:
        """Kill what is left of a finished run's child and remove it, or, while the kernel is still tearing
        it down, keep it for a later call (removing it now would cost every run a wait)."""
        self.kill(path)
        with self._lock:
            pending, self._stale = [*self._stale, path], []
        for p in pending:
            try:
                p.rmdir()
            except FileNotFoundError:
                continue
            except OSError:
                with self._lock:
                    self._stale.append(p)

    def flush(self) -> None:
        """Remove every child kept by :meth:`discard` (waiting for the kernel where needed)."""
        with self._lock:
            pending, self._stale = self._stale, []
        for p in pending:
            self.remove(p)

    def remove(self, path: Path, wait_s: float = 2.0) -> None:
        """Kill what is left and remove the child (the kernel needs a moment after the last process dies)."""
        give_up = time.monotonic() + wait_s
        while True:
            self.kill(path)
            try:
                path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > give_up:
                    return
                time.sleep(0.01)


def own_cgroups() -> list[tuple[str, Path]]:
    """(version, dir) of this process's cgroups that could hold memory-limited children: v2 first."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    where: dict[str, tuple[str, str]] = {}  # version -> (mount point, the hierarchy's path mounted there)
    for m in mounts:
        fields = m.split()
        fstype = fields[fields.index("-") + 1]
        if fstype == "cgroup2":
            where.setdefault("v2", (fields[4], fields[3]))
        elif fstype == "cgroup" and "memory" in fields[-1].split(","):
            where.setdefault("v1", (fields[4], fields[3]))
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        version = "v2" if controllers == "" else "v1" if "memory" in controllers.split(",") else None
        if version is None or version not in where:
            continue
        mount, root = where[version]
        rel = path[len(root):] if path.startswith(root) and root != "/" else path
        own = Path(mount + rel)
        if version == "v1" or "memory" in _read(own / "cgroup.subtree_control").split():
            found.insert(0 if version == "v2" else len(found), (version, own))
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


_CGROUP: list[MemoryCgroup | None] = []
_CGROUP_LOCK = threading.Lock()


def memory_cgroup() -> MemoryCgroup | None:
    """The process's :class:`MemoryCgroup` (probed once), or None."""
    with _CGROUP_LOCK:
        if not _CGROUP:
            _CGROUP.append(MemoryCgroup.find())
        return _CGROUP[0]
