"""Unit leases: a marker file per claimed unit, refreshed by its holder, taken over once it stops changing.

Owns the lease file's life (``O_EXCL`` create to claim, heartbeat, unlink to release, takeover of an expired
one) and its holder record (:class:`LeaseHolder`, :func:`parse_holder`, :meth:`LeaseHolder.dead_here`).
Guarantee: of two contenders one wins. Limits: a lease is a hint about who should be working, not a fence
(results are first-writer-wins). See docs/PROTOCOL.md §5.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

FORMAT = "ckpteval-lease/1"
FRESH_FRACTION = 0.5  # of duration_s since the last touch: a release/ownership check needs no syscall
BREAK_INFIX = ".break."  # <lease>.break.<pid>.<hex>: a marker moved aside during a takeover (never *.lock)
_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


def _now() -> float:
    """The holder's clock for freshness: runs through suspend (a suspended holder's lease may be taken)."""
    return time.clock_gettime(_BOOTTIME)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What a contender watches: a touch changes mtime/ctime, a new marker changes the inode (or ctime)."""
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns


class LeaseMismatch(ValueError):
    """A lease file holds a claim with another duration than this run's lease settings."""


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace").strip()
    except OSError:
        return ""


def _ns(kind: str) -> str:
    try:
        return str(os.stat(f"/proc/self/ns/{kind}").st_ino)
    except OSError:
        return ""


def host_identity() -> str:
    """Who can judge our pids: hostname, boot id, PID and time namespaces (see the module docstring); ""
    when the PID namespace cannot be read (then nobody can prove a holder dead: expiry only)."""
    pid_ns = _ns("pid")
    return pid_ns and "|".join((socket.gethostname(), _read("/proc/sys/kernel/random/boot_id"), pid_ns, _ns("time")))


def process_start(pid: int) -> int | None:
    """``pid``'s start time in clock ticks since boot (Linux), None where unknown."""
    stat = _read(f"/proc/{pid}/stat")
    fields = stat[stat.rfind(")") + 1:].split()
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: alive, another user's
        pass
    return False


@dataclass(frozen=True)
class LeaseHolder:
    """The record in a lease file: who holds it, the claim's token and the lease duration."""

    pid: int
    hostname: str
    host_id: str  # host_identity() of the holder
    token: str
    duration_s: float
    start: int | None  # process_start(pid) when it claimed

    def encode(self) -> bytes:
        return (json.dumps({"format": FORMAT, **asdict(self)}, separators=(",", ":")) + "\n").encode()

    def dead_here(self) -> bool:
        """The holder ran on this host and its process is gone (or its pid now names another process)."""
        if not self.host_id or self.host_id != _Me.host_id() or self.pid <= 0:
            return False
        if _pid_gone(self.pid):
            return True
        now = process_start(self.pid)
        return self.start is not None and now is not None and now != self.start


_TYPES = {"pid": (int,), "hostname": (str,), "host_id": (str,), "token": (str,), "duration_s": (int, float),
          "start": (int, type(None))}


def parse_holder(text: str) -> LeaseHolder | None:
    """The record of a lease file's text; None when it is not a complete record of this format (being
    written, torn, or another format: it then counts as held and expires)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT or any(
            type(obj.get(k)) not in kinds for k, kinds in _TYPES.items()) or not math.isfinite(obj["duration_s"]):
        return None
    return LeaseHolder(**{k: obj[k] for k in _TYPES})


class _Me:
    """This process's identity, read once per process (a lease is never inherited across fork)."""

    _cached: tuple[int, str, str, int | None] | None = None

    @classmethod
    def fields(cls) -> tuple[int, str, str, int | None]:
        if cls._cached is None or cls._cached[0] != os.getpid():
            pid = os.getpid()
            cls._cached = (pid, socket.gethostname(), host_identity(), process_start(pid))
        return cls._cached

    @classmethod
    def host_id(cls) -> str:
        return cls.fields()[2]


class UnitLease:
    """The lease on one marker file. Not thread-safe for acquire/release (one worker thread claims); the
    :class:`LeaseKeeper` thread only refreshes and reports."""

    def __init__(self, path: Path, duration_s: float, keeper: LeaseKeeper,
                 on_compromise: Callable[[], None] | None = None) -> None:
        self.path = Path(path)
        self.duration_s = duration_s
        self.keeper = keeper
        self.on_compromise = on_compromise
        self.token: str | None = None
        self.compromised = False
        self._fd: int | None = None
        self._ino: tuple[int, int] | None = None
        self._touched = 0.0  # _now() just before the last create/touch that succeeded
        self._misses = 0
        self._seen: tuple[tuple[int, int, int, int], float] | None = None  # a contender's watch: identity, since
        self._record: tuple[tuple[int, int], LeaseHolder | None] | None = None  # the watched marker's
        self.watched_at = -float("inf")  # time.monotonic() of the last look at another holder's marker

    # -- claiming --------------------------------------------------------------------------------------
    def acquire(self) -> bool:
        """Claim without waiting: True if this process now holds the lease. A held marker is watched (this
        object remembers it across calls) and taken over once expired or its holder dead on this host."""
        if self._fd is not None:
            return True
        if self._create():
            return True
        return self._take_over_if_expired() and self._create()

    def _create(self) -> bool:
        token = secrets.token_hex(16)
        pid, hostname, host_id, start = _Me.fields()
        record = LeaseHolder(pid, hostname, host_id, token, self.duration_s, start).encode()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        touched = _now()
        try:
            fd = os.open(self.path, flags, 0o644)
        except FileExistsError:
            return False
        except FileNotFoundError:  # the step's lease directory does not exist yet: one mkdir per step
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.path, flags, 0o644)
            except FileExistsError:
                return False
        try:
            os.write(fd, record)  # one write of < 300 bytes; a reader that sees it empty treats it as held
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            self._unlink_quietly()
            raise
        self._fd, self._ino, self.token, self._touched = fd, (st.st_dev, st.st_ino), token, touched
        self.compromised, self._misses, self._seen = False, 0, None
        self.keeper.add(self)
        return True

    def _take_over_if_expired(self) -> bool:
        """Watch the marker; move it aside when it expired (True: the path is free now, or was found free)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return True  # released since our create failed
        key, now = _identity(st), time.monotonic()
        self.watched_at = now
        if self._seen is None or self._seen[0] != key:
            self._seen = (key, now)
            if not self._holder_dead_here(st):
                return False
        elif now - self._seen[1] < self.duration_s and not self._holder_dead_here(st):
            return False
        return self._move_aside(key)

    def _holder_dead_here(self, st: os.stat_result) -> bool:
        """Whether the marker's holder is a dead process of this host (take over at once). The record is
        read once per marker (inode); liveness is asked each time. Raises :class:`LeaseMismatch` for a
        holder with another lease duration."""
        inode = (st.st_dev, st.st_ino)
        if self._record is None or self._record[0] != inode or self._record[1] is None:
            try:
                self._record = (inode, parse_holder(self.path.read_bytes().decode("utf-8", errors="replace")))
            except OSError:
                return False
        record = self._record[1]
        if record is None:
            return False  # being written, or torn: it expires like any marker
        if record.duration_s != self.duration_s:
            raise LeaseMismatch(
                f"{self.path} holds a lease of {record.duration_s!r}s but this run's lease is "
                f"{self.duration_s!r}s: every participant of a run must use run.json's lease settings")
        return record.dead_here()

    def _move_aside(self, watched: tuple[int, int, int, int]) -> bool:
        aside = self.path.with_name(f"{self.path.name}{BREAK_INFIX}{os.getpid()}.{secrets.token_hex(4)}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return True
        try:
            if _identity(os.lstat(aside))[:3] != watched[:3]:  # renewed or replaced since watched: not ours to take
                # (the rename itself changed its ctime, so inode + mtime tell whether it is the watched marker)
                try:
                    os.link(aside, self.path)
                except FileExistsError:
                    pass  # a third process claimed the free path meanwhile; the moved holder learns it lost
                return False
            return True
        finally:
            os.unlink(aside)
            self._seen = None

    # -- holding ---------------------------------------------------------------------------------------
    def fresh(self) -> bool:
        """Held, not reported lost, and touched within ``duration_s / 2``: nobody can have taken it over."""
        return self._fd is not None and not self.compromised and (
            _now() - self._touched < self.duration_s * FRESH_FRACTION)

    def still_ours(self) -> bool:
        """Whether the marker at the path is still this claim's (no syscall while :meth:`fresh`). A marker
        that cannot be looked at (an I/O error) counts as ours: the heartbeat reports real losses."""
        if self._fd is None or self.compromised:
            return False
        return self.fresh() or self._marker_is_ours() is not False

    def _marker_is_ours(self) -> bool | None:
        """True: the path names our marker; False: missing or another; None: unknown (an I/O error)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return False
        except OSError:
            return None
        return (st.st_dev, st.st_ino) == self._ino and os.fstat(self._fd or 0).st_nlink > 0

    def refresh(self) -> None:
        """One heartbeat (the keeper's thread): touch the marker if it is still ours; report a loss seen twice.
        An I/O error is transient (no touch: a marker that stays unrefreshed expires)."""
        fd = self._fd
        if fd is None or self.compromised:
            return
        ours = self._marker_is_ours()
        if ours is None:
            return
        if ours:
            touched = _now()
            try:
                os.utime(fd)
            except OSError:
                return
            self._touched, self._misses = touched, 0
            return
        self._misses += 1
        if self._misses >= 2:
            self.compromised = True
            if self.on_compromise is not None:
                self.on_compromise()

    def release(self) -> None:
        """Give the unit back at once (a contender needs no expiry wait). Idempotent. A lost lease, or one
        whose marker cannot be looked at, only closes its descriptor (the marker is someone else's, or
        expires)."""
        fd = self._fd
        if fd is None:
            return
        self.keeper.discard(self)
        try:
            if not self.compromised and (self.fresh() or self._marker_is_ours()):
                self._unlink_quietly()
        finally:
            self._fd, self.token = None, None
            os.close(fd)

    def _unlink_quietly(self) -> None:
        """Unlink the marker; one that cannot be unlinked (gone already, an I/O error) simply expires."""
        try:
            os.unlink(self.path)
        except OSError:
            pass


class LeaseKeeper:
    """One heartbeat thread for every lease a process holds: every ``heartbeat_s`` it refreshes each one
    (:meth:`UnitLease.refresh`). Started on the first lease, a daemon thread."""

    def __init__(self, heartbeat_s: float) -> None:
        self.heartbeat_s = heartbeat_s
        self._held: set[UnitLease] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, lease: UnitLease) -> None:
        with self._lock:
            self._held.add(lease)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ckpteval-lease-heartbeat", daemon=True)
                self._thread.start()

    def discard(self, lease: UnitLease) -> None:
        """Stop refreshing ``lease``; on return no refresh of it is running (its descriptor may be closed)."""
        with self._lock:
            self._held.discard(lease)

    def _run(self) -> None:
        while True:
            time.sleep(self.heartbeat_s)
            with self._lock:  # a release waits for the refresh of its lease (never a touch of a closed fd)
                for lease in list(self._held):
                    lease.refresh()
