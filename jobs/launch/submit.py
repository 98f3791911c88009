"""``ckpteval submit {train-eval,backfill,service}``: render the batch scripts in ``sbatch/`` and sbatch them.

What it owns: turning the user's resources (partition, account, QOS, time, nodes, CPUs and GPUs per
component, workers, run dir, engine flags, extra trainer/worker arguments) into a self-describing
batch script, and submitting it with ``sbatch --parsable``. The templates stay usable by hand
(``sbatch sbatch/train_eval.sbatch RUN``); rendering only rewrites two marked blocks:

- ``# >>> ckpteval sbatch options`` … ``# <<<``: the ``#SBATCH`` lines (a heterogeneous job's
  components separated by ``#SBATCH hetjob``). Every script gets ``--requeue``, ``--open-mode=append``
  and ``--signal=B:USR1@<signal-before>`` (trapped by ``sbatch/common.sh``: steps are stopped, leases
  released, the job requeued).
- ``# >>> ckpteval settings`` … ``# <<<``: ``CKPTEVAL_*`` assignments (the scripts' settings), written
  as plain assignments so a stray variable in the submitting shell cannot override them.

The rendered script is saved as ``RUN/slurm/<kind>-<time>.sbatch`` (what ran, for the record) and
output goes to ``RUN/slurm/%x-%j.out`` (``%x-%A_%a.out`` for arrays) unless ``--output`` says
otherwise. ``--dry-run`` prints the script and the sbatch command and touches nothing.

Python callers (:mod:`ckpteval.jobs.launch.api`) use :func:`prepare` and :func:`submit_prepared`.

Limits: the scripts run ``CKPTEVAL_PYTHON -P -m ckpteval.jobs.cli`` and source ``common.sh`` from :func:`sbatch_dir`
(this checkout's ``sbatch/``, or the copy an installed wheel ships), so both must be on a filesystem the
compute nodes see (paths are rendered absolute).
Options are checked for sense (positive counts, workers vs nodes; the submit-host checks are
:mod:`ckpteval.jobs.launch.submit_checks`'s), not against the cluster: sbatch reports what the cluster refuses.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckpteval.jobs.flags import Parser, fail, http_url, non_negative_int, positive_int
from ckpteval.jobs.launch.judge_server import add_judge_flags, judge_command
from ckpteval.jobs.launch.sbatch_template import (
    component,
    fleet_gpus_per_node,
    job_lines,
    render,
    settings_lines,
    worker_argv,
)
from ckpteval.jobs.launch.submit_checks import (
    NothingToDo,
    check_on_submit_host,
    runs_with_work,
    time_limit,
    trailing,
)


def sbatch_dir() -> Path:
    """Where the batch scripts are: the copy shipped inside an installed wheel (``jobs/launch/sbatch/``,
    put there by setup.py's build hook), else ``sbatch/`` of this checkout (editable install, PYTHONPATH)."""
    here = Path(__file__).resolve()
    for candidate in (here.parent / "sbatch", here.parents[2] / "sbatch"):
        if (candidate / "common.sh").is_file():
            return candidate
    return here.parents[2] / "sbatch"  # named in the error when a template cannot be read


SBATCH_DIR = sbatch_dir()
TEMPLATES = {"train-eval": "train_eval.sbatch", "backfill": "backfill.sbatch", "service": "eval_service.sbatch"}


@dataclass
class Prepared:
    """A rendered batch script and where it goes."""

    kind: str
    script: str
    run_dirs: list[Path]
    log_dir: Path
    dry_run: bool = False
    sbatch_args: list[str] = field(default_factory=list)
    before_submit: Callable[[], object] | None = None  # writes what the job needs (not on --dry-run)

    @property
    def run_dir(self) -> Path:
        return self.run_dirs[0]


# ---------------------------------------------------------------------------------------- parsing
_positive, _non_negative = positive_int, non_negative_int


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.replace("_", "").isalnum() or key[0].isdigit():
        raise argparse.ArgumentTypeError(f"--env wants NAME=VALUE, got {text!r}")
    return key, value


def _add_common(p: argparse.ArgumentParser, *, signal_before: int, workers: int) -> None:
    g = p.add_argument_group("scheduler")
    g.add_argument("--partition", help="partition (every component unless overridden)")
    g.add_argument("--account", help="account to charge (sbatch --account)")
    g.add_argument("--qos", help="quality of service (sbatch --qos)")
    g.add_argument("--time", type=time_limit, metavar="T",
                   help="time limit, sbatch syntax (MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]], e.g. 4:00:00); must be "
                   "longer than --signal-before, which is when USR1 comes")
    g.add_argument("--job-name", help="job name (default ckpteval-<kind>)")
    g.add_argument("--output", help="log file pattern (default RUN/slurm/%%x-%%j.out)")
    g.add_argument("--signal-before", type=_positive, default=signal_before, metavar="S",
                   help=f"USR1 this many seconds before the time limit (default {signal_before})")
    g.add_argument("--grace", type=_positive, default=60, metavar="S",
                   help="how long the script waits for its steps after a stop (default 60)")
    g.add_argument("--sbatch-arg", action="append", default=[], metavar="OPT",
                   help="an extra job-wide #SBATCH option, e.g. --mail-type=END (repeatable)")
    g.add_argument("--env", action="append", type=_env_pair, default=[], metavar="NAME=VALUE",
                   help="export NAME=VALUE in the job (repeatable)")
    w = p.add_argument_group("eval workers")
    w.add_argument("--engine", default="auto", metavar="SPEC",
                   help="worker --engine spec: hf | http:URL | sglang | fn:mod:Class | auto (default: auto, "
                   "resolved by each worker on its node: sglang where it is importable and the worker has GPUs "
                   "allocated, hf otherwise, e.g. with --gpus-per-worker 0)")
    w.add_argument("--device", help="worker --device (default cuda with GPUs, cpu without)")
    w.add_argument("--workers", type=_positive, default=workers, metavar="N", help=f"eval workers (default {workers})")
    w.add_argument("--gpus-per-worker", type=_non_negative, default=1, metavar="N",
                   help="GPUs per worker (0: CPU workers; default 1)")
    w.add_argument("--cpus", type=_positive, default=8, metavar="N", help="CPUs per node for the workers (default 8)")
    w.add_argument("--mem", help="memory per node for the workers, sbatch syntax")
    w.add_argument("--constraint", help="node features for the workers (sbatch --constraint)")
    w.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="an extra worker argument (repeatable; e.g. --worker-arg=--verify=full)")
    w.add_argument("--judge-url", metavar="URL", type=http_url,
                   help="the judge of judged datasets without their own url: an OpenAI base URL "
                   "(http://host:port/v1), handed to every worker as --judge-url")
    x = p.add_argument_group("installation")
    x.add_argument("--python", default=sys.executable, metavar="PATH", help="interpreter with ckpteval installed (default: this one)")
    x.add_argument("--sbatch-dir", type=Path, default=SBATCH_DIR, metavar="DIR",
                   help="dir holding the templates and common.sh (default: the ones shipped with ckpteval)")
    p.add_argument("--dry-run", action="store_true", help="print the script and the sbatch command; submit nothing")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ckpteval submit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="kind", required=True)

    t = sub.add_parser("train-eval", help="trainer + eval fleet as one heterogeneous job",
                       description="Trailing arguments after -- go to the trainer.")
    t.add_argument("--run-dir", type=Path, required=True, metavar="RUN", help="the run directory the trainer creates")
    _add_common(t, signal_before=300, workers=2)
    c = t.add_argument_group("trainer (component 0)")
    c.add_argument("--trainer-partition", help="the trainer's partition (default --partition)")
    c.add_argument("--trainer-cpus", type=_positive, default=8, metavar="N", help="CPUs for the trainer (default 8)")
    c.add_argument("--trainer-gpus", type=_non_negative, default=0, metavar="N", help="GPUs for the trainer (default 0)")
    c.add_argument("--trainer-mem", help="memory for the trainer, sbatch syntax")
    c.add_argument("--train-cmd", help="run this trainer instead of `ckpteval train` (flags are yours)")
    f = t.add_argument_group("fleet (component 1)")
    f.add_argument("--fleet-partition", help="the fleet's partition (default --partition)")
    f.add_argument("--fleet-nodes", type=_positive, default=1, help="nodes of the eval fleet (default 1)")
    add_judge_flags(t)
    t.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then arguments for the trainer")

    b = sub.add_parser("backfill", help="array job evaluating every pending unit of finished runs")
    b.add_argument("--run-dir", type=Path, action="append", required=True, metavar="RUN",
                   help="a run to backfill (repeatable: task k takes run k mod #runs)")
    b.add_argument("--tasks", type=_positive, default=1, metavar="N", help="array tasks (default 1)")
    b.add_argument("--parallelism", type=_positive, metavar="P", help="at most P tasks at once (--array=0-N%%P)")
    b.add_argument("--backfill-cmd", choices=("backfill", "worker"), default="backfill",
                   help="ckpteval backfill (progress bar) or worker --once --catchup all")
    r = b.add_argument_group("re-evaluating another run (ckpteval backfill --from-run)")
    r.add_argument("--from-run", type=Path, metavar="OLD",
                   help="create the one --run-dir as a re-evaluation of OLD's snapshots before submitting")
    r.add_argument("--eval-config", type=Path, metavar="FILE", help="with --from-run: the benchmark to evaluate")
    r.add_argument("--steps", metavar="S", help="with --from-run: all, latest, N, START:STOP[:EVERY], comma list")
    _add_common(b, signal_before=120, workers=1)

    s = sub.add_parser("service", help="long-running worker(s) watching a checkpoint dir",
                       description="Trailing arguments after -- go to the worker.")
    s.add_argument("--run-dir", type=Path, required=True, metavar="RUN",
                   help="the service's run directory (created from --eval-config if it has no run.json)")
    s.add_argument("--watch", type=Path, action="append", required=True, metavar="DIR",
                   help="checkpoint dir to watch (repeatable)")
    s.add_argument("--eval-config", type=Path, metavar="FILE", help="creates RUN/run.json if missing (worker --eval-config)")
    s.add_argument("--nodes", type=_positive, default=1, metavar="N", help="nodes of the service (default 1)")
    _add_common(s, signal_before=300, workers=1)
    s.add_argument("worker_args", nargs=argparse.REMAINDER, help="-- then extra worker arguments")
    return parser


def train_cmd_words(command: str | None) -> list[str] | None:
    """``--train-cmd`` split as a shell would (``'cfg a.yaml'`` stays one word), written into the script as a
    bash array so the job runs exactly these words; ValueError for unbalanced quotes or an empty command."""
    if command is None:
        return None
    try:
        words = shlex.split(command)
    except ValueError as e:
        raise ValueError(f"--train-cmd {command!r}: {e}") from None
    if not words:
        raise ValueError("--train-cmd is empty: give the trainer's command line")
    return words


def _abs(path: Path) -> Path:
    return Path(os.path.abspath(Path(path).expanduser()))


def _prepare_train_eval(args: argparse.Namespace) -> Prepared:
    run = _abs(args.run_dir)
    log_dir = run / "slurm"
    output = args.output or str(log_dir / "%x-%j.out")
    gpn = fleet_gpus_per_node(args.workers, args.fleet_nodes, args.gpus_per_worker)
    trainer = component(args, partition=args.trainer_partition or args.partition, nodes=1, cpus=args.trainer_cpus,
                        gpus_per_node=args.trainer_gpus, mem=args.trainer_mem)
    fleet = component(args, partition=args.fleet_partition or args.partition, nodes=args.fleet_nodes, cpus=args.cpus,
                      gpus_per_node=gpn, mem=args.mem, constraint=args.constraint)
    judge_cmd = judge_command(args)
    settings = settings_lines(args, {
        "CKPTEVAL_RUN_DIR": run,
        "CKPTEVAL_TRAIN_CMD": train_cmd_words(args.train_cmd),
        "CKPTEVAL_TRAIN_ARGV": trailing(args.trainer_args),
        "CKPTEVAL_JUDGE_CMD": judge_cmd,
    })
    components = [job_lines(args, "ckpteval-train-eval", output) + trainer, fleet]
    if judge_cmd is not None:
        components.append(component(args, partition=args.judge_partition or args.partition, nodes=1,
                                    cpus=args.judge_cpus, gpus_per_node=args.judge_gpus if args.judge_model else 0,
                                    mem=args.judge_mem))
    script = render(_template(args, "train-eval"), components, settings)
    return Prepared("train-eval", script, [run], log_dir)


def _reeval_step(args: argparse.Namespace) -> Callable[[], object] | None:
    """With ``--from-run``: validate the re-evaluation now, and create its run just before sbatch."""
    if args.from_run is None:
        if args.eval_config is not None or args.steps is not None:
            raise ValueError("--eval-config and --steps re-evaluate another run: give --from-run OLD")
        return None
    if len(args.run_dir) != 1 or args.eval_config is None:
        raise ValueError("--from-run needs exactly one --run-dir (the new run) and --eval-config FILE")
    from ckpteval.jobs.eval.worker.reeval import create_reeval_run, plan_reeval

    plan = plan_reeval(args.run_dir[0], args.from_run, args.eval_config, "all" if args.steps is None else args.steps)
    return lambda: create_reeval_run(plan)


def _prepare_backfill(args: argparse.Namespace) -> Prepared:
    create = _reeval_step(args)
    runs = [_abs(r) for r in runs_with_work(args)]
    log_dir = runs[0] / "slurm"
    output = args.output or str(log_dir / "%x-%A_%a.out")
    array = f"0-{args.tasks - 1}" + (f"%{args.parallelism}" if args.parallelism else "")
    gpn = args.workers * args.gpus_per_worker
    comp = component(args, partition=args.partition, nodes=1, cpus=args.cpus, gpus_per_node=gpn, mem=args.mem,
                     constraint=args.constraint)
    settings = settings_lines(args, {
        "CKPTEVAL_RUN_DIRS": [str(r) for r in runs],
        "CKPTEVAL_BACKFILL_CMD": args.backfill_cmd,
    })
    lines = job_lines(args, "ckpteval-backfill", output) + [f"--array={array}"] + comp
    script = render(_template(args, "backfill"), [lines], settings)
    return Prepared("backfill", script, runs, log_dir, before_submit=create)


def _prepare_service(args: argparse.Namespace) -> Prepared:
    run = _abs(args.run_dir)
    log_dir = run / "slurm"
    output = args.output or str(log_dir / "%x-%j.out")
    gpn = fleet_gpus_per_node(args.workers, args.nodes, args.gpus_per_worker)
    comp = component(args, partition=args.partition, nodes=args.nodes, cpus=args.cpus, gpus_per_node=gpn,
                     mem=args.mem, constraint=args.constraint)
    settings = settings_lines(args, {
        "CKPTEVAL_RUN_DIR": run,
        "CKPTEVAL_WATCH_DIRS": [str(_abs(w)) for w in args.watch],
        "CKPTEVAL_EVAL_CONFIG": _abs(args.eval_config) if args.eval_config else None,
        "CKPTEVAL_WORKER_ARGV": worker_argv(args) + trailing(args.worker_args),
    })
    lines = job_lines(args, "ckpteval-service", output) + comp
    return Prepared("service", render(_template(args, "service"), [lines], settings), [run], log_dir)


def _template(args: argparse.Namespace, kind: str) -> str:
    path = Path(args.sbatch_dir) / TEMPLATES[kind]
    try:
        return path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read the template {path}: {e.strerror}") from None


PREPARERS = {"train-eval": _prepare_train_eval, "backfill": _prepare_backfill, "service": _prepare_service}


def prepare(argv: Sequence[str]) -> Prepared:
    """Parse ``submit`` arguments (kind first), check them, render the script; ValueError on bad settings."""
    args = build_parser().parse_args(list(argv))
    check_on_submit_host(args, TEMPLATES)
    prepared = PREPARERS[args.kind](args)
    prepared.dry_run = args.dry_run
    return prepared


# ------------------------------------------------------------------------------------- submitting
def parse_job_id(sbatch_stdout: str) -> str:
    """``sbatch --parsable`` prints ``id`` or ``id;cluster``."""
    line = sbatch_stdout.strip().splitlines()[-1] if sbatch_stdout.strip() else ""
    job_id = line.split(";")[0].strip()
    if not job_id.isdigit():
        raise RuntimeError(f"sbatch did not print a job id: {sbatch_stdout!r}")
    return job_id


def script_path(prepared: Prepared) -> Path:
    """Where the rendered script is saved (``RUN/slurm/<kind>-<time>-<pid>.sbatch``)."""
    return prepared.log_dir / f"{prepared.kind}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.sbatch"


def sbatch_command(prepared: Prepared, path: Path, sbatch: str = "sbatch") -> list[str]:
    return [sbatch, "--parsable", *prepared.sbatch_args, str(path)]


def submit_prepared(prepared: Prepared, *, sbatch: str = "sbatch", env: dict[str, str] | None = None) -> str:
    """Save the script under the run's ``slurm/`` dir, ``sbatch --parsable`` it, return the job id."""
    prepared.log_dir.mkdir(parents=True, exist_ok=True)
    path = script_path(prepared)
    path.write_text(prepared.script)  # mode from the user's umask: sbatch reads it, nothing executes it
    cmd = sbatch_command(prepared, path, sbatch)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=prepared.log_dir, env=env, timeout=120)
    except FileNotFoundError:
        raise RuntimeError(f"{sbatch!r} not found: is SLURM installed here?") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return parse_job_id(proc.stdout)


def _how_to_watch(prepared: Prepared, job_id: str) -> str:
    log = "%x-%A_%a.out" if prepared.kind == "backfill" else "%x-%j.out"
    runs = " ".join(shlex.quote(str(r)) for r in prepared.run_dirs)
    return "\n".join([
        f"ckpteval submit: submitted {prepared.kind} as SLURM job {job_id}; to follow it:",
        f"  squeue -j {job_id}            # queue state",
        f"  ckpteval status {runs}   # points, units, leases",
        f"  logs: {prepared.log_dir}/ ({log})",
        f"  scancel {job_id}              # stop it (workers release their leases)",
    ])


def main(argv: list[str]) -> int:
    try:
        prepared = prepare(argv)
    except NothingToDo as e:
        print(f"ckpteval submit: {e}", file=sys.stderr)
        return 0
    except (ValueError, FileNotFoundError) as e:
        return fail("ckpteval submit", e)
    if prepared.dry_run:
        print(prepared.script, end="")
        print(f"# would save the script above as {shlex.quote(str(script_path(prepared)))} and run: "
              f"{shlex.join(sbatch_command(prepared, script_path(prepared)))}", file=sys.stderr)
        return 0
    try:
        if prepared.before_submit is not None:
            prepared.before_submit()
        job_id = submit_prepared(prepared)
    except (RuntimeError, OSError) as e:
        print(f"ckpteval submit: {e}", file=sys.stderr)
        return 1
    if sys.stdout.isatty():  # a person: the id with what it is and how to follow it, not a bare number
        print(_how_to_watch(prepared, job_id), flush=True)
    else:  # captured (JOB=$(ckpteval submit ...)): the id alone on stdout, the rest for the person on stderr
        print(job_id, flush=True)
        print(_how_to_watch(prepared, job_id), file=sys.stderr)
    return 0
