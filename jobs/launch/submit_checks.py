"""What ``ckpteval submit`` checks on the submit host before a job is queued.

Owns :func:`check_on_submit_host`: the interpreter (``--python``), the batch-script templates and
``common.sh`` in ``--sbatch-dir``, the worker's ``--engine``/``--device``/extra arguments (parsed by the
worker's own parser), the trainer's arguments (the trainer's parser), the run dirs, and for a service its
``--eval-config`` (read and validated in full, dataset files included). Every problem is a
``ValueError`` naming the flag or file; nothing is written. Also :func:`trailing`, the arguments after
a ``--``; the ``--time`` syntax and its margin over ``--signal-before``; ``#SBATCH`` values without
whitespace (sbatch splits its lines there); and :func:`runs_with_work`, which leaves out of a backfill
the runs with nothing left to do (:class:`NothingToDo` when that is all of them).

Limits: the compute nodes are assumed to see the same paths (the scripts need that anyway); nothing is
checked against the cluster (partitions, accounts, GPUs): sbatch reports what the cluster refuses. The
eval and trainer parsers are imported only when a check needs them, so launchers stay free of torch.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from ckpteval.jobs.flags import parse_as
from ckpteval.jobs.pathchecks import check_watch_dir


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
    from ckpteval.jobs.eval.worker.options import DEVICE_RE, WorkerOptions, validate_options

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
        from ckpteval.jobs.reference.train.config import TrainConfig

        parse_as(TrainConfig, ["--run-dir", str(run), *trainer_args], "trainer argument").validate()  # what
        # `ckpteval train` itself refuses (--eval-interval vs --save-interval, ...): before queueing, not in the job
        fresh = not (run / "TRAINING_DONE").exists() and "--resume" not in trainer_args
        if (run / "run.json").exists() and fresh:
            raise ValueError(f"--run-dir {run} already holds a run: pass -- --resume to continue it, or pick "
                             "another --run-dir")
    if run.exists() and not run.is_dir():
        raise ValueError(f"--run-dir {run}: exists and is not a directory")


def _check_service(args: argparse.Namespace, worker_args: list[str]) -> None:
    run = Path(args.run_dir)
    if args.eval_config is not None:
        from ckpteval.jobs.eval.worker.evalconfig import read_eval_config

        try:
            read_eval_config(args.eval_config)
        except FileNotFoundError as e:
            raise ValueError(f"--eval-config: {e}") from None
    elif not (run / "run.json").is_file() and not (_waits_for_a_job(args) or "--wait-for-run" in worker_args):
        raise ValueError(f"--run-dir {run} has no run.json: give --eval-config FILE to create the run (for one "
                         "a queued job creates, add --sbatch-arg=--dependency=afterany:JOBID)")
    for watch in args.watch:
        check_watch_dir(watch)


# -- time limit, #SBATCH values, backfill with nothing to do -------------------------------------------
_TIME_RE = re.compile(r"^(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                      r"|(?P<a>\d+)(?::(?P<b>\d+)(?::(?P<c>\d+))?)?)$")
UNLIMITED = ("unlimited", "infinite")


def time_seconds(text: str) -> float:
    """Seconds of an sbatch ``--time`` (``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``;
    ``UNLIMITED``/``INFINITE``: inf); ValueError for anything else."""
    if text.lower() in UNLIMITED:
        return math.inf
    m = _TIME_RE.match(text.strip())
    if m is None:
        raise ValueError(f"invalid time limit {text!r}: use sbatch syntax, e.g. 30 (minutes), 4:00:00, 1-12:00:00")
    if m["d"] is not None:
        return int(m["d"]) * 86400 + int(m["dh"]) * 3600 + int(m["dm"] or 0) * 60 + int(m["ds"] or 0)
    parts = [int(x) for x in (m["a"], m["b"], m["c"]) if x is not None]
    if len(parts) == 3:
        return parts[0] * 3600 + parts[1] * 60 + parts[2]
    return parts[0] * 60 + (parts[1] if len(parts) == 2 else 0)


def time_limit(text: str) -> str:
    """argparse type of ``--time``: the text as given, once it parses (:func:`time_seconds`)."""
    try:
        time_seconds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def check_time_vs_signal(args: argparse.Namespace) -> None:
    """The USR1 ``--signal-before`` the limit must come after the job started working: a job signalled at
    (or before) its start stops, requeues, and does it again."""
    if args.time is None:
        return
    limit = time_seconds(args.time)
    if limit <= args.signal_before:
        raise ValueError(f"--time {args.time} ({limit:.0f} s) is not longer than --signal-before {args.signal_before}: "
                         "the job would be told to stop before it starts working (a requeue loop); give a longer "
                         "--time or a smaller --signal-before")


def check_sbatch_line(line: str, flag: str) -> None:
    """An ``#SBATCH`` value must not hold whitespace: sbatch splits the line there and quoting it in the
    script is not portable across SLURM versions — refuse, naming the flag to change."""
    if any(ch.isspace() for ch in line):
        raise ValueError(f"{flag}: {line!r} would go into an #SBATCH line, which sbatch splits at whitespace; "
                         "use a path or value without spaces" + (" (or give --output PATH without spaces)"
                                                                  if flag == "--run-dir" else ""))


class NothingToDo(Exception):
    """``submit backfill`` for runs with nothing left to evaluate: say so, submit nothing (exit 0)."""


def finished_without_work(run: Path) -> bool:
    """Whether a backfill of ``run`` could only find nothing: no trainer will publish more (training done,
    interrupted, or a re-evaluation run) and every unit of it has a result. A run status cannot read is
    left to the job (which reports it); a service run, fed by a watched dir, never counts as finished."""
    from ckpteval.jobs.views.status.main import collect_status

    try:
        status = collect_status(run)
    except (OSError, ValueError):
        return False
    ended = status["training_done"] is not None or status["interrupted"] or status["reeval"]
    return bool(ended) and not status["units"]["pending"]


def runs_with_work(args: argparse.Namespace) -> list[Path]:
    """The ``--run-dir`` runs a backfill job can still do something for (all of them while another job
    may produce work: ``--from-run`` or an ``--sbatch-arg=--dependency``); NothingToDo when none."""
    runs = [Path(os.path.abspath(Path(r).expanduser())) for r in args.run_dir]
    if args.from_run is not None or _waits_for_a_job(args):
        return runs
    busy = [r for r in runs if not finished_without_work(r)]
    if not busy:
        names = ", ".join(shlex.quote(str(r)) for r in runs)
        raise NothingToDo(f"nothing to do — training has ended and every unit of {names} already has a result; "
                          "nothing submitted")
    for r in runs:
        if r not in busy:
            print(f"ckpteval submit: {r}: every unit already has a result; left out of the array",
                  file=sys.stderr)
    return busy
