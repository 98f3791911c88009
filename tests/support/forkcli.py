"""Many ``python -m ckpteval.jobs.cli ARGV`` processes without paying the interpreter start-up each time.

A fork server: one interpreter, started as ``python -m ckpteval.jobs.cli`` starts (same executable and
environment, so the same site, ``.pth`` files and editable finder), imports what that command has imported
before its module body runs (the ``ckpteval.jobs`` package and ``ckpteval.jobs.lifecycle``, both light: no
torch) and then forks one child per case. Each child is its own process: a new session, the case's directory
as cwd and as ``sys.path[0]`` (as ``-m`` does), stdin ``/dev/null``, stdout and stderr to files; it runs
``ckpteval.jobs.cli`` as ``__main__`` with :mod:`runpy` and exits as the interpreter does (the exit status of
``SystemExit``, a traceback and 1 for any other exception, non-daemon threads joined, ``atexit`` handlers run).
Whatever the server printed while warming up is prepended to every case's output: a fresh process prints it too.

Limits (why a test about start-up itself must not use this): the children share one hash seed; the warm-up
modules are imported once, not per case; the interpreter's finalization (module teardown, its late
"Exception ignored" lines) is skipped — a ``gc.collect()`` stands in for the unreachable objects' finalizers.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

SERVER = r'''
import gc, json, os, select, signal, sys
proto = os.dup(1)
for fd, path in ((1, sys.argv[1]), (2, sys.argv[2])):
    f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(f, fd)
    os.close(f)
import atexit, runpy, threading  # noqa: E401
import ckpteval.jobs.lifecycle  # what `python -m ckpteval.jobs.cli` imports before its body runs
sys.stdout.flush()
sys.stderr.flush()


def exit_code(exc):
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def child(req, wake):
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.close(wake[0]); os.close(wake[1]); os.close(proto)  # noqa: E702
        os.setsid()
        os.chdir(req["cwd"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["out"], os.O_WRONLY | os.O_CREAT),
                                (2, req["err"], os.O_WRONLY | os.O_CREAT)):
            f = os.open(path, flags, 0o600)
            os.dup2(f, fd)
            os.close(f)
        sys.argv = ["-m", *req["argv"]]
        sys.path[0] = os.getcwd()
        try:
            runpy.run_module("ckpteval.jobs.cli", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exit_code(exc)
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()
        atexit._run_exitfuncs()
        gc.collect()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def send(obj):
    os.write(proto, (json.dumps(obj) + "\n").encode())


def main():
    wake = os.pipe()
    os.set_blocking(wake[1], False)
    signal.set_wakeup_fd(wake[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)
    running, buf = {}, b""
    send({"ready": True})
    open_ = True
    while open_ or running:
        ready, _, _ = select.select([0, wake[0]] if open_ else [wake[0]], [], [], 1.0)
        if wake[0] in ready:
            os.read(wake[0], 4096)
        if 0 in ready:
            chunk = os.read(0, 65536)
            open_ = bool(chunk)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    child(req, wake)
                running[pid] = req["id"]
                send({"id": req["id"], "pid": pid})
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            send({"id": running.pop(pid), "code": os.waitstatus_to_exitcode(status)})


main()
'''


class ForkCli:
    """A running fork server (a context manager); :meth:`run` is safe to call from several threads."""

    def __init__(self, env: dict[str, str], work: Path) -> None:
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        warm_out, warm_err = work / "warm.out", work / "warm.err"
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(warm_out), str(warm_err)], cwd=work,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        first = self.proc.stdout.readline() if self.proc.stdout else b""
        self.warm_out, self.warm_err = warm_out.read_text(), warm_err.read_text()
        if not first:
            raise RuntimeError(f"the ckpteval fork server did not start: {self.warm_err[-2000:]}")
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._replies: dict[int, queue.Queue[dict[str, int]]] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._lock:
                q = self._replies[msg["id"]]
            q.put(msg)

    def run(self, argv: list[str], cwd: Path, timeout_s: float) -> tuple[int | None, str, str]:
        """(exit code or None if killed at the timeout, stdout, stderr) of ``ckpteval ARGV`` run in ``cwd``."""
        assert self.proc.stdin is not None
        n = next(self._ids)
        out, err = self.work / f"{n}.out", self.work / f"{n}.err"
        out.touch()
        err.touch()
        q: queue.Queue[dict[str, int]] = queue.Queue()
        with self._lock:
            self._replies[n] = q
            self.proc.stdin.write((json.dumps({"id": n, "argv": argv, "cwd": str(cwd), "out": str(out),
                                               "err": str(err)}) + "\n").encode())
            self.proc.stdin.flush()
        pid = q.get(timeout=60)["pid"]
        try:
            code: int | None = q.get(timeout=timeout_s)["code"]
        except queue.Empty:
            try:
                os.killpg(pid, 9)  # its own session: the case and anything it started
            except ProcessLookupError:  # it ended just now
                pass
            q.get()
            code = None
        texts = self.warm_out + out.read_text(), self.warm_err + err.read_text()
        out.unlink()
        err.unlink()
        return code, *texts

    def __enter__(self) -> ForkCli:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)
