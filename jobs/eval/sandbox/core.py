"""Run an untrusted Python program and report how it ended: the one place ckpteval executes model code.

:class:`Sandbox` returns an :class:`Outcome` (``passed``, ``failed``, ``timeout``, ``oom``, ``crashed``: the
program's own ending) or raises :class:`SandboxUnavailable` when the sandbox itself cannot run (never scored as
0). Isolation (bwrap namespaces, a read-only root, a capped /tmp, rlimits, a per-thread memory cgroup, an outside
deadline) is :mod:`~ckpteval.jobs.eval.sandbox.launch`, :mod:`~ckpteval.jobs.eval.sandbox.cgroup` and
:mod:`~ckpteval.jobs.eval.sandbox.spawn`'s; ``mode="rlimits-only"`` does not isolate. Limits: standard library
only; the CPU limit is per process. See docs/USER_GUIDE.md "Code (sandboxed execution)".
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ckpteval.jobs.eval.sandbox.cgroup import MemoryCgroup, memory_cgroup
from ckpteval.jobs.eval.sandbox.launch import (
    ENV_LABEL,
    INTERPRETER_FLAGS,
    LAUNCHER,
    PROGRAM,
    READY_FD,
    SANDBOX_UID_BASE,
    UIDS_PER_PROCESS,
    Limits,
    interpreter,
    launcher_args,
)
from ckpteval.jobs.eval.sandbox.spawn import SandboxUnavailable, Spawner, Warm, _Run, program_files

__all__ = ["INTERPRETER_FLAGS", "MODES", "STATUSES", "Limits", "MemoryCgroup", "Outcome", "Sandbox",
           "SandboxUnavailable", "interpreter", "labelled_processes", "memory_cgroup", "probe_bwrap",
           "shared_sandbox"]

MODES = ("bwrap", "rlimits-only")
STATUSES = ("passed", "failed", "timeout", "oom", "crashed")


@dataclass(frozen=True)
class Outcome:
    """How one program ended (``status`` in :data:`STATUSES`; see the module docstring)."""

    status: str
    exit_code: int | None  # the program's exit status (None: killed by a signal)
    signal: int | None  # the signal that ended it (None: it exited)
    stdout: bytes
    stderr: bytes
    wall_s: float
    detail: str = ""  # why, in words, when not "passed"/"failed"


def labelled_processes(label: str) -> list[int]:
    """Pids of live processes whose environment carries ``CKPTEVAL_SANDBOX=<label>`` (every process a
    :class:`Sandbox` with that label started, unless the program cleared its own environment)."""
    mark = f"{ENV_LABEL}={label}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(int(pid))
        except OSError:  # gone, or not ours to read
            continue
    return found


def default_concurrency() -> int:
    """Sandboxes run at once by default: min(4, the CPUs this process may use)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def probe_bwrap() -> str | None:
    """None when bwrap can start a sandbox here; else one line saying why not."""
    if shutil.which("bwrap") is None:
        return "bwrap (bubblewrap) is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    box = Sandbox(Limits(wall_s=30.0), concurrency=1, retries=0)
    try:
        outcome = box.run("print('ok')")
    except SandboxUnavailable as e:
        return f"bwrap cannot start a sandbox on this node ({e}); are unprivileged user namespaces disabled?"
    finally:
        box.close()  # its spawner and cgroup
    if outcome.status != "passed" or outcome.stdout.strip() != b"ok":
        return f"bwrap started but a trivial program ended {outcome.status} ({outcome.stderr[-200:]!r})"
    return None


def signal_name(sig: int) -> str:
    """A signal's name for any number (total: the real-time signals have no :class:`signal.Signals` member,
    and a bwrap exit status over 128 that the program chose names no signal at all)."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        if signal.SIGRTMIN <= sig <= signal.SIGRTMAX:
            return f"SIGRTMIN+{sig - signal.SIGRTMIN}"
        return f"signal {sig}"


def _classify(run: _Run, rc: int, wall: float, bwrap: bool, oom_kills: int = 0) -> Outcome:
    """The program's outcome from how its process ended (bwrap reports a signal as 128 + signal)."""
    out, err = bytes(run.out["stdout"]), bytes(run.out["stderr"])
    sig: int | None = None
    code: int | None = rc
    if rc < 0:
        sig, code = -rc, None
    elif bwrap and rc > 128:
        sig, code = rc - 128, None

    def outcome(status: str, detail: str = "") -> Outcome:
        return Outcome(status, code, sig, out, err, wall, detail)

    if run.timed_out:
        return outcome("timeout", f"over the {run.limits.wall_s:g} s deadline")
    if run.overflow:
        return outcome("crashed", run.overflow)
    if oom_kills:
        return outcome("oom", f"over the {run.limits.memory_mb} MiB memory limit of the program and its children")
    if sig == signal.SIGXCPU:
        return outcome("timeout", f"over the {run.limits.cpu_s} s CPU limit")
    if sig == signal.SIGKILL:  # not ours: the CPU hard limit, the kernel's OOM killer, or itself
        return outcome("crashed", "killed by SIGKILL")
    if sig is not None:
        return outcome("crashed", f"killed by {signal_name(sig)}")
    if code == 0:
        return outcome("passed")
    if b"MemoryError" in err[-2048:]:
        return outcome("oom", f"MemoryError under the {run.limits.memory_mb} MiB address-space limit")
    return outcome("failed", f"exit status {code}")


class Sandbox:
    """A bounded pool that runs untrusted programs (see the module docstring for the guarantee)."""

    def __init__(self, limits: Limits | None = None, *, mode: str = "bwrap", concurrency: int | None = None,
                 retries: int = 2, label: str | None = None, cgroup: bool = True) -> None:
        if mode not in MODES:
            raise ValueError(f"sandbox mode {mode!r} must be one of {', '.join(MODES)}")
        self.limits = limits or Limits()
        self.mode = mode
        self.concurrency = concurrency or default_concurrency()
        if self.concurrency < 1:
            raise ValueError(f"sandbox concurrency must be >= 1, got {self.concurrency}")
        self.retries = retries
        self.label = label or f"ckpteval-{os.getpid()}"
        self.as_root = os.geteuid() == 0
        self._runs = itertools.count()  # next() is atomic under the GIL: one uid per program
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="ckpteval-sandbox")
        self.cgroup = memory_cgroup() if cgroup else None
        self._local = threading.local()  # each thread's Spawner
        self._spawners: list[Spawner] = []
        self._lock = threading.Lock()

    def run_many(self, jobs: Sequence[tuple[str, bytes]], limits: Limits | None = None) -> list[Outcome]:
        """Run ``(source, stdin)`` programs in the pool (``limits``: this call's, default the pool's);
        outcomes in order. :class:`SandboxUnavailable` if any could not run after its retries."""
        return list(self._pool.map(lambda job: self.run(job[0], job[1], limits), jobs))

    def run(self, source: str, stdin: bytes = b"", limits: Limits | None = None) -> Outcome:
        """Run one program (blocks until it ends); retries a sandbox that could not start."""
        for attempt in range(self.retries + 1):
            try:
                return self._run_once(source, stdin, limits or self.limits)
            except SandboxUnavailable:
                if attempt == self.retries:
                    raise
                time.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def _run_once(self, source: str, stdin: bytes, limits: Limits) -> Outcome:
        try:
            encoded = source.encode("utf-8")
        except UnicodeEncodeError as e:  # the model's text (a lone surrogate): this program's error only
            return Outcome("crashed", None, None, b"", str(e).encode(), 0.0, "the program is not valid UTF-8")
        spawner = self._spawner(limits)
        tmp = tempfile.mkdtemp(prefix="ckpteval-sandbox-") if self.mode != "bwrap" else ""
        try:
            run = self._start(spawner, tmp, encoded, stdin, limits)
            rc, wall = run.wait()
            oom_kills = spawner.oom_kills()  # the program's own cgroup: fresh for it
            if not run.ready and not run.timed_out:
                why = bytes(run.out["stderr"]).decode(errors="replace").strip().splitlines()
                raise SandboxUnavailable(why[-1] if why else f"the sandbox exited {rc} before the program started")
            if not run.ready:
                raise SandboxUnavailable(f"the sandbox did not start within {limits.wall_s:g} s")
            if self.mode == "bwrap" and rc < 0 and not (run.timed_out or run.overflow or oom_kills):
                # the program's signals come as 128 + n; its init killed by a signal we did not send is the
                # sandbox dying under the program (an operator, the node's OOM killer), not its fault
                raise SandboxUnavailable(f"the sandbox was killed by signal {-rc} while the program ran")
            return _classify(run, rc, wall, self.mode == "bwrap", oom_kills)
        finally:
            spawner.end_program()  # its cgroup goes, with whatever it left charged there
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)

    def _spawner(self, limits: Limits) -> Spawner:
        """This thread's spawner, ready for a program under ``limits`` (a new one when it is not)."""
        spawner: Spawner | None = getattr(self._local, "spawner", None)
        if spawner is not None and not spawner.ready_for(limits.memory_mb):
            self._retire(spawner)
            spawner = None
        if spawner is None:
            warm = Warm(self.label, self.as_root) if self.mode == "bwrap" else None
            spawner = Spawner(self.cgroup, limits.memory_mb, warm)
            self._local.spawner = spawner
            with self._lock:
                self._spawners.append(spawner)
        return spawner

    def _retire(self, spawner: Spawner) -> None:
        self._local.spawner = None
        with self._lock:
            if spawner in self._spawners:
                self._spawners.remove(spawner)
        spawner.close()

    def _start(self, spawner: Spawner, tmp: str, encoded: bytes, stdin: bytes, limits: Limits) -> _Run:
        """Start one program: in the thread's warm runner (bwrap), or as an rlimits-only launcher in ``tmp``."""
        if self.mode == "bwrap":
            uid = self._uid() if self.as_root else -1
            _, stdin_path = program_files(spawner.box, spawner.dir, encoded, stdin)
            message = (launcher_args(limits, uid, READY_FD, PROGRAM), limits.file_mb << 20, limits.tmp_inodes)
            return _Run(spawner, message, stdin_path, limits)
        program, stdin_path = program_files(tmp, tmp, encoded, stdin)
        work = os.path.join(tmp, "work")
        os.mkdir(work, 0o700)
        env = {"PATH": "/usr/bin:/bin", "HOME": work, ENV_LABEL: self.label}
        argv = [interpreter()[0], *INTERPRETER_FLAGS, "-c", LAUNCHER, *launcher_args(limits, -1, READY_FD, program)]
        run = _Run(spawner, (argv, env, work), stdin_path, limits)
        os.unlink(stdin_path)  # held open by the program only: no path to it
        return run

    def bounds(self, limits: Limits | None = None) -> dict[str, object]:
        """The limits a program runs under here, as recorded with its results (how total memory is bounded:
        a cgroup for the program and its children together, else the per-process limit times the processes)."""
        lim = limits or self.limits
        if self.cgroup is not None:
            total, how = lim.memory_mb, f"cgroup-{self.cgroup.version}"
        else:
            total, how = lim.memory_mb * lim.nproc, "rlimit_as x nproc"
        return {"memory_total_mb": total, "memory_total_by": how, "nproc": lim.nproc, "tmp_mb": lim.file_mb,
                "tmp_inodes": lim.tmp_inodes if self.mode == "bwrap" else None}

    def _uid(self) -> int:
        return SANDBOX_UID_BASE + (os.getpid() % 10_000) * UIDS_PER_PROCESS + next(self._runs) % UIDS_PER_PROCESS

    def close(self) -> None:
        """Wait for the running programs, end every spawner and remove their cgroups."""
        self._pool.shutdown(wait=True)
        with self._lock:
            spawners, self._spawners = self._spawners, []
        for spawner in spawners:
            spawner.close()
        if self.cgroup is not None:
            self.cgroup.flush()


_SHARED: dict[tuple[str, int], Sandbox] = {}
_SHARED_LOCK = threading.Lock()


def shared_sandbox(mode: str = "bwrap", concurrency: int | None = None) -> Sandbox:
    """The process's pool for ``mode`` (one per mode and size: every code set of a worker shares it, so
    the node runs at most ``concurrency`` programs at once per worker)."""
    key = (mode, concurrency or default_concurrency())
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = Sandbox(mode=mode, concurrency=key[1])
        return _SHARED[key]
