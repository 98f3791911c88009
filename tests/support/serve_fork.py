"""Real ``ckpteval serve`` processes without paying the interpreter start and the torch import per launch.

A test that needs many server launches (each an independent load: the attestation tests) starts one
*zygote* (``python -m tests.support.serve_fork``, a fresh interpreter with the test environment of
:func:`tests.support.workers.worker_env`) that imports what ``serve`` imports (torch, transformers, the
stand-in, the stale-layer variant) and then forks one child per launch. Each child is a separate real
process that runs ``python -m MODULE serve ARGS`` exactly as the interpreter would (``runpy`` with
``__main__``, as ``-m`` does): it parses its arguments, binds its port, builds its engine and loads its
model from disk itself, stamps its own ``startup_time`` and serves until killed. What it shares with its
siblings is only what the zygote holds before the fork: imported modules, no model, no weights, no engine,
one thread (the zygote never runs a model, so no thread pool is forked).

Guarantee: a launch here is observably the launch :func:`tests.support.workers.start_serve` makes (same
arguments, same stdout line ``serving on URL``, stderr in ``log``), minus ~5-15 s of imports. Limits: the
child is the zygote's child, not the test's, so :class:`ForkedServer` knows whether it is alive but not its
exit code; an import-time failure of ``serve`` shows once, when the zygote starts, not per launch.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PRELOAD = (  # what ``serve`` imports before it listens (hf.py at module level, the model classes on load)
    "ckpteval.jobs.cli",
    "ckpteval.jobs.reference.serve.main",
    "ckpteval.jobs.eval.engines.hf.engine",
    "transformers.models.llama.modeling_llama",
    "tests.support.stale_serve",
)


class ForkedServer:
    """A forked server process, by pid: the part of ``subprocess.Popen`` the tests use (kill, wait, poll)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        """None while the process lives, else -1 (it was reaped by the zygote; its exit code is not known)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return -1
        return None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float = 30.0) -> int:
        end = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > end:
                raise TimeoutError(f"forked server {self.pid} still running after {timeout}s")
            time.sleep(0.01)
        return -1


class ServeForker:
    """The test side: one zygote process; :meth:`start` launches a server from it, :meth:`close` ends all."""

    def __init__(self, timeout: float = 180.0) -> None:
        from tests.support.workers import PYTHON, REPO, worker_env

        self.launched: list[ForkedServer] = []
        self.proc = subprocess.Popen([PYTHON, "-m", "tests.support.serve_fork"], cwd=REPO, env=worker_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self._reply(timeout) != "ready":
            self.close()
            raise RuntimeError("the serve zygote did not start (its imports failed: see stderr)")

    def _reply(self, timeout: float) -> str:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline().strip() if ready else ""  # type: ignore[union-attr]

    def start(self, args: list[str], log: Path, timeout: float = 60.0,
              module: str = "ckpteval.jobs.cli") -> tuple[str, ForkedServer]:
        """Launch ``python -m MODULE serve ARGS`` (``--port 0`` unless ARGS has ``--port``); (url, process).
        The arguments of :func:`tests.support.workers._start_listening`."""
        argv = ["serve", *args, *([] if "--port" in args else ["--port", "0"])]
        out = log.with_name(log.name + ".stdout")
        request = {"module": module, "argv": argv, "stdout": str(out), "stderr": str(log)}
        self.proc.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        if not (pid := self._reply(30.0)).isdigit():
            raise RuntimeError(f"the serve zygote did not fork (exit code {self.proc.poll()}, answered {pid!r})")
        server = ForkedServer(int(pid))
        self.launched.append(server)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and server.poll() is None:
            lines = out.read_text().splitlines() if out.exists() else []
            if url := next((line.split()[-1] for line in lines if line.startswith("serving on ")), None):
                return url, server
            time.sleep(0.02)
        server.kill()
        raise RuntimeError(f"serve did not start (alive={server.poll() is None}): {log.read_text()[-2000:]}")

    def close(self) -> None:
        for server in self.launched:
            server.kill()
        self.proc.kill()  # it holds no model and writes nothing: no graceful exit (torch's teardown costs ~2 s)
        self.proc.communicate()
        for server in self.launched:
            server.wait()


# -- the zygote (python -m tests.support.serve_fork) ----------------------------------------------------
def _child(request: dict[str, Any]) -> None:
    """In the forked child: stdio to the request's files, then run the module as ``python -m`` would; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                               (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):
            target = os.open(path, mode | (os.O_TRUNC if fd else 0), 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.argv = [request["module"], *request["argv"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001  # the child must never return into the zygote's loop
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def main() -> int:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel: no zombies
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(pid, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
