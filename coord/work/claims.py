"""Who holds a work unit: lease files, claims, attempt counts and claim order (the units themselves: :mod:`ckpteval.coord.work.units`).

A unit is claimed through a lease file ``leases/step-<N>/<unit>.lock`` (:func:`ckpteval.coord.run.rundir.unit_dir`): a :class:`ckpteval.coord.work.lease.UnitLease` — one
``O_EXCL`` create to claim, one ``unlink`` to release, the holder record inside, refreshed by one
heartbeat thread per worker. A contender takes a claim over only after observing it *unchanged* for
``lease.duration_s`` on its own monotonic clock (clock skew between nodes cannot expire a live claim), or at
once from a holder on this host whose process is dead. If the holder loses its claim (taken over after a
stall), the :class:`Claim` is marked compromised: the holder must abandon the unit.

Guarantee and its limits: a lease is **a hint about who should be working, not a fence**. A stalled
holder (SIGSTOP, a long GC pause, a partitioned node) can come back after its lease was taken and
still finish. That is harmless by construction: results are published first-writer-wins
(:mod:`ckpteval.coord.results.files`) and readers take the first result per unit, so a rare double evaluation costs
compute, never correctness, and a lost unit is impossible as long as some worker keeps polling.

Every participant of a run must use the run's :class:`~ckpteval.coord.run.manifest.LeaseSettings`
(:class:`~ckpteval.coord.work.lease.LeaseMismatch` otherwise). A :class:`UnitClaimer` keeps one lease object per unit so that
its watch of another holder's claim accumulates across polls — create it once per worker, not per poll.
A claimer looks at a unit another worker holds at most once per ``recheck_s`` (half the heartbeat): a fleet
of hundreds polling the same step costs the metadata server one ``lstat`` per held unit per worker per
``recheck_s``, not one per poll.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ckpteval.coord.atomic import append_and_count_lines
from ckpteval.coord.run.manifest import LeaseSettings
from ckpteval.coord.run.rundir import STEP_DIR_PREFIX, unit_dir
from ckpteval.coord.work.lease import LeaseHolder, LeaseKeeper, UnitLease, parse_holder
from ckpteval.coord.work.workunit import WorkUnit

LEASE_SUFFIX = ".lock"
WATCHERS_PER_UNIT = 4  # workers of a busy fleet that watch one held unit for expiry (UnitClaimer.claim_next)
ATTEMPTS_SUFFIX = ".attempts"


def lease_path(leases_dir: Path, unit_id: str, step: int) -> Path:
    """The lease file of a unit of ``step``: ``leases/step-<N>/<unit id>.lock`` (:func:`ckpteval.coord.run.rundir.unit_dir`)."""
    return unit_dir(leases_dir, step) / f"{unit_id}{LEASE_SUFFIX}"


def attempts_path(leases_dir: Path, unit_id: str, step: int) -> Path:
    """The claim count of a unit: ``<unit id>.attempts`` next to its lease file (:func:`lease_path`), one
    line (the claimer's pid) per claim."""
    return unit_dir(leases_dir, step) / f"{unit_id}{ATTEMPTS_SUFFIX}"


def read_lease_holder(path: Path) -> LeaseHolder | None:
    """The holder record of a lease file (pid, hostname, token, duration: :class:`ckpteval.coord.work.lease.LeaseHolder`).

    The one reader of lease files besides :mod:`ckpteval.coord.work.lease` itself (``ckpteval status``, the
    harness's holder listing, tests). ``FileNotFoundError`` when there is no lease file (nobody holds it); None when the file
    holds no complete record (being written or broken by a contender, or in another format).
    Other ``OSError`` propagates: the caller decides what an unreadable file means.
    """
    return parse_holder(Path(path).read_bytes().decode("utf-8", errors="replace"))


def lease_holders(leases_dir: Path) -> dict[str, LeaseHolder]:
    """unit id -> owner record of every lease file (under ``leases/step-<N>/``) that has one right now (a
    snapshot, racy by nature)."""
    held = {}
    leases_dir = Path(leases_dir)
    for path in leases_dir.glob(f"{STEP_DIR_PREFIX}*/*{LEASE_SUFFIX}"):
        try:
            record = read_lease_holder(path)
        except FileNotFoundError:
            continue  # released between listing and reading
        if record is not None:
            held[path.name[: -len(LEASE_SUFFIX)]] = record
    return held


@dataclass
class Claim:
    """A held lease on one unit. ``compromised`` is set by the heartbeat thread if the claim is lost."""

    unit: WorkUnit
    lease: UnitLease
    token: str
    attempt: int
    compromised: threading.Event = field(default_factory=threading.Event)
    generation: int = 0  # the result generation this claim writes (> 0: re-evaluating an infra skip)

    def still_ours(self) -> bool:
        """Whether the claim is still ours (not lost, its marker still ours; no syscall while fresh)."""
        return not self.compromised.is_set() and self.lease.still_ours()

    def release(self) -> None:
        """Give the unit back (at once: a contender needs no expiry wait). Idempotent."""
        self.lease.release()


class UnitClaimer:
    """Claims units of one run for one worker process."""

    def __init__(self, leases_dir: Path, settings: LeaseSettings, results_dir: Path | None = None) -> None:
        self.leases_dir = Path(leases_dir)
        self.settings = settings
        self.results_dir = Path(results_dir) if results_dir is not None else None
        self.recheck_s = settings.heartbeat_s / 2  # a held marker changes once per heartbeat at most
        self.keeper = LeaseKeeper(settings.heartbeat_s)
        self._leases: dict[str, UnitLease] = {}
        self._flags: dict[str, threading.Event] = {}
        self._pid = os.getpid()  # a claimer is made per worker process, never inherited across fork

    def _lease(self, unit: WorkUnit) -> UnitLease:
        lease = self._leases.get(unit.id)
        if lease is None:
            flag = self._flags.setdefault(unit.id, threading.Event())
            lease = UnitLease(lease_path(self.leases_dir, unit.id, unit.step), self.settings.duration_s,
                              self.keeper, on_compromise=flag.set)
            self._leases[unit.id] = lease
        return lease

    def try_claim(self, unit: WorkUnit, generation: int = 0) -> Claim | None:
        """Claim ``unit`` without waiting; None if someone holds a live lease on it (looked at within the
        last ``recheck_s``: no syscall) or it is done (has a result of ``generation``: 0, or k > 0 to
        re-evaluate an infrastructure skip of generation k - 1).

        The result file is checked *after* the lease is acquired (one stat, with a ``results_dir``): a
        caller's view of finished units is always a little old (the last poll), and without this check a
        unit finished and released just before our claim would be evaluated twice.
        """
        outcome = self._attempt(unit, generation)
        return outcome if isinstance(outcome, Claim) else None

    def _attempt(self, unit: WorkUnit, generation: int) -> Claim | str:
        """:meth:`try_claim`, saying why not: ``"held"`` (by another) or ``"done"`` (the result exists)."""
        if self.seen_held_lately(unit):
            return "held"
        lease = self._lease(unit)
        if not lease.acquire():
            return "held"
        if self._has_result(unit, generation):
            lease.release()
            return "done"
        flag = self._flags[unit.id]
        flag.clear()
        return Claim(unit, lease, lease.token or "", self._count_attempt(unit), flag, generation)

    def claim_next(self, todo: deque[WorkUnit], generations: dict[WorkUnit, int]) -> Claim | None:
        """Claim the first claimable unit of ``todo`` (ordered by the caller; consumed up to the claim).

        Many workers walking the same step would each try every unit the others hold. So after the first
        unit of a step this walk finds held (or done), the walk lists that step's lease directory (or result
        directory) once and passes over the units listed there without a syscall — except the held units
        this worker watches for expiry (about :data:`WATCHERS_PER_UNIT` workers of a fleet each, chosen by
        pid). A walk that claims nothing then looks at every held unit it passed over, so expired claims
        are taken over by idle workers whatever the fleet's size.
        """
        held: dict[int, frozenset[str]] = {}  # step -> unit ids with a lease file, listed in this walk
        done: dict[int, frozenset[str]] = {}  # step -> result names, listed in this walk
        passed: list[WorkUnit] = []
        while todo:
            unit = todo.popleft()
            generation = generations.get(unit, 0)
            if unit.result_name_at(generation) in done.get(unit.step, ()):
                continue
            if unit.id in held.get(unit.step, ()) and not self._watches(unit, len(held[unit.step])):
                passed.append(unit)
                continue
            outcome = self._attempt(unit, generation)
            if isinstance(outcome, Claim):
                return outcome
            if outcome == "held" and unit.step not in held:
                held[unit.step] = self._listed(self.leases_dir, unit.step, LEASE_SUFFIX)
            elif outcome == "done" and unit.step not in done and self.results_dir is not None:
                done[unit.step] = self._listed(self.results_dir, unit.step, "")
        for unit in passed:  # nothing free: watch them all for expiry (each at most once per recheck_s)
            if (claim := self.try_claim(unit, generations.get(unit, 0))) is not None:
                return claim
        return None

    def _watches(self, unit: WorkUnit, n_held: int) -> bool:
        """Whether this worker looks at ``unit`` (held by another) for expiry while it has other work: a
        fixed pick of about WATCHERS_PER_UNIT / n_held of the held units, by pid."""
        return zlib.crc32(f"{self._pid}:{unit.id}".encode()) % max(n_held, 1) < WATCHERS_PER_UNIT

    @staticmethod
    def _listed(root: Path, step: int, suffix: str) -> frozenset[str]:
        """The names in a step's directory under ``root`` (one listing), less ``suffix``."""
        try:
            names = os.listdir(unit_dir(root, step))
        except FileNotFoundError:
            return frozenset()
        return frozenset(n[: len(n) - len(suffix)] for n in names if n.endswith(suffix)) if suffix else frozenset(names)

    def seen_held_lately(self, unit: WorkUnit) -> bool:
        """Whether this claimer found ``unit`` held by another within the last ``recheck_s`` (then
        :meth:`try_claim` answers None without a syscall)."""
        lease = self._leases.get(unit.id)
        return lease is not None and time.monotonic() - lease.watched_at < self.recheck_s

    def _has_result(self, unit: WorkUnit, generation: int = 0) -> bool:
        return self.results_dir is not None and (
            unit_dir(self.results_dir, unit.step) / unit.result_name_at(generation)).exists()

    def claim_first(self, candidates: Iterable[WorkUnit], generations: dict[WorkUnit, int] | None = None) -> Claim | None:
        """The first unit of ``candidates`` (already ordered by the caller) that can be claimed, each at its
        generation in ``generations`` (default 0)."""
        for unit in candidates:
            if (claim := self.try_claim(unit, (generations or {}).get(unit, 0))) is not None:
                return claim
        return None

    def forget(self, unit: WorkUnit) -> None:
        """Drop the cached lease object of a unit that has a result (keeps memory bounded)."""
        lease = self._leases.pop(unit.id, None)
        if lease is not None:
            lease.release()
        self._flags.pop(unit.id, None)

    def _count_attempt(self, unit: WorkUnit) -> int:
        """Attempt number of this claim: one line per claim appended to ``<unit>.attempts`` (one open; not
        fsync'd: a line lost in a node crash only allows one more attempt of the unit)."""
        path = attempts_path(self.leases_dir, unit.id, unit.step)
        return max(1, append_and_count_lines(path, f"{self._pid}\n".encode()))


def order_units(units: Iterable[WorkUnit], newest_first: bool = False, spread: int | None = None) -> list[WorkUnit]:
    """Claim order: oldest unfinished step first by default, newest first on request.

    Within a step, ``spread`` (e.g. the worker's pid) rotates the order of the units per worker, so
    workers polling at once try different units first instead of all contending for the same one.
    """
    units = list(units)

    def within_step(u: WorkUnit) -> int:
        return 0 if spread is None else zlib.crc32(f"{spread}:{u.id}".encode())

    return sorted(units, key=lambda u: (-u.step if newest_first else u.step, within_step(u), u.dataset, u.shard,
                                       u.sample_start, u.replay))
