"""Starting a sandbox's first process inside its memory cgroup, and reading it until it ends or its deadline.

Each pool thread of a :class:`ckpteval.jobs.eval.sandbox.Sandbox` owns a :class:`Spawner`: a small trusted
process (``python -I -S -c SPAWNER``) that lives in the thread's own memory cgroup and forks every sandbox
of that thread there, one at a time. A process *born* in a cgroup costs nothing to place; *moving* one in
(writing ``cgroup.procs``) takes the kernel's cgroup threadgroup lock for writing, which on cgroup v1 waits
for an RCU grace period (~8 ms median here, per program). The spawner is moved once, after its own start-up
(so the pages it touched stay charged where the host's are: v1 and v2 never move charges), and it asks the
OOM killer to spare it (``oom_score_adj`` -1000, root only; its children reset theirs to 0).

Guarantee (:class:`_Run`): the program's stdout and stderr are read as they come and capped; the outside
wall-clock deadline holds whatever the program does with its stdio (the process group is SIGKILLed, and with
a cgroup every process in it but the spawner); the exit status comes from the spawner, which keeps the
child a zombie until the next spawn, so the pid the host kills is never a reused one. Before each program
the thread's cgroup holds the spawner only (else the spawner and its cgroup are replaced), so a program
never shares its memory limit with what is left of the previous one. When the host dies the spawner sees
its socket close and kills its child and everything in its cgroup. A spawner that dies, hangs or answers
out of protocol raises :class:`SandboxUnavailable` (the caller retries with a new one): never the program's
failure.

Limits: the spawner's own memory after it joined (a few pages) counts against the program's limit; without
root the OOM killer may pick the spawner (then the run is :class:`SandboxUnavailable`, and retried). Without
a memory cgroup the spawner still starts the processes (no cgroup, memory bounded per process).
"""

from __future__ import annotations

import array
import json
import marshal
import os
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ckpteval.jobs.eval.sandbox_cgroup import MemoryCgroup
from ckpteval.jobs.eval.sandbox_launch import INTERPRETER_FLAGS, LAUNCH, Limits, bwrap_prefix, interpreter

REPLY_S = 30.0  # how long the host waits for the spawner to start or to answer a spawn

# Runs as the spawner (argv: the socket's fd, the cgroup's cgroup.procs or "", the mode: "exec" or "launch").
# Trusted, and it never reads program data: per program it receives a message and four fds (stdin, stdout,
# stderr, ready). "exec" (rlimits-only): the message is (argv, env, cwd); the process is exec'd in a new
# session. "launch" (the warm runner, PID 1 of bwrap's sandbox): the message is launch()'s arguments; the
# runner forks the program's init into a new PID namespace, which unshares the mount, IPC, UTS, network and
# cgroup namespaces, brings the loopback up and forks the program's process: it breaks out of the loop below
# and runs launch() (LAUNCH, prepended), the program's own set-up, then the program, in this interpreter's copy.
# The init reaps every process of its namespace and exits as bwrap does: the program's status, or 128 + the
# signal that killed it; its exit kills whatever is left in the namespace. Only C modules are imported, so the
# program's interpreter holds no module a fresh `python -I -S` would not load on demand.
SPAWNER = LAUNCH + r"""
import fcntl, marshal, select, _signal, _socket
sock = _socket.socket(fileno=int(sys.argv[1]))
procs, mode = sys.argv[2], sys.argv[3]
def oom_score(value):
    try:
        fd = posix.open("/proc/self/oom_score_adj", posix.O_WRONLY)
        try:
            posix.write(fd, value)
        finally:
            posix.close(fd)
    except OSError:
        pass
oom_score(b"-1000")
if mode == "launch":
    unshare, setns, mount, prctl = (libc_function(f) for f in ("unshare", "setns", "mount", "prctl"))
    own_pid_ns = posix.open("/proc/self/ns/pid", posix.O_RDONLY | posix.O_CLOEXEC)
    prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG SIGKILL: die with bwrap (its --die-with-parent is lost when exec adds caps)
child = -1
def kill_all():
    for kill in (posix.kill, posix.killpg):  # "launch": the program's init, and with it its PID namespace
        try:
            kill(child, 9) if child > 0 else None
        except OSError:
            pass
    try:
        with open(procs) as f:
            pids = [int(p) for p in f.read().split()] if procs else []
    except OSError:
        pids = []
    for p in pids:
        if p != posix.getpid():
            try:
                posix.kill(p, 9)
            except OSError:
                pass
def become(fds):  # in a child: fds as its 0, 1, ...; nothing else open
    sock.detach()
    for i, fd in enumerate(fds):
        posix.dup2(fd, i)
    posix.closerange(len(fds), 1 << 16)
def start_exec(argv, env, cwd, fds):
    pid = posix.fork()
    if pid:
        return pid
    try:
        oom_score(b"0")
        posix.setsid()
        for sig in (13, 25):  # SIGPIPE, SIGXFSZ: ignored by Python, defaults again (as Popen restores them)
            _signal.signal(sig, _signal.SIG_DFL)
        become(fds)
        posix.chdir(cwd)
        posix.execve(argv[0], argv, env)
    except BaseException as e:
        posix.write(2, ("ckpteval spawner: cannot start %s: %s\n" % (argv[0], e)).encode(errors="replace"))
    finally:
        posix._exit(127)
def start_launch(args, tmp_bytes, inodes, fds):
    unshare(0x20000000)  # CLONE_NEWPID: the next child is PID 1 of a namespace of its own
    pid = posix.fork()
    if pid:
        setns(own_pid_ns, 0x20000000)  # and only that child
        return pid
    try:  # the program's init
        oom_score(b"0")
        become(fds)
        _signal.signal(2, _signal.SIG_DFL)  # Python's SIGINT handler would make a KeyboardInterrupt of a signal
        unshare(0x00020000 | 0x08000000 | 0x04000000 | 0x40000000 | 0x02000000)  # NEWNS IPC UTS NET CGROUP
        mount(None, b"/", None, 0x4000 | 0x40000, None)  # MS_REC | MS_PRIVATE: nothing propagates back
        mount(b"proc", b"/proc", b"proc", 14, None)  # this PID namespace's own; MS_NOSUID | MS_NODEV | MS_NOEXEC
        mount(b"tmpfs", b"/tmp", b"tmpfs", 6, b"size=%d,nr_inodes=%d,mode=1777" % (tmp_bytes, inodes))
        posix.chdir("/tmp")
        lo = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
        fcntl.ioctl(lo.fileno(), 0x8914, b"lo".ljust(16, b"\0") + (1).to_bytes(2, sys.byteorder) + bytes(22))
        lo.close()  # SIOCSIFFLAGS IFF_UP: the new network namespace's loopback, as bwrap brings it up
        if int(args[5]) < 0:  # not root: a user namespace of the program's own (kernel keyrings are per user
            ids = posix.getuid(), posix.getgid()  # namespace and uid); it owns none of the namespaces above
            unshare(0x10000000)  # CLONE_NEWUSER
            for name, line in (("setgroups", b"deny"), ("uid_map", b"%d %d 1" % (ids[0], ids[0])),
                               ("gid_map", b"%d %d 1" % (ids[1], ids[1]))):
                fd = posix.open("/proc/self/" + name, posix.O_WRONLY)
                try:
                    posix.write(fd, line)
                finally:
                    posix.close(fd)
        prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no same-uid process may ptrace the init or read its /proc
        program = posix.fork()
    except BaseException as e:
        posix.write(2, ("ckpteval runner: cannot set the program's namespaces up: %s\n" % e).encode(errors="replace"))
        posix._exit(127)
    if program == 0:
        _signal.signal(2, _signal.default_int_handler)
        return 0
    for fd in range(len(fds)):
        posix.close(fd)
    while True:
        try:
            pid, status = posix.wait()
        except OSError:
            posix._exit(127)
        if pid == program:
            code = posix.waitstatus_to_exitcode(status)
            posix._exit(code if code >= 0 else 128 - code)
def wait_child(pidfd):
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    poll.register(pidfd, select.POLLIN)
    while True:
        ready = dict(poll.poll())
        if pidfd in ready:
            info = posix.waitid(posix.P_PID, child, posix.WEXITED | posix.WNOWAIT)
            return info.si_status if info.si_code == posix.CLD_EXITED else -info.si_status
        if sock.fileno() in ready:  # the host sends nothing during a run: it went away
            return None
start = start_launch if mode == "launch" else start_exec
sock.send(b"U")
while True:
    try:
        msg, anc, _, _ = sock.recvmsg(1 << 20, _socket.CMSG_SPACE(4 * 4))
    except OSError:
        msg, anc = b"", []
    data = b"".join(d for level, kind, d in anc if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS)
    fds = [int.from_bytes(data[i:i + 4], sys.byteorder, signed=True) for i in range(0, len(data) - 3, 4)]
    if child > 0:
        posix.waitpid(child, 0)  # the last program: a zombie until now, so its pid stayed the host's to kill
        child = -1
    if not msg:
        kill_all()
        break
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in fds]  # above 0..3, where the child puts them
    for fd in fds:
        posix.close(fd)
    try:
        args = marshal.loads(msg)
        child = start(*args, high)
        reply = b"P%d" % child
    except (OSError, ValueError, EOFError, TypeError) as e:
        reply = ("E%s" % e).encode(errors="replace")
    if child == 0:
        break  # the program's process
    for fd in high:
        posix.close(fd)
    pidfd = posix.pidfd_open(child) if child > 0 else -1
    anc = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, pidfd.to_bytes(4, sys.byteorder))] if pidfd >= 0 else []
    sock.sendmsg([reply], anc)
    if child > 0:
        code = wait_child(pidfd)
        posix.close(pidfd)
        if code is None:
            kill_all()
            posix.waitpid(child, 0)
            break
        sock.send(b"X%d" % code)
if child == 0:
    launch(*(int(a) for a in args[0][:7]), args[0][7], 1)
"""


class SandboxUnavailable(RuntimeError):
    """The sandbox could not run the program (bwrap refused to start, no process could be forked, the
    spawner died): an infrastructure failure, never the program's."""


@dataclass(frozen=True)
class Warm:
    """A bwrap-mode spawner: the warm runner, PID 1 of a bwrap sandbox started once per spawner."""

    label: str
    """The sandbox's label (``CKPTEVAL_SANDBOX`` in every process of it)."""
    as_root: bool
    """Whether the worker runs as root (then no user namespace; each program drops to a fresh uid)."""


class Spawner:
    """One pool thread's spawner process and its memory cgroup (see the module docstring)."""

    def __init__(self, cgroup: MemoryCgroup | None, memory_mb: int, warm: Warm | None = None) -> None:
        self.cgroup, self.memory_mb, self.broken = cgroup, memory_mb, False
        self.warm = warm
        try:
            self.group = cgroup.create(memory_mb) if cgroup is not None else None
        except OSError as e:
            raise SandboxUnavailable(f"cannot create a memory cgroup under {cgroup.parent}: {e}") from None  # type: ignore[union-attr]
        self.dir = tempfile.mkdtemp(prefix="ckpteval-sandbox-")  # the runner's program (box/) and stdin
        self.box = os.path.join(self.dir, "box")
        os.mkdir(self.box)
        os.chmod(self.dir, 0o755)  # the program's uid reads box/main.py
        os.chmod(self.box, 0o755)
        host, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        info_r, info_w = os.pipe()
        self.sock, self.spare = host, -1
        try:
            with open(os.path.join(self.dir, "log"), "wb") as log:  # bwrap's and the spawner's own errors
                self.proc = subprocess.Popen(self._command(far.fileno(), info_w), stdin=subprocess.DEVNULL,
                                             stdout=subprocess.DEVNULL, stderr=log, pass_fds=(far.fileno(), info_w),
                                             start_new_session=True)
        except OSError as e:
            for fd in (info_r, info_w):
                os.close(fd)
            host.close()
            self._drop_dirs()
            raise SandboxUnavailable(f"cannot start the sandbox spawner: {e}") from None
        finally:
            far.close()
        os.close(info_w)
        try:
            if self._reply(REPLY_S) != b"U":
                raise SandboxUnavailable(self._why_not_started())
            self.spare = self._runner_pid(info_r) if warm is not None else self.proc.pid
            if self.group is not None:  # the one migration of this thread: after the spawner's start-up
                (self.group / "cgroup.procs").write_text(str(self.spare))
        except (SandboxUnavailable, OSError, ValueError) as e:
            self.close()
            raise SandboxUnavailable(f"cannot start the sandbox spawner: {e}") from None
        finally:
            os.close(info_r)

    def _why_not_started(self) -> str:
        """The last line the spawner (or bwrap) wrote before it failed to start."""
        try:
            self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            pass
        try:
            lines = Path(self.dir, "log").read_bytes().decode(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        return lines[-1] if lines else "the sandbox spawner did not start"

    def _command(self, sock_fd: int, info_fd: int) -> list[str]:
        """The spawner's command: the warm runner under bwrap, or a plain spawner (rlimits-only)."""
        exe = interpreter()[0]
        if self.warm is None:
            procs = str(self.group / "cgroup.procs") if self.group is not None else ""
            return [exe, *INTERPRETER_FLAGS, "-c", SPAWNER, str(sock_fd), procs, "exec"]
        prefix = bwrap_prefix(self.box, self.warm.label, self.warm.as_root, info_fd)
        return [*prefix, exe, *INTERPRETER_FLAGS, "-c", SPAWNER, str(sock_fd), "", "launch"]

    @staticmethod
    def _runner_pid(info_fd: int) -> int:
        """The runner's pid here, from bwrap's ``--info-fd`` (JSON written before the runner starts)."""
        info = b""
        while chunk := os.read(info_fd, 4096):
            info += chunk
        return int(json.loads(info)["child-pid"])

    def _reply(self, timeout: float) -> bytes:
        """The spawner's next message ("" when it is gone or silent for ``timeout`` seconds: then broken)."""
        return self._reply_fd(timeout)[0]

    def _reply_fd(self, timeout: float) -> tuple[bytes, int]:
        """The spawner's next message and the fd that came with it (-1: none)."""
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        try:
            got = sel.select(timeout)
        finally:
            sel.close()
        fds: list[int] = []
        try:
            msg, fds, _, _ = socket.recv_fds(self.sock, 256, 1) if got else (b"", [], 0, None)
        except OSError:
            msg = b""
        self.broken = self.broken or not msg
        for extra in fds[1:]:
            os.close(extra)
        return msg, (fds[0] if fds else -1)

    def spawn(self, message: tuple[object, ...], fds: list[int]) -> tuple[int, int]:
        """Start a program (``message``: the mode's, see :data:`SPAWNER`) with ``fds`` as its fds 0.. (stdin,
        stdout, stderr, ready): its pid as the spawner sees it, and a pidfd of it."""
        try:
            self.sock.sendmsg([marshal.dumps(message)],
                              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except OSError as e:
            self.broken = True
            raise SandboxUnavailable(f"the sandbox spawner is gone ({e})") from None
        asked = time.monotonic()
        reply, pidfd = self._reply_fd(REPLY_S)
        if reply.startswith(b"P") and reply[1:].isdigit() and pidfd >= 0:
            return int(reply[1:]), pidfd
        if pidfd >= 0:
            os.close(pidfd)
        if reply.startswith(b"E"):
            raise SandboxUnavailable(f"cannot start the program: {reply[1:].decode(errors='replace')}")
        self.broken = True
        if not reply and time.monotonic() - asked < REPLY_S:
            raise SandboxUnavailable("the sandbox spawner died before it started the program")
        raise SandboxUnavailable(f"the sandbox spawner did not answer within {REPLY_S:g} s ({reply[:40]!r})")

    def status(self, timeout: float) -> int | None:
        """The last spawned process's exit status (Popen's convention: -signal when killed), or None."""
        reply = self._reply(timeout) if not self.broken else b""
        if reply.startswith(b"X") and reply[1:].lstrip(b"-").isdigit():
            return int(reply[1:])
        self.broken = True
        return None

    def kill(self, pid: int, pidfd: int) -> None:
        """SIGKILL the program: the warm runner's program init (its PID namespace dies with it), or the
        rlimits-only launcher's process group; and every process in the cgroup but the spawner."""
        try:
            if self.warm is not None:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            else:
                os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.cgroup is not None and self.group is not None:
            self.cgroup.kill(self.group, spare=self.spare)

    def oom_kills(self) -> int:
        return self.cgroup.oom_kills(self.group) if self.cgroup is not None and self.group is not None else 0

    def ready_for(self, memory_mb: int, wait_s: float = 1.0) -> bool:
        """Alive, limited to ``memory_mb`` (set here), and its cgroup holds nothing but itself (waiting for the kernel to
        finish tearing down the last program's processes, at most ``wait_s``)."""
        if self.broken or self.proc.poll() is not None:
            return False
        if self.cgroup is None or self.group is None:
            return True
        if memory_mb != self.memory_mb:  # another call's limits: the same child, its limit changed
            try:
                self.cgroup.limit(self.group, memory_mb, raising=memory_mb > self.memory_mb)
            except OSError:
                return False
            self.memory_mb = memory_mb
        give_up = time.monotonic() + wait_s
        while self.cgroup.procs(self.group) - {self.spare}:
            if time.monotonic() > give_up:
                return False
            self.cgroup.kill(self.group, spare=self.spare)
            time.sleep(0.002)
        return True

    def close(self) -> None:
        """End the spawner (it kills what it started) and hand its cgroup back."""
        self.sock.close()
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._drop_dirs()

    def _drop_dirs(self) -> None:
        if self.cgroup is not None and self.group is not None:
            self.cgroup.discard(self.group)
        shutil.rmtree(self.dir, ignore_errors=True)


class _Run:
    """One program's first process (bwrap, or the rlimits-only launcher) and the reading of its pipes until
    it ends or the deadline passes."""

    def __init__(self, spawner: Spawner, message: tuple[object, ...], stdin_path: str, limits: Limits) -> None:
        self.limits, self.spawner = limits, spawner
        pipes = [os.pipe() for _ in range(3)]  # stdout, stderr, ready
        try:
            with open(stdin_path, "rb") as stdin:
                self.pid, self.pidfd = spawner.spawn(message, [stdin.fileno(), *(w for _, w in pipes)])
        except BaseException:
            for r, _ in pipes:
                os.close(r)
            raise
        finally:
            for _, w in pipes:
                os.close(w)
        self.fds = {pipes[0][0]: "stdout", pipes[1][0]: "stderr", pipes[2][0]: "ready"}
        self.ready = False
        self.out = {"stdout": bytearray(), "stderr": bytearray()}
        self.overflow = ""
        self.timed_out = False
        self.rc: int | None = None

    def wait(self) -> tuple[int, float]:
        """(exit status, wall seconds); raises :class:`SandboxUnavailable` when the spawner fails."""
        start = time.monotonic()
        deadline = start + self.limits.wall_s
        sel = selectors.DefaultSelector()
        for fd, name in self.fds.items():
            sel.register(fd, selectors.EVENT_READ, name)
        sel.register(self.spawner.sock, selectors.EVENT_READ, "exit")
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
            rc = self._reap()
        finally:
            sel.close()
            for fd in (*self.fds, self.pidfd):
                os.close(fd)
        return rc, time.monotonic() - start

    def _reap(self) -> int:
        """The exit status (the loop ends without one only after a kill)."""
        if self.rc is None:  # the deadline or the output cap: killed, its status still comes from the spawner
            self.kill()
            self.rc = self.spawner.status(REPLY_S)
        if self.rc is None:
            raise SandboxUnavailable("the sandbox spawner died or stopped answering while the program ran")
        return self.rc

    def _read(self, sel: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
        if key.data == "exit":
            sel.unregister(key.fileobj)
            self.rc = self.spawner.status(0.0)
            if self.rc is None:
                raise SandboxUnavailable("the sandbox spawner died or broke protocol while the program ran")
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
        """SIGKILL the program's init (its PID namespace, every process of the program, dies with it) or the
        rlimits-only launcher's process group; and whatever is in the cgroup but the spawner."""
        self.spawner.kill(self.pid, self.pidfd)


def program_files(program_dir: str, stdin_dir: str, encoded: bytes, stdin: bytes) -> tuple[str, str]:
    """Write the program (world-readable: the sandbox's uid reads it) into ``program_dir`` and its stdin into
    ``stdin_dir`` (the program's stdin is the open file, never a path it sees)."""
    program, stdin_path = os.path.join(program_dir, "main.py"), os.path.join(stdin_dir, "stdin")
    with open(program, "wb") as f:
        os.fchmod(f.fileno(), 0o644)
        f.write(encoded)
    with open(stdin_path, "wb") as f:
        f.write(stdin)
    return program, stdin_path
