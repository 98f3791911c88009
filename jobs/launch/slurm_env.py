"""What SLURM tells a job about itself: heterogeneous-job components, node lists, GPU slices.

Owns the reading of SLURM's job environment for ckpteval's batch scripts and the trainer:

- :func:`expand_hostlist` turns SLURM's compressed host lists (``n[1-3,5]``, ``gpu-[01-02]-ib``,
  ``a[1-2]b[3-4]``, comma-separated mixes) into node names, in SLURM's order, without calling
  ``scontrol`` (the batch scripts run it on compute nodes where only the environment is certain).
- :func:`read_job` reads the leader's id (``SLURM_JOB_ID``), ``SLURM_HET_SIZE`` and, per component
  ``n``, ``SLURM_JOB_ID_HET_GROUP_<n>`` and ``SLURM_JOB_NODELIST_HET_GROUP_<n>``; a plain job is one
  component made of ``SLURM_JOB_ID`` / ``SLURM_JOB_NODELIST``.
- :func:`dispatch_nodes` is the hook for :class:`ckpteval.jobs.trainer.config.DispatchConfig` ``trainer_nodes`` /
  ``fleet_nodes`` (which decide whether a node-local staging dir such as ``/dev/shm`` is allowed):
  explicit ``CKPTEVAL_TRAINER_NODES`` / ``CKPTEVAL_FLEET_NODES`` win (host-list syntax accepted),
  else het-group 0 is the trainer and het-group 1 the fleet.
- :func:`gpu_slice` picks one worker's share of the step's ``CUDA_VISIBLE_DEVICES``.

Command line (used by ``sbatch/*.sbatch``; no torch import, starts in milliseconds)::

    python -m ckpteval.jobs.launch.slurm_env hostnames 'n[1-3]'          # one name per line
    python -m ckpteval.jobs.launch.slurm_env nodes --group 1             # het group 1's nodes (or the job's)
    python -m ckpteval.jobs.launch.slurm_env exec --slot K --gpus G -- CMD ARGS...
        # CUDA_VISIBLE_DEVICES := slot K's G devices of the visible ones, then exec CMD

Limits: pure parsing of what SLURM exported; it never asks slurmctld. A host list with more than one
bracket group is expanded as their cartesian product (SLURM's meaning); ranges are inclusive and keep
the zero padding of their lower bound.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside ``[...]``."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"host list {text!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError(f"host list {text!r}: unbalanced '['")
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _expand_ranges(spec: str, whole: str) -> list[str]:
    out = []
    for item in spec.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise ValueError(f"host list {whole!r}: bad range {item!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"host list {whole!r}: descending range {item!r}")
        width = len(lo)
        out += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return out


def _expand_one(pattern: str, whole: str) -> list[str]:
    start = pattern.find("[")
    if start < 0:
        return [pattern]
    end = pattern.find("]", start)
    if end < 0:
        raise ValueError(f"host list {whole!r}: unbalanced '['")
    head, spec, tail = pattern[:start], pattern[start + 1 : end], pattern[end + 1 :]
    return [head + v + rest for v in _expand_ranges(spec, whole) for rest in _expand_one(tail, whole)]


def expand_hostlist(text: str) -> list[str]:
    """``"n[1-3,5],gpu07"`` -> ``["n1", "n2", "n3", "n5", "gpu07"]``; duplicates are dropped."""
    seen: dict[str, None] = {}
    for part in _split_top_level(text or ""):
        for host in _expand_one(part, text):
            seen.setdefault(host, None)
    return list(seen)


@dataclass(frozen=True)
class Component:
    """One component of a (possibly heterogeneous) job."""

    index: int
    job_id: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class JobInfo:
    """The job as its environment describes it; ``components[0]`` is the leader's component."""

    job_id: str
    het_size: int
    components: tuple[Component, ...]

    @property
    def heterogeneous(self) -> bool:
        return self.het_size > 1

    def component(self, index: int) -> Component:
        for comp in self.components:
            if comp.index == index:
                return comp
        raise ValueError(f"job {self.job_id} has no het group {index} (SLURM_HET_SIZE={self.het_size})")


def read_job(environ: Mapping[str, str] | None = None) -> JobInfo | None:
    """The SLURM job this process runs in, or None outside SLURM (no ``SLURM_JOB_ID``)."""
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    raw_size = env.get("SLURM_HET_SIZE", "")
    if not raw_size:
        nodes = tuple(expand_hostlist(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", ""))))
        return JobInfo(job_id, 1, (Component(0, job_id, nodes),))
    try:
        size = int(raw_size)
    except ValueError:
        raise ValueError(f"SLURM_HET_SIZE={raw_size!r} is not an integer") from None
    comps = []
    for n in range(size):
        nodelist = env.get(f"SLURM_JOB_NODELIST_HET_GROUP_{n}")
        if nodelist is None:
            raise ValueError(f"SLURM_HET_SIZE={size} but SLURM_JOB_NODELIST_HET_GROUP_{n} is not set")
        comp_id = env.get(f"SLURM_JOB_ID_HET_GROUP_{n}", job_id if n == 0 else "")
        comps.append(Component(n, comp_id, tuple(expand_hostlist(nodelist))))
    return JobInfo(job_id, size, tuple(comps))


def dispatch_nodes(
    environ: Mapping[str, str] | None = None,
) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
    """``(trainer_nodes, fleet_nodes)`` for :class:`ckpteval.jobs.trainer.config.DispatchConfig`; None = unknown.

    ``CKPTEVAL_TRAINER_NODES`` / ``CKPTEVAL_FLEET_NODES`` (set by ``sbatch/train_eval.sbatch``) win;
    otherwise a heterogeneous job's group 0 is the trainer and group 1 the fleet, and a plain job
    gives its nodes as the trainer's and leaves the fleet unknown.
    """
    env = os.environ if environ is None else environ
    trainer = env.get("CKPTEVAL_TRAINER_NODES")
    fleet = env.get("CKPTEVAL_FLEET_NODES")
    t_nodes = tuple(expand_hostlist(trainer)) if trainer else None
    f_nodes = tuple(expand_hostlist(fleet)) if fleet else None
    job = read_job(env)
    if job is not None:
        if t_nodes is None:
            t_nodes = job.components[0].nodes or None
        if f_nodes is None and job.heterogeneous:
            f_nodes = job.component(1).nodes or None
    return t_nodes, f_nodes


def gpu_slice(visible: str | None, slot: int, per_worker: int) -> str | None:
    """Slot ``slot``'s ``per_worker`` devices of ``visible`` (a ``CUDA_VISIBLE_DEVICES`` value).

    Returns ``visible`` unchanged when it already holds exactly ``per_worker`` devices (SLURM bound
    them per task), None when there is nothing to slice (no GPUs, or ``per_worker == 0``). Raises
    ``ValueError`` when the slot's share is not there (more workers than GPUs).
    """
    if per_worker < 0 or slot < 0:
        raise ValueError(f"gpu_slice: slot {slot} and per_worker {per_worker} must be >= 0")
    if not visible or per_worker == 0:
        return None
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if len(devices) == per_worker:
        return ",".join(devices)
    share = devices[slot * per_worker : (slot + 1) * per_worker]
    if len(share) != per_worker:
        raise ValueError(
            f"worker slot {slot} needs GPUs {slot * per_worker}..{(slot + 1) * per_worker - 1} of "
            f"CUDA_VISIBLE_DEVICES={visible!r} ({len(devices)} visible): ask for more GPUs or fewer workers"
        )
    return ",".join(share)


# ------------------------------------------------------------------------------------------- CLI
def _cmd_hostnames(args: argparse.Namespace) -> int:
    for host in expand_hostlist(",".join(args.hostlist)):
        print(host)
    return 0


def _cmd_nodes(args: argparse.Namespace) -> int:
    job = read_job()
    if job is None:
        print("ckpteval.jobs.launch.slurm_env nodes: not inside a SLURM job (SLURM_JOB_ID unset)", file=sys.stderr)
        return 2
    comp = job.component(args.group) if job.heterogeneous else job.components[0]
    for host in comp.nodes:
        print(host)
    return 0


def _cmd_exec(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("ckpteval.jobs.launch.slurm_env exec: no command after --", file=sys.stderr)
        return 2
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    share = gpu_slice(visible, args.slot, args.gpus)
    if share is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = share
    elif args.gpus == 0 and visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU worker must not grab the node's GPUs
    os.environ["CKPTEVAL_WORKER_SLOT"] = str(args.slot)
    node = os.environ.get("SLURMD_NODENAME", os.uname().nodename)
    print(
        f"ckpteval: slot {args.slot} on {node}: CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}"
        f" (step saw {visible!r}); exec {' '.join(cmd[:6])}{' ...' if len(cmd) > 6 else ''}",
        file=sys.stderr,
        flush=True,
    )
    os.execvp(cmd[0], cmd)
    return 127  # not reached


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckpteval.jobs.launch.slurm_env", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    h = sub.add_parser("hostnames", help="expand SLURM host lists, one name per line")
    h.add_argument("hostlist", nargs="+")
    h.set_defaults(func=_cmd_hostnames)
    n = sub.add_parser("nodes", help="the nodes of het group N (of the job when not heterogeneous)")
    n.add_argument("--group", type=int, default=0)
    n.set_defaults(func=_cmd_nodes)
    e = sub.add_parser("exec", help="slice CUDA_VISIBLE_DEVICES for one worker slot, then exec CMD")
    e.add_argument("--slot", type=int, required=True)
    e.add_argument("--gpus", type=int, required=True, help="GPUs per worker (0: CPU worker)")
    e.add_argument("cmd", nargs=argparse.REMAINDER)
    e.set_defaults(func=_cmd_exec)
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return int(args.func(args))
    except ValueError as err:
        print(f"ckpteval.jobs.launch.slurm_env: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
