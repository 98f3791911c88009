"""What ``ckpteval submit`` checks on the submit host before a job is queued.

Owns :func:`check_on_submit_host`: the interpreter (``--python``), the batch-script templates and
``common.sh`` in ``--sbatch-dir``, the worker's ``--engine``/``--device``/extra arguments (parsed by the
worker's own parser), the trainer's arguments (the trainer's parser), the run dirs, and for a service its
``--eval-config`` (read and validated in full, dataset files included). Every problem is a
``ValueError`` naming the flag or file; nothing is written. Also :func:`trailing`, the arguments after
a ``--``.

Limits: the compute nodes are assumed to see the same paths (the scripts need that anyway); nothing is
checked against the cluster (partitions, accounts, GPUs): sbatch reports what the cluster refuses. The
eval and trainer parsers are imported only when a check needs them, so launchers stay free of torch.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from jobs.flags import parse_as


def trailing(args: list[str]) -> list[str]:
    """The arguments after a leading ``--`` (argparse's REMAINDER keeps it), or all of them."""
    return args[1:] if args and args[0] == "--" else list(args)


def check_on_submit_host(args: argparse.Namespace, templates: Mapping[str, str]) -> None:
    """What can be checked here before a job is queued (ValueError naming the flag or file).

    The interpreter, the templates, the worker's ``--engine``/``--device``/extra arguments (parsed by the
    worker's own parser), the trainer's arguments (the trainer's parser), the run dirs, and for a service
    its ``--eval-config`` (read and validated in full, dataset files included). The compute nodes are
    assumed to see the same paths (the scripts need that anyway).
    """
    _check_python(args.python)
    for kind in ({args.kind} | {"common"}):
        name = "common.sh" if kind == "common" else templates[kind]
        path = Path(args.sbatch_dir) / name
        if not path.is_file() or not os.access(path, os.R_OK):
            raise ValueError(f"--sbatch-dir {args.sbatch_dir}: no readable {name} there")
    from jobs.eval.options import DEVICE_RE, WorkerOptions, validate_options

    if args.device is not None and not DEVICE_RE.match(args.device):
        raise ValueError(f"--device {args.device!r}: expected cpu, cuda or cuda:N")
    run_dirs = args.run_dir if isinstance(args.run_dir, list) else [args.run_dir]
    extra = list(args.worker_arg) + (trailing(args.worker_args) if args.kind == "service" else [])
    worker_args = ["--run-dir", str(run_dirs[0]), "--engine", args.engine, *extra]
    validate_options(parse_as(WorkerOptions, worker_args, "worker argument"))
    if args.kind == "train-eval":
        _check_train_eval(args)
    elif args.kind == "backfill":
        for run in run_dirs:
            if args.from_run is not None:  # re-evaluation: the new run is created just before sbatch
                continue
            if not (Path(run) / "run.json").is_file() and not _waits_for_a_job(args):
                raise ValueError(f"--run-dir {run}: no run.json there (backfill scores an existing run; for one "
                                 "a queued job creates, add --sbatch-arg=--dependency=afterany:JOBID)")
    else:
        _check_service(args, extra)


def _waits_for_a_job(args: argparse.Namespace) -> bool:
    """Whether the job starts only after another (which may create the run): an sbatch --dependency."""
    return any(a.startswith(("--dependency", "-d")) for a in args.sbatch_arg)


def _check_python(python: str) -> None:
    found = shutil.which(python) if os.sep not in python else python
    if found is None or not Path(found).is_file():
        raise ValueError(f"--python {python}: no such interpreter")
    if not os.access(found, os.X_OK):
        raise ValueError(f"--python {python}: not executable")


def _check_train_eval(args: argparse.Namespace) -> None:
    run = Path(args.run_dir)
    trainer_args = trailing(args.trainer_args)
    if args.train_cmd is None:
        from jobs.reference.train_config import TrainConfig

        parse_as(TrainConfig, ["--run-dir", str(run), *trainer_args], "trainer argument")
        fresh = not (run / "TRAINING_DONE").exists() and "--resume" not in trainer_args
        if (run / "run.json").exists() and fresh:
            raise ValueError(f"--run-dir {run} already holds a run: pass -- --resume to continue it, or pick "
                             "another --run-dir")
    if run.exists() and not run.is_dir():
        raise ValueError(f"--run-dir {run}: exists and is not a directory")


def _check_service(args: argparse.Namespace, worker_args: list[str]) -> None:
    run = Path(args.run_dir)
    if args.eval_config is not None:
        from jobs.eval.service import read_eval_config

        try:
            read_eval_config(args.eval_config)
        except FileNotFoundError as e:
            raise ValueError(f"--eval-config: {e}") from None
    elif not (run / "run.json").is_file() and not (_waits_for_a_job(args) or "--wait-for-run" in worker_args):
        raise ValueError(f"--run-dir {run} has no run.json: give --eval-config FILE to create the run (for one "
                         "a queued job creates, add --sbatch-arg=--dependency=afterany:JOBID)")
    for watch in args.watch:
        if Path(watch).exists() and not Path(watch).is_dir():
            raise ValueError(f"--watch {watch}: not a directory")
