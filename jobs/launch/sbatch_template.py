"""The batch scripts' templates: the two marked blocks ``ckpteval submit`` fills in.

Every script in ``sbatch/`` holds one options block (``#SBATCH`` lines, one group per heterogeneous-job
component) and one settings block (``export CKPTEVAL_*=...`` lines); :func:`render` replaces both and
leaves the rest of the template as written; the lines of both blocks are built here from ``ckpteval submit``'s
arguments (:func:`component`, :func:`job_lines`, :func:`settings_lines`). Promise: a template without exactly one of each block is a
``ValueError`` naming the marker, never a script with a stale block.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from ckpteval.jobs.launch.submit_checks import check_sbatch_line, check_time_vs_signal

OPTIONS_BEGIN, OPTIONS_END = "# >>> ckpteval sbatch options", "# <<< ckpteval sbatch options"
SETTINGS_BEGIN, SETTINGS_END = "# >>> ckpteval settings", "# <<< ckpteval settings"


def replace_block(text: str, begin: str, end: str, body: list[str]) -> str:
    """Replace the lines between the marker lines starting with ``begin`` and ``end`` by ``body``."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(begin)]
    ends = [i for i, line in enumerate(lines) if line.startswith(end)]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ValueError(f"template: expected one block {begin!r} ... {end!r}")
    return "\n".join(lines[: starts[0] + 1] + body + lines[ends[0] :]) + "\n"


def render(template: str, sbatch_lines: list[list[str]], settings: list[str]) -> str:
    """The template with its options block set to ``sbatch_lines`` (one list per het component)."""
    header: list[str] = []
    for index, component in enumerate(sbatch_lines):
        if index:
            header.append("#SBATCH hetjob")
        header += [f"#SBATCH {line}" for line in component]
    text = replace_block(template, OPTIONS_BEGIN, OPTIONS_END, header)
    return replace_block(text, SETTINGS_BEGIN, SETTINGS_END, settings)


def component(args: argparse.Namespace, *, partition: str | None, nodes: int, cpus: int, gpus_per_node: int,
              mem: str | None, constraint: str | None = None) -> list[str]:
    """One heterogeneous-job component's ``#SBATCH`` lines (account, QOS and time limit: the job's);
    ValueError for a value that would break out of its line (:func:`check_sbatch_line`)."""
    lines = []
    for opt, value in (("partition", partition), ("account", args.account), ("qos", args.qos), ("time", args.time)):
        if value:
            check_sbatch_line(value, f"--{opt}")
            lines.append(f"--{opt}={value}")
    lines += [f"--nodes={nodes}", "--ntasks-per-node=1", f"--cpus-per-task={cpus}"]
    if gpus_per_node:
        lines.append(f"--gpus-per-node={gpus_per_node}")
    for opt, value in (("mem", mem), ("constraint", constraint)):
        if value:
            check_sbatch_line(value, f"--{opt}")
            lines.append(f"--{opt}={value}")
    return lines


def fleet_gpus_per_node(workers: int, nodes: int, gpus_per_worker: int) -> int:
    if workers < nodes:
        raise ValueError(f"--workers ({workers}) must be >= the fleet's nodes ({nodes}): a node would idle")
    per_node = -(-workers // nodes)
    return per_node * gpus_per_worker


def job_lines(args: argparse.Namespace, default_name: str, output: str) -> list[str]:
    """The job-wide ``#SBATCH`` lines every script gets (name, requeue, append, output, the USR1 signal) and
    ``--sbatch-arg``'s."""
    check_time_vs_signal(args)
    check_sbatch_line(output, "--output" if args.output else "--run-dir")
    check_sbatch_line(args.job_name or default_name, "--job-name")
    lines = [f"--job-name={args.job_name or default_name}", "--requeue", "--open-mode=append",
             f"--output={output}", f"--signal=B:USR1@{args.signal_before}"]
    for extra in args.sbatch_arg:
        if not extra.startswith("-"):
            raise ValueError(f"--sbatch-arg {extra!r}: give an sbatch option such as --mail-type=END")
        check_sbatch_line(extra, "--sbatch-arg")
        lines.append(extra)
    return lines


def settings_lines(args: argparse.Namespace, values: dict[str, str | Path | int | list[str] | None]) -> list[str]:
    """The settings block: the ``CKPTEVAL_*`` every script reads, then ``values`` (None: left out; a list: a
    bash array), then ``--env``'s, each value shell-quoted."""
    common: dict[str, str | Path | int | list[str] | None] = {
        "CKPTEVAL_PYTHON": args.python,
        "CKPTEVAL_SBATCH_DIR": Path(args.sbatch_dir).resolve(),
        "CKPTEVAL_ENGINE": args.engine,
        "CKPTEVAL_DEVICE": args.device,
        "CKPTEVAL_WORKERS": args.workers,
        "CKPTEVAL_GPUS_PER_WORKER": args.gpus_per_worker,
        "CKPTEVAL_GRACE_S": args.grace,
        "CKPTEVAL_WORKER_ARGV": worker_argv(args),
    }
    common.update(values)
    lines = []
    for name, value in common.items():
        if isinstance(value, list):
            lines.append(f"{name}=({' '.join(shlex.quote(str(v)) for v in value)})")
        elif value is not None:
            lines.append(f"export {name}={shlex.quote(str(value))}")
    return lines + [f"export {key}={shlex.quote(value)}" for key, value in args.env]


def worker_argv(args: argparse.Namespace) -> list[str]:
    return list(args.worker_arg) + (["--judge-url", args.judge_url] if args.judge_url else [])
