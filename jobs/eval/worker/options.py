"""The eval worker's options: one dataclass whose fields declare the flags (:mod:`ckpteval.jobs.flags`).

Shared by ``ckpteval worker`` and ``ckpteval backfill`` (which fixes ``--once``/``--catchup``). Defaults,
help texts and bounds are written once, on the fields; :func:`validate_options` adds the rules that
join several flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpteval.coord.layouts import layout_choices, resolve_layout
from ckpteval.jobs.eval.engines.factory import ENGINES, normalize_spec, spec_kind
from ckpteval.jobs.eval.proof.canary import CANARY_MAX_DIFF_NARROWER, CANARY_MAX_DIFF_SAME_DTYPE
from ckpteval.jobs.flags import (
    META_KEY,
    accept_positional_run_dir,
    add_options,
    check_bounds,
    from_args,
    http_url,
    option,
)
from ckpteval.jobs.metrics import check_wandb_login
from ckpteval.jobs.pathchecks import check_watch_dir

INGESTION = "logging finished points into the training run's wandb run"
# Flags of this group are the scorers' (a sandbox's concurrency, a judge URL override): handed to every
# scorer in ScorerContext.options by field name (:func:`scorer_options`); add a field with group=SCORING.
SCORING = "scoring (settings the scorers read)"
DEVICE_RE = re.compile(r"^(cpu|cuda|mps|xpu)(:\d+)?$")


@dataclass
class WorkerOptions:
    run_dir: Path = option(help="the run directory (holds run.json)", metavar="RUN")
    engines: tuple[str, ...] = option(
        ("hf",), "engine backend: hf | http:URL (or http://HOST:PORT) | sglang | fn:module:Class | auto (sglang if importable and "
        "--device cuda has GPUs, else hf; decided at start) (repeat for several engines)",
        flag="--engine", metavar="SPEC")
    replicas: int = option(1, "instances of each --engine, pooled as one (all must report the version)",
                           flag="--engines", metavar="N", min=1)
    device: str = option("cpu", "device for in-process engines: cpu, cuda, cuda:N", metavar="DEV")
    once: bool = option(False, "one pass over the snapshots present, then exit")
    catchup: str = option("all", "evaluate every step (all) or only the newest discovered one (latest)",
                          choices=("all", "latest"))
    max_units: int | None = option(None, "exit after writing N results", metavar="N", min=1)
    watch: tuple[Path, ...] = option(
        (), "service mode: also evaluate any trainer's checkpoints in DIR (marker-less after quiescence; "
        "repeatable)", metavar="DIR")
    layout: str = option(
        "auto", "how the trainer lays out its saves under --watch / foreign roots: where the HF weights are and "
        "its own 'save finished' signal (auto: detected; refused when ambiguous; see docs/USER_GUIDE.md)",
        choices=layout_choices(), metavar="NAME")
    quiescence_s: float = option(30.0, "seconds a marker-less checkpoint must stay unchanged before it is "
                                 "admitted", flag="--quiescence", metavar="S", min=0)
    eval_config: Path | None = option(None, "create RUN/run.json from this JSON eval config if the run does "
                                      "not exist (with --watch DIR; backfill: or with --from-run OLD)", metavar="FILE")
    newest_first: bool = option(False, "claim the newest step's units first")
    poll_interval_s: float = option(2.0, "seconds between polls of the snapshot roots and results/",
                                    flag="--poll-interval", metavar="S", gt=0)
    verify: str = option("fast", "snapshot check before each unit: sizes + headers (fast) or also "
                         "checksums (full)", choices=("fast", "full"))
    worker_id: str | None = option(None, "a name recorded in every result this worker writes "
                                   "(default: host:pid)", metavar="NAME")
    pin_timeout_s: float = option(60.0, "how long to wait for the engine to report the loaded version",
                                  flag="--pin-timeout", metavar="S", gt=0)
    load_timeout_s: float = option(600.0, "bound on one weight load or engine restart",
                                   flag="--load-timeout", metavar="S", gt=0)
    canary_max_diff: float | None = option(
        None, "a unit whose canary (teacher-forced log-probs the trainer stored with the snapshot) differs from "
        "the engine's by more than S fails it: skipped canary_failed, or only flagged (run.json eval.canary.on_fail); "
        "0: record eval/fidelity/* only; overrides run.json eval.canary.max_abs_logprob_diff (default: that, else "
        f"{CANARY_MAX_DIFF_SAME_DTYPE:g} for an engine in the trainer's dtype, {CANARY_MAX_DIFF_NARROWER:g} for a "
        "narrower one)", flag="--canary-max-diff", metavar="S", min=0)
    max_unhealthy: int = option(5, "exit with code 4 after N consecutive unhealthy units (0: never)",
                                metavar="N", min=0)
    max_attempts: int = option(
        3, "a unit whose evaluation fails (engine dead, crashed) is released for another worker; its skip is "
        "written only by a worker that has scored a unit of this run and after N claims of it, or once "
        "training is done and N lease durations have passed", metavar="N", min=1)
    retry_infra_skips: bool = option(
        False, "re-evaluate units skipped for an outside service's failure (judge_failed, sandbox_failed, "
        "env_failed, overloaded), once each, superseding the skip (ckpteval backfill always does)")
    retry_backoff_s: float = option(
        60.0, "an overloaded skip (an inference server shedding load) is re-evaluated no sooner than S x 2^k "
        "seconds after it was written, k its retry generation, so a fleet does not hammer the server",
        flag="--retry-backoff", metavar="S", min=0)
    keep_completions: bool = option(
        True, "do not keep the completions (default: every sample's text, finish reason, tokens, seed and version "
        "is kept gzip'd beside its result, for ckpteval rescore; about 0.4 KB per 256-token sample, 5 KB per "
        "4,096-token one: docs/USER_GUIDE.md)", flag="--no-keep-completions")
    completion_store: Path | None = option(
        None, "a completion store shared across runs (a directory on the shared filesystem): a unit whose "
        "content key (weights' digests, rows, sampling, seeds, prompts, engine) is stored is answered from it "
        "without loading an engine, and every unit generated here is stored", metavar="DIR")
    wait_for_run_s: float = option(0.0, "wait up to S seconds for RUN/run.json to appear (a fleet started "
                                   "before its trainer)", flag="--wait-for-run", metavar="S", min=0)
    trust_run_code: bool = option(
        False, "import scorer code named by run.json (module:function) even when run.json or the run dir "
        "is writable by other users (see docs/PROTOCOL.md, 'Who may run code in an eval process')")
    sandbox_concurrency: int = option(
        0, "code sets: programs run at once in this worker's sandbox pool (0: min(4, this process's CPUs))",
        metavar="N", min=0, group=SCORING)
    unsafe_code_rlimits_only: bool = option(
        False, "code sets on a node where bwrap cannot start: run programs with rlimits and a deadline only, "
        "WITHOUT isolation (they can read/write what this user can, open connections); recorded in every "
        "result", group=SCORING)
    judge_url: str | None = option(
        None, "the judge of judged datasets that name no url of their own: an OpenAI base URL "
        "(http://host:port/v1); overrides RUN/judge.json", metavar="URL", parse=http_url, group=SCORING)
    wandb: bool = option(False, "log each finished point into the training run's wandb run (needs "
                         "--wandb-run-id)", group=INGESTION)
    wandb_run_id: str | None = option(None, "the training run's wandb id", metavar="ID", group=INGESTION)
    wandb_mode: str = option("shared", "join the run as a shared (concurrent, non-primary) writer, or "
                             "resume it after training", choices=("resume", "shared"), group=INGESTION)

    @property
    def service(self) -> bool:
        return bool(self.watch)


def scorer_options(opts: WorkerOptions | None = None) -> dict[str, Any]:
    """The :data:`SCORING` group's fields by name: ``opts``' values, or (None: the trainer's shared
    posture, which has no worker flags) their defaults."""
    out = {}
    for f in dataclasses.fields(WorkerOptions):
        meta = f.metadata.get(META_KEY)
        if meta is None or meta.group != SCORING:
            continue
        if opts is not None:
            out[f.name] = getattr(opts, f.name)
        else:
            out[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    return out


def add_worker_flags(parser: argparse.ArgumentParser, *, pass_flags: bool = True) -> None:
    """The worker's flags; ``pass_flags=False`` leaves out --once/--catchup/--retry-infra-skips (backfill
    fixes them)."""
    add_options(parser, WorkerOptions, exclude=() if pass_flags else ("once", "catchup", "retry_infra_skips"))
    accept_positional_run_dir(parser)


def options_from_args(args: argparse.Namespace) -> WorkerOptions:
    opts: WorkerOptions = from_args(WorkerOptions, args)
    validate_options(opts)
    return opts


def validate_options(opts: WorkerOptions) -> None:
    """The declared bounds plus the rules joining several flags; ValueError names the flag."""
    check_bounds(opts)
    if not DEVICE_RE.match(opts.device):
        raise ValueError(f"--device {opts.device!r}: expected cpu, cuda, cuda:N (or mps, xpu)")
    opts.engines = tuple(normalize_spec(spec) for spec in opts.engines)  # http://HOST:PORT -> http:http://...
    for spec in opts.engines:
        spec_kind(spec)
    if Path(opts.run_dir).exists() and not Path(opts.run_dir).is_dir():
        raise ValueError(f"--run-dir {opts.run_dir}: not a directory")
    for watch in map(Path, opts.watch):
        check_watch_dir(watch)
        resolve_layout(watch, opts.layout)  # --layout auto over a dir holding saves of two trainers: refused
    if opts.eval_config is not None and not opts.watch:
        raise ValueError("--eval-config creates a service run: give the checkpoint dir with --watch DIR")
    if opts.wandb and not opts.wandb_run_id:
        raise ValueError("--wandb: the service logs into the training run; give its id with --wandb-run-id ID")
    if opts.wandb:
        check_wandb_login()  # before anything is written: no login is one line
    unit_backends = [s for s in opts.engines if s != "auto" and ENGINES[spec_kind(s)].unit_backend]
    if unit_backends and (len(opts.engines) > 1 or opts.replicas > 1):
        raise ValueError(
            "an fn: backend scores whole units: give exactly one --engine fn:... and no --engines N"
        )
