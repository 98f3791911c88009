"""Run an untrusted Python program and report how it ended: the one place ckpteval executes model code.

:class:`Sandbox` runs a program's source (with optional stdin bytes) and returns an :class:`Outcome`
whose ``status`` is the program's own ending: ``passed`` (exit 0), ``failed`` (a non-zero exit),
``timeout`` (the wall-clock deadline or the CPU limit's SIGXCPU), ``oom`` (``MemoryError`` under the
address-space limit, or a kill by the program's memory cgroup) or ``crashed`` (killed by any other
signal, stdout/stderr over the output cap, or a source that is not valid UTF-8). Those are the model's failures. When the sandbox itself cannot start (bwrap
refused, no process could be forked) or bwrap is killed by a signal it was not sent by this module, it is
retried, then :class:`SandboxUnavailable` is raised: an infrastructure failure the caller must never
score as 0.

Isolation (``mode="bwrap"``, the default): each program runs under bubblewrap (``bwrap``) with

- new PID, network, IPC and UTS namespaces (``--unshare-all`` when not root; as root the same list
  without the user namespace, so that the launcher can drop to an unprivileged uid, see below), no
  network at all (an empty network namespace), ``--die-with-parent`` and ``--new-session``;
- a root made of read-only binds of only what the interpreter needs: ``/usr`` (and the ``/bin``,
  ``/lib*`` links or dirs), the interpreter's own prefix (``sys.base_prefix``; e.g. a pyenv build
  under ``/root``, whose parent dirs are created empty), ``/etc/ld.so.cache``; a fresh ``/proc`` of the
  PID namespace and a minimal ``/dev`` (null, zero, full, random, urandom, the fd links); the program at
  ``/sandbox/main.py``; the root remounted read-only (in a user namespace it is the program's own);
- a private writable tmpfs ``/tmp`` capped in bytes (``file_mb``) and in inodes (``tmp_inodes``),
  mounted by the launcher (``CAP_SYS_ADMIN``, given up before the program runs) as the working directory. Nothing else of the host
  is visible: no run dir, results, leases, home directory or environment (``--clearenv``).

Inside, a trusted launcher (``python -I -S -c LAUNCHER``) mounts that /tmp, sets the rlimits (CPU seconds, address space,
file size, process count, open files), drops to a fresh unprivileged uid per program when it runs as
root (RLIMIT_NPROC is never enforced for uid 0, and counts per uid: a fork bomb still being torn down
must not count against the next program), tells the host it is up (one byte on an
inherited pipe), closes that pipe and runs the program in its own interpreter. A wall-clock deadline is
enforced from outside: the host SIGKILLs bwrap, whose PID namespace dies with it (every process the
program forked, daemonized or ``setsid``-ed included), whatever the program did with its stdout/stderr.
stdout and stderr are read as they come and capped (``output_bytes``): a program that writes more is
killed, never buffered whole. Memory: where :class:`MemoryCgroup` finds a cgroup this process may
create children in (v2 with the memory controller delegated, or v1's memory hierarchy), each program
runs in its own child limited to ``memory_mb`` for the program and all its processes together; else
the bound is ``memory_mb`` × ``nproc``. :meth:`Sandbox.bounds` states which holds (recorded with results).

``mode="rlimits-only"`` (the worker's ``--unsafe-code-rlimits-only`` opt-in, for nodes that cannot
start bwrap) runs the same launcher as a plain subprocess in a new session, in a private temp dir, with
an empty environment and the same rlimits and deadline (the process group is killed, and the memory
cgroup's processes where there is one). It does NOT isolate: the program can read and write whatever the
worker's user can and open network connections; without a cgroup a process that leaves the process
group outlives the deadline; /tmp's inodes are not capped; RLIMIT_NPROC is not enforced for root.
Results record the mode (the code scorer's identity), so such points are never pooled with sandboxed ones.

Limits: programs are Python source run by the worker's own base interpreter with its standard library
only (``-I -S``: no site-packages, neither the base installation's nor the worker's virtualenv); the CPU
limit is per process (a program that forks many CPU-bound children is stopped by the wall clock, not the
CPU limit); without a cgroup, memory is bounded per process (address space) only; concurrent sandboxes
run in a bounded pool (:attr:`Sandbox.concurrency`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

MODES = ("bwrap", "rlimits-only")
STATUSES = ("passed", "failed", "timeout", "oom", "crashed")
# root only: every program runs as a fresh unprivileged uid (RLIMIT_NPROC counts per uid, so a fork bomb's
# processes, still being torn down, never count against the next program): base + 65536 * (pid % 10000) + n
SANDBOX_UID_BASE = 200_000
UIDS_PER_PROCESS = 65_536
ENV_LABEL = "CKPTEVAL_SANDBOX"  # set in every sandboxed process's environment: who started it
PROGRAM = "/sandbox/main.py"
# -I: no environment, no user site, no script dir on sys.path; -S: no site-packages (and none of their
# .pth start-up hooks): programs get the standard library only, and start faster.
INTERPRETER_FLAGS = ("-I", "-S")

# Runs inside the sandbox (argv: cpu_s memory_bytes file_bytes nproc nofile uid ready_fd tmp_bytes tmp_inodes
# cgroup program). Trusted code: mount the private /tmp with an inode cap (bwrap only), set the limits, drop root (or,
# in a user namespace, the one capability kept for the mount), report "up" on ready_fd, then run the program
# as __main__ in this interpreter (compiled as UTF-8; no runpy: its imports cost more than bwrap does).
LAUNCHER = r"""
import posix, resource, sys  # posix, not os: os's import costs more than bwrap
cpu, mem, fsize, nproc, nofile, uid, ready, tmp_bytes, inodes, cgroup = (int(a) for a in sys.argv[1:11])
program = sys.argv[11]
if cgroup >= 0:  # join the program's memory cgroup first (fd: its cgroup.procs, opened by the host)
    posix.write(cgroup, b"0"); posix.close(cgroup)
if inodes > 0:  # _ctypes, not ctypes: ctypes's import costs a third of an interpreter's start-up
    import _ctypes
    class Int(_ctypes._SimpleCData):
        _type_ = "i"
    class Func(_ctypes.CFuncPtr):
        _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
        _restype_ = Int
    class Libc:
        _handle = _ctypes.dlopen(None, 0)
    opts = b"size=%d,nr_inodes=%d,mode=1777" % (tmp_bytes, inodes)
    if Func(("mount", Libc))(b"tmpfs", b"/tmp", b"tmpfs", 6, opts) != 0:  # MS_NOSUID | MS_NODEV
        sys.exit("ckpteval launcher: cannot mount the private /tmp (errno %d)" % _ctypes.get_errno())
    posix.chdir("/tmp")
    if uid < 0:  # in a user namespace: give up CAP_SYS_ADMIN (kept by bwrap for the mount)
        Func(("prctl", Libc))(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
        class Header(_ctypes.Array):
            _type_, _length_ = Int, 2
        class Data(_ctypes.Array):
            _type_, _length_ = Int, 6
        if Func(("capset", Libc))(Header(0x20080522, 0), Data()) != 0:  # _LINUX_CAPABILITY_VERSION_3, all 0
            sys.exit("ckpteval launcher: cannot drop capabilities (errno %d)" % _ctypes.get_errno())
for res, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem, mem),
                        (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_NOFILE, nofile, nofile),
                        (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(res, (soft, hard))
if uid >= 0 and posix.getuid() == 0:
    posix.setgroups([]); posix.setgid(uid); posix.setuid(uid)
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
if inodes > 0:  # bwrap: the program must hold no capability
    with open("/proc/self/status") as status:
        caps = [line.split()[1] for line in status if line.startswith(("CapEff:", "CapPrm:"))]
    if any(int(c, 16) for c in caps):
        sys.exit("ckpteval launcher: the program would keep capabilities %s" % caps)
posix.write(ready, b"R"); posix.close(ready)
sys.argv = [program]
sys.path.insert(0, program.rpartition("/")[0])
def run(path, g):
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    b = g["__builtins__"]
    g.clear()  # the program's globals: __main__'s, emptied of the launcher's names
    g.update(__name__="__main__", __file__=path, __builtins__=b)
    exec(code, g)
run(program, sys.modules["__main__"].__dict__)
"""


class SandboxUnavailable(RuntimeError):
    """The sandbox could not run the program (bwrap refused to start, no process could be forked): an
    infrastructure failure, never the program's."""


@dataclass(frozen=True)
class Limits:
    """What one program may use."""

    wall_s: float = 10.0
    """Wall-clock deadline, enforced from outside (the whole sandbox is killed)."""
    cpu_s: int = 10
    """RLIMIT_CPU per process (SIGXCPU, then SIGKILL a second later)."""
    memory_mb: int = 1024
    """RLIMIT_AS per process, MiB (Python raises MemoryError)."""
    file_mb: int = 16
    """RLIMIT_FSIZE (largest file) and the size of the private /tmp, MiB."""
    nproc: int = 32
    """RLIMIT_NPROC: processes (and threads) of the sandbox's uid (not enforced for root, see module doc)."""
    nofile: int = 64
    """RLIMIT_NOFILE: open file descriptors."""
    tmp_inodes: int = 4096
    """Files, dirs and links the private /tmp may hold (tmpfs ``nr_inodes``; bwrap mode only)."""
    output_bytes: int = 1 << 20
    """stdout and stderr are each kept up to this many bytes; more kills the program (``crashed``)."""

    def __post_init__(self) -> None:
        if not (self.wall_s > 0 and self.wall_s < float("inf")):
            raise ValueError(f"sandbox wall_s must be a positive number of seconds, got {self.wall_s}")
        for key in ("cpu_s", "memory_mb", "file_mb", "nproc", "nofile", "tmp_inodes", "output_bytes"):
            if getattr(self, key) < 1:
                raise ValueError(f"sandbox {key} must be >= 1, got {getattr(self, key)}")


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


@functools.cache
def interpreter() -> tuple[str, str]:
    """The base interpreter (not a venv's wrapper) and its installation prefix."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


@functools.cache
def _root_binds(prefix: str) -> tuple[str, ...]:
    """bwrap arguments for the read-only root: /usr, the top-level links/dirs into it, the prefix."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if os.path.exists("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    if not (prefix + "/").startswith(("/usr/", "/bin/", "/lib")):
        parts = Path(prefix).parts[1:]
        for i in range(1, len(parts)):  # parents created world-traversable (e.g. /root is 0700)
            args += ["--perms", "0755", "--dir", "/" + "/".join(parts[:i])]
        args += ["--ro-bind", prefix, prefix]
    return tuple(args)


@functools.cache
def _dev() -> tuple[str, ...]:
    """A minimal read-only /dev: the harmless character devices and the fd links (not bwrap's --dev, whose
    devpts mount makes a later tmpfs mount fail in a user namespace, and whose /dev/shm is writable there)."""
    args = ["--perms", "0755", "--dir", "/dev"]
    for dev in ("null", "zero", "full", "random", "urandom"):
        args += ["--dev-bind", f"/dev/{dev}", f"/dev/{dev}"]
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        args += ["--symlink", f"/proc/self/fd/{i}", f"/dev/{name}"]
    return (*args, "--symlink", "/proc/self/fd", "/dev/fd")


def bwrap_command(program_file: str, label: str, as_root: bool) -> list[str]:
    """The full bwrap command line that runs ``program_file`` (a host path) under the launcher (the parts that
    depend on the node only are computed once per process)."""
    exe, prefix = interpreter()
    # root: no user namespace (uid 0 in one is still uid 0 to RLIMIT_NPROC; the launcher drops to a
    # real unprivileged uid instead); others: --unshare-all, whose user namespace they need.
    unshare = (["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
               if as_root else ["--unshare-all", "--cap-add", "CAP_SYS_ADMIN"])  # the launcher drops it
    return [
        "bwrap", *unshare, "--die-with-parent", "--new-session",
        *_root_binds(prefix),
        "--proc", "/proc", *_dev(),
        "--dir", "/tmp",  # a mount point only: the launcher mounts the capped tmpfs there (a bwrap --tmpfs: 0.8 ms)
        "--perms", "0755", "--dir", "/sandbox", "--ro-bind", program_file, PROGRAM,
        "--remount-ro", "/",  # in a user namespace the root tmpfs is the program's to write, uncapped
        "--chdir", "/tmp", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
        "--setenv", "HOME", "/tmp", "--setenv", ENV_LABEL, label,
        exe, *INTERPRETER_FLAGS, "-c", LAUNCHER,
    ]


def launcher_args(limits: Limits, uid: int, ready_fd: int, program: str, bwrap: bool, cgroup_fd: int = -1) -> list[str]:
    """The launcher's argv (see :data:`LAUNCHER`); the inode-capped /tmp is mounted under bwrap only; with
    ``cgroup_fd`` >= 0 the launcher joins the cgroup whose ``cgroup.procs`` is open on that fd."""
    inodes = limits.tmp_inodes if bwrap else 0
    return [str(limits.cpu_s), str(limits.memory_mb << 20), str(limits.file_mb << 20), str(limits.nproc),
            str(limits.nofile), str(uid), str(ready_fd), str(limits.file_mb << 20), str(inodes),
            str(cgroup_fd), program]


def probe_bwrap() -> str | None:
    """None when bwrap can start a sandbox here; else one line saying why not."""
    if shutil.which("bwrap") is None:
        return "bwrap (bubblewrap) is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    try:
        outcome = Sandbox(Limits(wall_s=30.0), concurrency=1, retries=0).run("print('ok')")
    except SandboxUnavailable as e:
        return f"bwrap cannot start a sandbox on this node ({e}); are unprivileged user namespaces disabled?"
    if outcome.status != "passed" or outcome.stdout.strip() != b"ok":
        return f"bwrap started but a trivial program ended {outcome.status} ({outcome.stderr[-200:]!r})"
    return None


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
        for version, parent in _own_cgroups():
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
            limit = str(memory_mb << 20)
            files = (("memory.max", "memory.swap.max") if self.version == "v2"
                     else ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"))
            (path / files[0]).write_text(limit)
            if (path / files[1]).exists():
                (path / files[1]).write_text("0" if self.version == "v2" else limit)
        except OSError:
            path.rmdir()
            raise
        return path

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

    def kill(self, path: Path) -> None:
        """SIGKILL every process in the child."""
        try:
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        except OSError:
            return

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


def _own_cgroups() -> list[tuple[str, Path]]:
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


class _Run:
    """One program's process and the reading of its pipes until it ends or the deadline passes."""

    def __init__(self, cmd: list[str], limits: Limits, workdir: str, env: dict[str, str] | None,
                 stdin_path: str, ready_w: int, ready_r: int, cgroup: tuple[MemoryCgroup, Path] | None,
                 procs: int = -1) -> None:
        self.limits = limits
        self.cgroup = cgroup
        try:
            with open(stdin_path, "rb") as stdin:
                self.proc = subprocess.Popen(
                    cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env=env,
                    pass_fds=(ready_w,) if procs < 0 else (ready_w, procs), start_new_session=True, close_fds=True,
                )
        except OSError as e:
            os.close(ready_r)
            raise SandboxUnavailable(f"cannot start {cmd[0]}: {e}") from None
        finally:
            os.close(ready_w)
            if procs >= 0:
                os.close(procs)
        self.ready_fd = ready_r
        self.exit_fd = _pidfd(self.proc.pid)
        self.ready = False
        self.out = {"stdout": bytearray(), "stderr": bytearray()}
        self.overflow = ""
        self.timed_out = False

    def wait(self) -> tuple[int, float]:
        start = time.monotonic()
        deadline = start + self.limits.wall_s
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ, "stdout")  # type: ignore[arg-type]
        sel.register(self.proc.stderr, selectors.EVENT_READ, "stderr")  # type: ignore[arg-type]
        sel.register(self.ready_fd, selectors.EVENT_READ, "ready")
        if self.exit_fd >= 0:  # readable once the process has exited: no polling wait() after the pipes close
            sel.register(self.exit_fd, selectors.EVENT_READ, "exit")
        try:
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    self.timed_out = True
                    self.kill()
                    break
                for key, _ in sel.select(timeout=min(left, 0.5)):
                    self._read(sel, key)
                if self.overflow:
                    self.kill()
                    break
            rc = self._reap(deadline)
        finally:
            sel.close()
            os.close(self.ready_fd)
            if self.exit_fd >= 0:
                os.close(self.exit_fd)
            for pipe in (self.proc.stdout, self.proc.stderr):
                pipe.close()  # type: ignore[union-attr]
        return rc, time.monotonic() - start

    def _reap(self, deadline: float) -> int:
        """The exit status, within the deadline even when the program closed its pipes and lives on."""
        try:
            return self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.kill()
            return self.proc.wait()

    def _read(self, sel: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
        if key.data == "exit":
            sel.unregister(key.fileobj)
            return
        data = os.read(key.fd, 1 << 16)
        if not data:
            sel.unregister(key.fileobj)
            return
        if key.data == "ready":
            self.ready = self.ready or data.startswith(b"R")
            return
        buf = self.out[key.data]
        buf += data[: self.limits.output_bytes + 1 - len(buf)]
        if len(buf) > self.limits.output_bytes:
            del buf[self.limits.output_bytes:]
            self.overflow = f"{key.data} over {self.limits.output_bytes} bytes"

    def kill(self) -> None:
        """SIGKILL the process group of bwrap (or of the rlimits-only launcher): bwrap's PID namespace,
        and with it every process of the program, dies with it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.cgroup is not None:  # and whatever left the group (rlimits-only mode)
            self.cgroup[0].kill(self.cgroup[1])


def _pidfd(pid: int) -> int:
    """A pidfd of ``pid`` (readable when it exits), or -1 where the kernel or Python has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return -1


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
        return outcome("crashed", f"killed by {signal.Signals(sig).name}" if sig in signal.valid_signals() else f"signal {sig}")
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
        tmp = tempfile.mkdtemp(prefix="ckpteval-sandbox-")
        group = self.cgroup.create(limits.memory_mb) if self.cgroup is not None else None
        try:
            program, stdin_path = os.path.join(tmp, "main.py"), os.path.join(tmp, "stdin")
            Path(program).write_bytes(encoded)
            os.chmod(program, 0o644)
            Path(stdin_path).write_bytes(stdin)
            run = self._start(program, stdin_path, tmp, limits, group)
            os.unlink(stdin_path)  # held open by the program only: no path to it (rlimits-only mode)
            rc, wall = run.wait()
            oom_kills = self.cgroup.oom_kills(group) if self.cgroup is not None and group is not None else 0
            if not run.ready and not run.timed_out:
                why = bytes(run.out["stderr"]).decode(errors="replace").strip().splitlines()
                raise SandboxUnavailable(why[-1] if why else f"the sandbox exited {rc} before the program started")
            if not run.ready:
                raise SandboxUnavailable(f"the sandbox did not start within {limits.wall_s:g} s")
            if self.mode == "bwrap" and rc < 0 and not (run.timed_out or run.overflow or oom_kills):
                # bwrap reports the program's signals as 128 + n; bwrap itself killed by a signal we did not
                # send is the sandbox dying under the program (an operator, the node's OOM killer), not its fault
                raise SandboxUnavailable(f"bwrap was killed by signal {-rc} while the program ran")
            return _classify(run, rc, wall, self.mode == "bwrap", oom_kills)
        finally:
            if self.cgroup is not None and group is not None:
                self.cgroup.discard(group)
            shutil.rmtree(tmp, ignore_errors=True)

    def _start(self, program: str, stdin_path: str, tmp: str, limits: Limits, group: Path | None) -> _Run:
        uid = self._uid() if self.as_root else -1
        ready_r, ready_w = os.pipe()
        cgroup = (self.cgroup, group) if self.cgroup is not None and group is not None else None
        procs = os.open(group / "cgroup.procs", os.O_WRONLY) if cgroup is not None and group is not None else -1
        if self.mode == "bwrap":
            cmd = bwrap_command(program, self.label, self.as_root)
            cmd += launcher_args(limits, uid, ready_w, PROGRAM, bwrap=True, cgroup_fd=procs)
            return _Run(cmd, limits, tmp, None, stdin_path, ready_w, ready_r, cgroup, procs)
        work = os.path.join(tmp, "work")
        os.mkdir(work, 0o700)
        env = {"PATH": "/usr/bin:/bin", "HOME": work, ENV_LABEL: self.label}
        cmd = [interpreter()[0], *INTERPRETER_FLAGS, "-c", LAUNCHER,
               *launcher_args(limits, -1, ready_w, program, bwrap=False, cgroup_fd=procs)]
        return _Run(cmd, limits, work, env, stdin_path, ready_w, ready_r, cgroup, procs)

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
        self._pool.shutdown(wait=True)
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
