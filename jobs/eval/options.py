"""The eval worker's options: one dataclass, its flags, and their validation.

Shared by ``ckpteval worker`` and ``ckpteval backfill`` (which fixes ``--once``/``--catchup``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path


@dataclass
class WorkerOptions:
    run_dir: Path
    engines: tuple[str, ...] = ("hf",)
    replicas: int = 1
    device: str = "cpu"
    once: bool = False
    catchup: str = "all"
    max_units: int | None = None
    watch: tuple[Path, ...] = ()
    quiescence_s: float = 30.0
    eval_config: Path | None = None
    newest_first: bool = False
    poll_interval_s: float = 2.0
    verify: str = "fast"
    worker_id: str | None = None
    pin_timeout_s: float = 60.0
    load_timeout_s: float = 600.0
    max_unhealthy: int = 5
    wandb: bool = False
    wandb_run_id: str | None = None
    wandb_mode: str = "shared"

    @property
    def service(self) -> bool:
        return bool(self.watch)


def add_worker_flags(parser: argparse.ArgumentParser, *, pass_flags: bool = True) -> None:
    """The worker's flags; ``pass_flags=False`` leaves out --once/--catchup (backfill fixes them)."""
    p = parser
    p.add_argument("--run-dir", type=Path, required=True, help="the run directory (holds run.json)")
    p.add_argument(
        "--engine",
        action="append",
        dest="engines",
        metavar="SPEC",
        help="hf | http:URL | sglang | fn:module:Class | auto (sglang if importable and --device cuda "
        "has GPUs, else hf; decided at start) (repeat for several engines; default hf)",
    )
    p.add_argument(
        "--engines",
        type=int,
        default=1,
        dest="replicas",
        metavar="N",
        help="instances of each --engine, pooled as one (all must report the version)",
    )
    p.add_argument("--device", default="cpu", help="device for in-process engines (cpu, cuda, cuda:1)")
    if pass_flags:
        p.add_argument("--once", action="store_true", help="one pass over the snapshots present, then exit")
        p.add_argument(
            "--catchup",
            choices=("all", "latest"),
            default="all",
            help="evaluate every step (all) or only the newest discovered one (latest)",
        )
    p.add_argument("--max-units", type=int, default=None, metavar="N", help="exit after writing N results")
    p.add_argument(
        "--watch",
        action="append",
        type=Path,
        default=[],
        metavar="DIR",
        help="service mode: also evaluate any trainer's checkpoints in DIR (marker-less after quiescence)",
    )
    p.add_argument(
        "--quiescence",
        type=float,
        default=30.0,
        dest="quiescence_s",
        metavar="S",
        help="seconds a marker-less checkpoint must stay unchanged before it is admitted",
    )
    p.add_argument(
        "--eval-config",
        type=Path,
        default=None,
        metavar="FILE",
        help="create RUN/run.json from this JSON eval config if the run does not exist",
    )
    p.add_argument("--newest-first", action="store_true", help="claim the newest step's units first")
    p.add_argument("--poll-interval", type=float, default=2.0, dest="poll_interval_s", metavar="S")
    p.add_argument(
        "--verify",
        choices=("fast", "full"),
        default="fast",
        help="snapshot check before each unit: sizes + headers (fast) or also checksums (full)",
    )
    p.add_argument("--worker-id", default=None, help="a name recorded in every result this worker writes")
    p.add_argument(
        "--pin-timeout",
        type=float,
        default=60.0,
        dest="pin_timeout_s",
        metavar="S",
        help="how long to wait for the engine to report the loaded version",
    )
    p.add_argument(
        "--load-timeout",
        type=float,
        default=600.0,
        dest="load_timeout_s",
        metavar="S",
        help="bound on one weight load or engine restart",
    )
    p.add_argument(
        "--max-unhealthy",
        type=int,
        default=5,
        metavar="N",
        help="exit with code 4 after N consecutive unhealthy units (0: never)",
    )
    w = parser.add_argument_group("service ingestion (external-service posture)")
    w.add_argument("--wandb", action="store_true",
                   help="log each finished point into the training run's wandb run (needs --wandb-run-id)")
    w.add_argument("--wandb-run-id", default=None, help="the training run's wandb id")
    w.add_argument("--wandb-mode", choices=("resume", "shared"), default="shared",
                   help="join the run as a shared (concurrent, non-primary) writer, or resume it after training")


def options_from_args(args: argparse.Namespace) -> WorkerOptions:
    opts = WorkerOptions(
        run_dir=args.run_dir,
        engines=tuple(args.engines or ("hf",)),
        replicas=args.replicas,
        device=args.device,
        once=getattr(args, "once", False),
        catchup=getattr(args, "catchup", "all"),
        max_units=args.max_units,
        watch=tuple(args.watch),
        quiescence_s=args.quiescence_s,
        eval_config=args.eval_config,
        newest_first=args.newest_first,
        poll_interval_s=args.poll_interval_s,
        verify=args.verify,
        worker_id=args.worker_id,
        pin_timeout_s=args.pin_timeout_s,
        load_timeout_s=args.load_timeout_s,
        max_unhealthy=args.max_unhealthy,
        wandb=getattr(args, "wandb", False),
        wandb_run_id=getattr(args, "wandb_run_id", None),
        wandb_mode=getattr(args, "wandb_mode", "shared"),
    )
    validate_options(opts)
    return opts


def validate_options(opts: WorkerOptions) -> None:
    if opts.replicas < 1:
        raise ValueError(f"--engines must be >= 1, got {opts.replicas}")
    if opts.max_units is not None and opts.max_units < 1:
        raise ValueError(f"--max-units must be >= 1, got {opts.max_units}")
    for name in ("poll_interval_s", "pin_timeout_s", "load_timeout_s"):
        if getattr(opts, name) <= 0:
            raise ValueError(f"--{name[:-2].replace('_', '-')} must be > 0")
    if opts.quiescence_s < 0 or opts.max_unhealthy < 0:
        raise ValueError("--quiescence and --max-unhealthy must be >= 0")
    if opts.catchup not in {"all", "latest"} or opts.verify not in {"fast", "full"}:
        raise ValueError("--catchup must be all|latest and --verify fast|full")
    if opts.wandb and not opts.wandb_run_id:
        raise ValueError("--wandb: the service logs into the training run; give its id with --wandb-run-id ID")
    fn_specs = [s for s in opts.engines if s.startswith("fn:")]
    if fn_specs and (len(opts.engines) > 1 or opts.replicas > 1):
        raise ValueError(
            "an fn: backend scores whole units: give exactly one --engine fn:... and no --engines N"
        )
