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
import marshal
import os
import selectors
import signal
import socket
import subprocess
import time
from pathlib import Path

from ckpteval.jobs.eval.sandbox_cgroup import MemoryCgroup
from ckpteval.jobs.eval.sandbox_launch import INTERPRETER_FLAGS, Limits, interpreter

REPLY_S = 30.0  # how long the host waits for the spawner to start or to answer a spawn

# Runs as the spawner (argv: the socket's fd, the cgroup's cgroup.procs or ""). Trusted, and it never reads
# program data: it receives (argv, env, cwd) and four fds (stdin, stdout, stderr, ready) per sandbox.
SPAWNER = r"""
import array, fcntl, marshal, os, select, signal, socket, sys
sock = socket.socket(fileno=int(sys.argv[1]))
procs = sys.argv[2]
try:
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("-1000")
except OSError:
    pass
child = -1
me = os.getpid()
def kill_all():
    if child > 0:
        try:
            os.killpg(child, 9)
        except OSError:
            pass
    try:
        with open(procs) as f:
            pids = [int(p) for p in f.read().split()] if procs else []
    except OSError:
        pids = []
    for p in pids:
        if p != me:
            try:
                os.kill(p, 9)
            except OSError:
                pass
def start(argv, env, cwd, fds):
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in fds]
    try:
        pid = os.fork()
    finally:
        if os.getpid() == me:
            for fd in high:
                os.close(fd)
    if pid:
        return pid
    try:
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("0")
        except OSError:
            pass
        os.setsid()
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # ignored by Python: defaults again, as Popen restores them
            signal.signal(sig, signal.SIG_DFL)
        for i, fd in enumerate(high):
            os.dup2(fd, i)
        os.closerange(len(high), 1 << 16)
        os.chdir(cwd)
        os.execvpe(argv[0], argv, env)
    except BaseException as e:
        os.write(2, ("ckpteval spawner: cannot start %s: %s\n" % (argv[0], e)).encode(errors="replace"))
    finally:
        os._exit(127)
def wait_child(pidfd):
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    poll.register(pidfd, select.POLLIN)
    while True:
        ready = dict(poll.poll())
        if pidfd in ready:
            info = os.waitid(os.P_PID, child, os.WEXITED | os.WNOWAIT)
            return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        if sock.fileno() in ready:  # the host sends nothing during a run: it went away
            return None
sock.send(b"U")
while True:
    try:
        msg, anc, _, _ = sock.recvmsg(1 << 20, socket.CMSG_SPACE(4 * 4))
    except OSError:
        msg, anc = b"", []
    fds = [fd for level, kind, data in anc if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
           for fd in array.array("i", data[: len(data) - len(data) % 4])] if anc else []
    if child > 0:
        os.waitpid(child, 0)  # the last sandbox: a zombie until now, so its pid stayed the host's to kill
        child = -1
    if not msg:
        kill_all()
        break
    try:
        child = start(*marshal.loads(msg), fds)
        reply = b"P%d" % child
    except (OSError, ValueError, EOFError, TypeError) as e:
        reply = ("E%s" % e).encode(errors="replace")
    for fd in fds:
        os.close(fd)
    sock.send(reply)
    if child > 0:
        pidfd = os.pidfd_open(child)
        code = wait_child(pidfd)
        os.close(pidfd)
        if code is None:
            kill_all()
            os.waitpid(child, 0)
            break
        sock.send(b"X%d" % code)
"""


class SandboxUnavailable(RuntimeError):
    """The sandbox could not run the program (bwrap refused to start, no process could be forked, the
    spawner died): an infrastructure failure, never the program's."""


class Spawner:
    """One pool thread's spawner process and its memory cgroup (see the module docstring)."""

    def __init__(self, cgroup: MemoryCgroup | None, memory_mb: int) -> None:
        self.cgroup, self.memory_mb, self.broken = cgroup, memory_mb, False
        try:
            self.group = cgroup.create(memory_mb) if cgroup is not None else None
        except OSError as e:
            raise SandboxUnavailable(f"cannot create a memory cgroup under {cgroup.parent}: {e}") from None  # type: ignore[union-attr]
        host, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        procs = str(self.group / "cgroup.procs") if self.group is not None else ""
        try:
            self.proc = subprocess.Popen([interpreter()[0], *INTERPRETER_FLAGS, "-c", SPAWNER, str(far.fileno()), procs],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(far.fileno(),),
                                         start_new_session=True)
        except OSError as e:
            host.close()
            self._drop_group()
            raise SandboxUnavailable(f"cannot start the sandbox spawner: {e}") from None
        finally:
            far.close()
        self.sock = host
        try:
            if self._reply(REPLY_S) != b"U":
                raise SandboxUnavailable("the sandbox spawner did not start")
            if self.group is not None:  # the one migration of this thread: after the spawner's start-up
                (self.group / "cgroup.procs").write_text(str(self.proc.pid))
        except (SandboxUnavailable, OSError) as e:
            self.close()
            raise SandboxUnavailable(f"cannot start the sandbox spawner in its cgroup: {e}") from None

    def _reply(self, timeout: float) -> bytes:
        """The spawner's next message ("" when it is gone or silent for ``timeout`` seconds: then broken)."""
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        try:
            got = sel.select(timeout)
        finally:
            sel.close()
        try:
            msg = self.sock.recv(256) if got else b""
        except OSError:
            msg = b""
        self.broken = self.broken or not msg
        return msg

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, fds: list[int]) -> int:
        """Start ``argv`` in a new session with ``fds`` as its fds 0.. (stdin, stdout, stderr, ready): its pid."""
        try:
            self.sock.sendmsg([marshal.dumps((argv, env, cwd))],
                              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except OSError as e:
            self.broken = True
            raise SandboxUnavailable(f"the sandbox spawner is gone ({e})") from None
        reply = self._reply(REPLY_S)
        if reply.startswith(b"P") and reply[1:].isdigit():
            return int(reply[1:])
        if reply.startswith(b"E"):
            raise SandboxUnavailable(f"cannot start {argv[0]}: {reply[1:].decode(errors='replace')}")
        self.broken = True
        raise SandboxUnavailable(f"the sandbox spawner did not answer within {REPLY_S:g} s ({reply[:40]!r})")

    def status(self, timeout: float) -> int | None:
        """The last spawned process's exit status (Popen's convention: -signal when killed), or None."""
        reply = self._reply(timeout) if not self.broken else b""
        if reply.startswith(b"X") and reply[1:].lstrip(b"-").isdigit():
            return int(reply[1:])
        self.broken = True
        return None

    def kill(self, pid: int) -> None:
        """SIGKILL ``pid``'s process group and every process in the cgroup but the spawner."""
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.cgroup is not None and self.group is not None:
            self.cgroup.kill(self.group, spare=self.proc.pid)

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
        while self.cgroup.procs(self.group) - {self.proc.pid}:
            if time.monotonic() > give_up:
                return False
            self.cgroup.kill(self.group, spare=self.proc.pid)
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
        self._drop_group()

    def _drop_group(self) -> None:
        if self.cgroup is not None and self.group is not None:
            self.cgroup.discard(self.group)


class _Run:
    """One program's first process (bwrap, or the rlimits-only launcher) and the reading of its pipes until
    it ends or the deadline passes."""

    def __init__(self, spawner: Spawner, cmd: list[str], env: dict[str, str], cwd: str, stdin_path: str,
                 limits: Limits) -> None:
        self.limits, self.spawner = limits, spawner
        pipes = [os.pipe() for _ in range(3)]  # stdout, stderr, ready
        try:
            with open(stdin_path, "rb") as stdin:
                self.pid = spawner.spawn(cmd, env, cwd, [stdin.fileno(), *(w for _, w in pipes)])
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
            for fd in self.fds:
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
        """SIGKILL bwrap's (or the rlimits-only launcher's) process group: bwrap's PID namespace, and with it
        every process of the program, dies with it; and whatever is in the cgroup but the spawner."""
        self.spawner.kill(self.pid)


def program_files(tmp: str, encoded: bytes, stdin: bytes) -> tuple[str, str]:
    """Write the program (world-readable: the sandbox's uid reads it) and its stdin into ``tmp``."""
    program, stdin_path = os.path.join(tmp, "main.py"), os.path.join(tmp, "stdin")
    Path(program).write_bytes(encoded)
    os.chmod(program, 0o644)
    Path(stdin_path).write_bytes(stdin)
    return program, stdin_path
