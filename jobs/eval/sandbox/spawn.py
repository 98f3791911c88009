"""Starting programs inside their memory cgroup, and reading each until it ends or its deadline.

Each pool thread of a :class:`ckpteval.jobs.eval.sandbox.core.Sandbox` owns a :class:`Spawner` in its own cgroup,
and each program runs in a fresh memory cgroup of its own, removed when it ends.
Guarantee (:class:`_Run`): stdout/stderr are capped as read; the outside deadline holds whatever the program does
(its init SIGKILLed through a pidfd); memory a program leaves charged past its end (memfds parked in a unix-socket
cycle) stays in its removed cgroup, never in the next program's. See docs/USER_GUIDE.md "Code (sandboxed execution)".
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

from ckpteval.jobs.eval.sandbox.cgroup import MemoryCgroup
from ckpteval.jobs.eval.sandbox.launch import INTERPRETER_FLAGS, Limits, bwrap_prefix, interpreter
from ckpteval.jobs.eval.sandbox.runner import SPAWNER

REPLY_S = 30.0  # how long the host waits for the spawner to start or to answer a spawn

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
        self.program_group: Path | None = None  # the running (or last) program's own cgroup
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
            if warm is not None:
                spare_from_oom_killer(self.spare)  # bwrap leaves the runner no CAP_SYS_RESOURCE to say it itself
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
        stdout, stderr, ready): its pid as the spawner sees it, and a pidfd of it. The program's first process
        joins a fresh memory cgroup of its own (:meth:`end_program` removes it)."""
        procs_fd = self._program_cgroup()
        if self.warm is None:
            message = (*message, str(self.program_group / "cgroup.procs") if self.program_group else "")
        try:
            self.sock.sendmsg([marshal.dumps(message)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                          array.array("i", [*fds, *([procs_fd] if procs_fd >= 0 else [])]))])
        except OSError as e:
            self.broken = True
            raise SandboxUnavailable(f"the sandbox spawner is gone ({e})") from None
        finally:
            if procs_fd >= 0:
                os.close(procs_fd)
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

    def _program_cgroup(self) -> int:
        """A fresh cgroup for the next program, limited to ``memory_mb``: an fd of its ``cgroup.procs`` open for
        writing (-1: no cgroup here)."""
        self.end_program()
        if self.cgroup is None:
            return -1
        try:
            self.program_group = self.cgroup.create(self.memory_mb)
            return os.open(self.program_group / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError as e:
            self.end_program()
            raise SandboxUnavailable(f"cannot create a memory cgroup for the program under {self.cgroup.parent}: {e}") from None

    def end_program(self) -> None:
        """Kill what is left of the last program and remove its cgroup (with whatever it left charged there)."""
        if self.cgroup is not None and self.program_group is not None:
            self.cgroup.discard(self.program_group)
        self.program_group = None

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
        if self.cgroup is not None and self.program_group is not None:
            self.cgroup.kill(self.program_group)

    def oom_kills(self) -> int:
        """The OOM kills in the current program's cgroup (0 before it has one)."""
        group = self.program_group
        return self.cgroup.oom_kills(group) if self.cgroup is not None and group is not None else 0

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
        self.end_program()
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


def spare_from_oom_killer(pid: int) -> bool:
    """Ask the OOM killer never to pick ``pid`` (``oom_score_adj`` -1000: root only; False where refused)."""
    try:
        Path(f"/proc/{pid}/oom_score_adj").write_text("-1000")
        return True
    except OSError:
        return False


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
