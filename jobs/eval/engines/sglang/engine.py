"""``SGLangEngine``: an :class:`~ckpteval.jobs.eval.engines.http.engine.HTTPEngine` that launches (or attaches to) sglang.

Owns the server process: launch (``python -m sglang.launch_server``, bounded by ``startup_timeout``, one launch at
a time), the version floor before launch, ``--enable-deterministic-inference`` unless every dataset opts out
(:mod:`~ckpteval.jobs.eval.engines.sglang.deterministic`), :meth:`~SGLangEngine.restart` with the last snapshot and
version, and :meth:`~SGLangEngine.close` of the whole process group. Limits: importing needs neither sglang nor a
GPU; an attached server is never restarted. See docs/USER_GUIDE.md "sglang: what the worker relies on".
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckpteval.jobs.eval.engines.base import EngineError, WeightVersionMismatch, gpu_count
from ckpteval.jobs.eval.engines.http.engine import HEALTH_TIMEOUT_S, HTTPEngine
from ckpteval.jobs.eval.engines.sglang.deterministic import (  # noqa: F401 — DETERMINISTIC_FLAG re-exported
    DETERMINISTIC_FLAG,
    attention_choice,
    flag_value,
    gpu_capability,
    launch_flags,
    model_config,
)
from ckpteval.jobs.eval.engines.sglang.version import UnsupportedServer, check_sglang_version

LAUNCH_POLL_S = 0.5  # between health probes while a server starts (each is cheap: refused or 503)
LAUNCH_SLACK_S = 30.0  # past the launch's own bounds, before its caller gives up on it


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch_command(
    model_path: str,
    host: str,
    port: int,
    tp_size: int,
    weight_version: str | None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """The ``sglang.launch_server`` command line."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host]
    cmd += ["--port", str(port), "--tp-size", str(tp_size)]
    if weight_version is not None:
        cmd += ["--weight-version", weight_version]
    return cmd + list(extra_args)


def installed_sglang_version(python: str, env: Mapping[str, str], timeout: float = 120.0) -> str:
    """The version of the sglang distribution ``python`` would run (read from its metadata, not imported);
    :class:`UnsupportedServer` when it has none."""
    code = "import importlib.metadata as m; print(m.version('sglang'))"
    try:
        done = subprocess.run(
            [python, "-c", code], env=dict(env), capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UnsupportedServer(f"cannot ask {python} for its sglang version: {e}") from e
    if done.returncode != 0:
        raise UnsupportedServer(
            f"sglang is not installed for {python} (pip install 'ckpteval[sglang]'): {done.stderr.strip()[-300:]}"
        )
    return done.stdout.strip()


def device_flags(device: str | None) -> tuple[list[str], int | None]:
    """sglang flags for an engine ``device`` and the tp size it implies (``None``: all visible GPUs).

    ``None``/``"cpu"`` (the worker's default, meant for in-process engines) and ``"cuda"`` add
    nothing: sglang runs on the GPUs ``CUDA_VISIBLE_DEVICES`` names. ``"cuda:N"`` pins one GPU.
    """
    if device in (None, "cpu", "cuda"):
        return [], None
    kind, _, index = device.partition(":")
    if kind != "cuda" or not index.isdigit():
        raise ValueError(f"device must be cuda, cuda:N or cpu (ignored), got {device!r}")
    return ["--base-gpu-id", index], 1


@dataclass(frozen=True)
class LaunchSettings:
    """How this engine starts its server (fixed for its lifetime; the model path and version vary)."""

    python: str
    host: str
    port: int
    tp_size: int
    extra_args: tuple[str, ...]
    log_path: str


class SGLangEngine(HTTPEngine):
    """sglang behind the Engine protocol; launches its own server unless given a ``url``.

    With neither ``model_path`` nor ``url`` the server is launched by the first :meth:`load`, on that
    snapshot and version; until then :meth:`weight_version` is ``None``.
    """

    def __init__(
        self,
        model_path: str | None = None,
        *,
        url: str | None = None,
        weight_version: str | None = None,
        device: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        tp_size: int | None = None,
        extra_args: Sequence[str] = (),
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 900.0,
        stop_grace: float = 30.0,
        log_path: str | None = None,
        timeout: float = 300.0,
        load_timeout: float = 600.0,
        health_timeout: float = HEALTH_TIMEOUT_S,
        deterministic: bool = False,
        **http_settings: Any,
    ) -> None:
        """``http_settings``: :class:`~ckpteval.jobs.eval.engines.http.engine.HTTPEngine`'s (``token_timeout_s``,
        ``busy_retries``, ``max_batch_size``, ...), e.g. from run.json ``eval.engine.sglang``."""
        if model_path is not None and url is not None:
            raise ValueError("give model_path (launch a server) or url (attach to one), not both")
        self._proc: subprocess.Popen[bytes] | None = None
        self._env = dict(os.environ if env is None else env)
        self._startup_timeout = startup_timeout
        self._stop_grace = stop_grace
        self._model_path, self._version = model_path, weight_version
        self._launch_settings: LaunchSettings | None = None
        self._launch_lock = threading.Lock()  # one launch at a time (never two servers on one port)
        self._cancel = threading.Event()  # set: a launch in flight stops waiting and kills its server
        if url is not None:
            super().__init__(url, timeout, load_timeout=load_timeout, health_timeout=health_timeout, **http_settings)
            return
        determinism = launch_flags(deterministic, extra_args)  # ValueError: sglang would refuse to start
        flags, implied_tp = device_flags(device)
        tp = tp_size if tp_size is not None else implied_tp or gpu_count(self._env)
        if tp < 1:
            raise EngineError("sglang needs at least one GPU (CUDA_VISIBLE_DEVICES lists none)")
        check_sglang_version(installed_sglang_version(python, self._env), f"the sglang installed for {python}")
        port = port if port is not None else free_port(host)
        super().__init__(f"http://{host}:{port}", timeout, load_timeout=load_timeout, health_timeout=health_timeout,
                         **http_settings)
        flags += determinism
        self._launch_settings = LaunchSettings(
            python, host, port, tp, (*flags, *extra_args), log_path or self._new_log_path()
        )
        if model_path is not None:
            self._launch()

    @property
    def log_path(self) -> str | None:
        """Where the launched server's output goes (``None`` when attached)."""
        return None if self._launch_settings is None else self._launch_settings.log_path

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @staticmethod
    def _new_log_path() -> str:
        fd, path = tempfile.mkstemp(prefix="ckpteval-sglang-", suffix=".log")
        os.close(fd)
        return path

    @property
    def launch_timeout_s(self) -> float | None:
        """The most one launch may take, its own clean-up included (``None``: attached, never launches):
        ``startup_timeout`` plus one health probe and the SIGTERM/SIGKILL grace periods."""
        if self._launch_settings is None:
            return None
        return self._startup_timeout + self._health_timeout + 2 * self._stop_grace + LAUNCH_SLACK_S

    @property
    def launch_pending(self) -> bool:
        """Whether the next :meth:`load` launches the server (a lazy engine before its first load)."""
        return self._not_launched

    # ------------------------------------------------------------------ process lifecycle
    def _launch(self) -> None:
        """Launch (waiting for any launch still in flight to finish first)."""
        with self._launch_lock:
            self._cancel.clear()
            self._start()

    def _start(self) -> None:
        """Start the server and wait until it is healthy; the caller holds ``_launch_lock``."""
        ls = self._launch_settings
        base_gpu = flag_value(ls.extra_args, "--base-gpu-id")
        choice = attention_choice(ls.extra_args, gpu_capability(self._env, int(base_gpu or 0)),
                                  model_config(self._model_path))  # fa3 would die at model init: triton
        cmd = launch_command(
            self._model_path, ls.host, ls.port, ls.tp_size, self._version, (*choice, *ls.extra_args), ls.python
        )
        with open(ls.log_path, "ab") as log:
            self._proc = proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=self._env, start_new_session=True
            )
        self._wait_ready(proc)
        self._weights_unknown = False  # a fresh server holds the snapshot it was launched on

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self._startup_timeout
        while time.monotonic() < deadline and not self._cancel.is_set():
            code = proc.poll()
            if code is not None:
                self._proc = None
                raise EngineError(f"sglang exited with code {code} while starting; log: {self.log_path}")
            if self.healthy():
                return
            self._cancel.wait(LAUNCH_POLL_S)
        self._terminate()
        if self._cancel.is_set():
            raise EngineError(f"sglang launch cancelled (a restart or close took over); log: {self.log_path}")
        raise EngineError(f"sglang not healthy after {self._startup_timeout:.0f}s; log: {self.log_path}")

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        self._signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=self._stop_grace)
        except subprocess.TimeoutExpired:
            self._signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=self._stop_grace)

    @staticmethod
    def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        try:
            os.killpg(proc.pid, sig)  # start_new_session: the group id is the child's pid
        except ProcessLookupError:
            pass

    @property
    def _not_launched(self) -> bool:
        return self._launch_settings is not None and self._proc is None

    # ------------------------------------------------------------------ Engine protocol
    def load(self, snapshot_dir: str, weight_version: str) -> None:
        if self._closed:
            raise EngineError(f"engine for {self.base_url} is closed")
        if self._not_launched:  # first load (or after close): start the server on this snapshot
            self._model_path, self._version = str(snapshot_dir), weight_version
            self._launch()
            reported = super().weight_version()
            if reported != weight_version:
                raise WeightVersionMismatch(
                    f"launched with version {weight_version!r}, server reports {reported!r}"
                )
            return
        super().load(snapshot_dir, weight_version)
        self._model_path, self._version = str(snapshot_dir), weight_version

    def weight_version(self) -> str | None:
        return None if self._not_launched else super().weight_version()

    def restart(self) -> None:
        """Relaunch on the last loaded snapshot and version; a no-op before the first load."""
        if self._launch_settings is None:
            raise EngineError(
                f"cannot restart {self.base_url}: attached to a server this engine did not launch"
            )
        self._cancel.set()  # a launch still in flight (its caller timed out) gives up and kills its server
        with self._launch_lock:  # ... and is waited for: one server on this port at a time
            if self._closed:  # a restart that outlived close() must not leave a server behind
                raise EngineError(f"engine for {self.base_url} is closed")
            self._cancel.clear()
            self._terminate()
            if self._model_path is not None:
                self._start()

    def close(self) -> None:
        self._cancel.set()  # a launch in flight tears its server down itself
        self._terminate()
        super().close()
