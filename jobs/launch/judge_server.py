"""``python -m ckpteval.jobs.launch.judge_server --run-dir RUN -- CMD ...``: run a judge server for a run and
publish where it answers.

The judge component of ``ckpteval submit train-eval --judge-model PATH`` runs this on its node: it picks
a free port, starts ``CMD`` with every ``{port}`` in it replaced (sglang by default:
``python -m sglang.launch_server --model-path PATH --host 0.0.0.0 --port {port} --tp N``; the test
cluster uses ``ckpteval serve --judge exact --host 0.0.0.0 --port {port}``), waits until the server's
``GET /v1/models`` answers, and then writes ``RUN/judge.json`` (:func:`ckpteval.coord.results.verdicts.publish_judge`:
``{"url": "http://<this host>:<port>/v1", "model": <the id it reports>, "slurm_job_id", "pid"}``),
which the run's workers read (:mod:`ckpteval.jobs.eval.scorers.judge.scorer`). It then waits for the server; USR1,
TERM or INT stop it (SIGTERM to the server, SIGKILL after ``--grace``), and it exits with the
server's code (0 after a requested stop).

Guarantee: ``judge.json`` is written only once the server answered ``/v1/models``, and names the host
the workers reach it by (``--host``, default this node's hostname). Limits: the free port is picked by
binding port 0 and closing it, so another process could take it in between (the server then fails to
start and this exits 1); a server that dies later is not restarted (its units become ``judge_failed``
skips, backfilled later).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from ckpteval.coord.results.verdicts import publish_judge
from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.flags import Parser, bounded, fail, positive_int

PROG = "python -m ckpteval.jobs.launch.judge_server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def served_models(url: str, timeout_s: float = 5.0) -> list[str] | None:
    """The ids ``GET url/models`` lists (None: no usable answer yet)."""
    try:
        with urllib.request.urlopen(f"{url}/models", timeout=timeout_s) as r:
            data = json.loads(r.read()).get("data")
    except (OSError, urllib.error.URLError, ValueError, AttributeError):
        return None
    return [str(m.get("id")) for m in data if isinstance(m, dict)] if isinstance(data, list) else None


def add_judge_flags(parser: argparse.ArgumentParser) -> None:
    """``ckpteval submit train-eval``'s judge component flags (read by :func:`judge_command`)."""
    j = parser.add_argument_group("judge server (component 2, with --judge-model or --judge-cmd)")
    j.add_argument("--judge-model", metavar="PATH",
                   help="serve this model with sglang as the run's judge; its URL is published in RUN/judge.json")
    j.add_argument("--judge-gpus", type=positive_int, default=1, metavar="N",
                   help="GPUs of the judge server (sglang --tp N; default 1)")
    j.add_argument("--judge-partition", help="the judge's partition (default --partition)")
    j.add_argument("--judge-cpus", type=positive_int, default=8, metavar="N", help="CPUs for the judge (default 8)")
    j.add_argument("--judge-mem", help="memory for the judge, sbatch syntax")
    j.add_argument("--judge-cmd", metavar="CMD",
                   help="run this judge server instead of sglang ({port} is replaced by a free port; it must "
                   "answer /v1/models there), e.g. 'ckpteval serve --judge exact --host 0.0.0.0 --port {port}'")


def judge_command(args: argparse.Namespace) -> list[str] | None:
    """``ckpteval submit train-eval``'s judge server command (component 2; ``{port}`` left for :func:`main`),
    from ``--judge-model``/``--judge-cmd`` (None: no judge component); ValueError on conflicting flags."""
    if args.judge_model and args.judge_cmd:
        raise ValueError("--judge-model and --judge-cmd both name the judge server: give one")
    if (args.judge_model or args.judge_cmd) and args.judge_url:
        raise ValueError("--judge-url attaches to a running judge; --judge-model/--judge-cmd launch one: give one")
    if args.judge_cmd:
        cmd = shlex.split(args.judge_cmd)
        if not any("{port}" in part for part in cmd):
            raise ValueError(f"--judge-cmd {args.judge_cmd!r} must listen on {{port}} (replaced by a free port)")
        return cmd
    if args.judge_model:
        return [str(args.python), "-m", "sglang.launch_server", "--model-path", str(args.judge_model),
                "--host", "0.0.0.0", "--port", "{port}", "--tp", str(args.judge_gpus)]
    return None


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=Path, required=True, metavar="RUN", help="the run whose judge this is")
    p.add_argument("--host", default=socket.gethostname(), help="the name workers reach this node by (default: hostname)")
    p.add_argument("--ready-timeout", type=bounded(float, min=1), default=1800.0, metavar="S",
                   help="how long the server may take to answer /v1/models (default 1800)")
    p.add_argument("--grace", type=bounded(float, min=0), default=30.0, metavar="S",
                   help="after a stop: seconds between SIGTERM and SIGKILL to the server (default 30)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the server command; {port} is replaced")
    return p


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float, stop: threading.Event) -> list[str] | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None and not stop.is_set():
        if (ids := served_models(url)) is not None:
            return ids
        stop.wait(1.0)
    return None


def _stop(proc: subprocess.Popen[bytes], grace_s: float) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        return fail(PROG, "give the server command after --")
    run = RunDir(args.run_dir)
    if not run.path.is_dir():
        return fail(PROG, f"--run-dir {run.path}: not a directory")
    port = free_port()
    cmd = [part.replace("{port}", str(port)) for part in cmd]
    url = f"http://{args.host}:{port}/v1"
    stop = threading.Event()
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"judge_server: starting {' '.join(cmd)}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.Popen(cmd)
    except OSError as e:
        return fail(PROG, f"cannot start {cmd[0]}: {e.strerror or e}", 1)
    ids = _wait_ready(proc, url, args.ready_timeout, stop)
    if ids is None:
        rc = _stop(proc, args.grace)
        if stop.is_set():
            return 0
        return fail(PROG, f"the judge server did not answer {url}/models within {args.ready_timeout:g}s "
                    f"(exit {rc if proc.poll() is not None else 'none'})", 1)
    publish_judge(run.judge_path, url, ids[0] if ids else None, slurm_job_id=os.environ.get("SLURM_JOB_ID"),
                  pid=proc.pid)
    print(f"judge_server: {url} serves {ids}; published {run.judge_path}", file=sys.stderr, flush=True)
    while proc.poll() is None and not stop.wait(1.0):
        pass
    if stop.is_set():
        _stop(proc, args.grace)
        return 0
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
