"""``ckpteval worker``: the eval worker — fleet member, long-running service, or one pass.

What it owns: the loop that turns snapshots into results. Each poll it discovers complete snapshots
under every root of ``run.json``'s ``snapshot_roots`` (plus ``--watch`` dirs), lists ``results/`` once,
and claims the first unfinished unit ``(step, dataset, shard)`` (oldest step first; ``--newest-first``
reverses; ``--catchup latest`` considers only the newest step). For a claimed unit it verifies the
snapshot, pins the engine to it, scores the unit, writes the result (first writer wins) and releases
the lease. Everything it evaluates is configured by ``run.json``; flags only say *how* to run.

Promises:

* **Every outcome is a result.** A unit ends as scores or as a skip record with a reason:
  ``ckpt_missing`` / ``ckpt_corrupt`` (snapshot gone or failing ``--verify``), ``pin_violation`` (the
  engine's version differs from the step after the load, after the unit, or on any sample),
  ``unhealthy`` (the engine stays dead after restart + reload + re-probe), ``crashed`` (scoring raised
  an engine, runtime, value or OS error), or a backend's own ``EvalSkip(reason)``. A load or scoring
  failure is checked against the snapshot once more: if it no longer verifies (deleted or damaged after
  the first check), the unit is that ``ckpt_missing`` / ``ckpt_corrupt`` skip, not ``unhealthy`` or
  ``crashed`` (which would blame, restart and eventually retire a healthy engine). The worker then
  moves on to the next unit.
* **Pinning.** The engine loads ``(snapshot, weight_version=str(step))`` only when its version differs;
  the version is read back (polled up to ``--pin-timeout``), every sample must carry it, and it is read
  again after the unit. With several engines (``--engines N`` or repeated ``--engine``) all must agree.
* **Health.** Before each unit the engine is probed (one-token generate); a dead one is restarted,
  reloaded and re-probed. Loads and restarts are bounded by ``--load-timeout``. After
  ``--max-unhealthy`` consecutive ``unhealthy`` units the worker exits with ``EXIT_UNHEALTHY`` so the
  scheduler can give it a fresh node (0 disables this).
* **Leases.** The claim's heartbeat runs while the unit runs. If the claim was lost (taken over after
  a stall), the worker writes *nothing* for the unit. Just before writing it also checks that the lease
  file still carries its token, narrowing the window in which a stalled worker can double-write (a rare
  double write lands in ``results/duplicates/``; readers take the first result).
* **Preemption.** SIGTERM or SIGUSR1 (SLURM's pre-timeout signal, ``--signal=USR1@T``): no new work is
  started, the current unit is abandoned and its lease released at once (a contender takes it over
  without waiting for expiry), and the worker exits with ``EXIT_PREEMPTED`` ("requeue me"). SIGINT
  does the same and exits with ``EXIT_INTERRUPTED``.

Exit (``EXIT_DONE``): fleet mode (default) once ``TRAINING_DONE`` exists and every unit of every
dispatched (``ledger.jsonl``) or discovered step has a result — a dispatched step whose snapshot no
poll has found for one lease duration after ``TRAINING_DONE`` (deleted before anyone saw it, a wiped
tmpfs, an unreadable marker) is evaluated against the path it should have, so its units end as
``ckpt_missing`` / ``ckpt_corrupt`` instead of keeping the fleet waiting forever; ``--once`` after one pass over what is
there — every unit of the snapshots present has a result, waiting for units other workers hold (and
taking over expired ones), and for marker-less dirs under ``--watch`` to become quiescent (at most
``2 * --quiescence + 5 * --poll-interval`` per dir); ``--max-units N`` after writing N results.
Service mode (``--watch``) never ends otherwise.

Exit codes (``sbatch/`` scripts requeue on 3 and 4):

=====================  ====  =================================================================
``EXIT_DONE``          0     finished (see above)
``EXIT_ERROR``         1     unexpected error (a traceback was printed)
``EXIT_USAGE``         2     bad flags, run dir, run.json, eval set or engine settings
``EXIT_PREEMPTED``     3     SIGTERM / SIGUSR1: lease released, nothing lost — requeue me
``EXIT_UNHEALTHY``     4     the engine could not be started or stayed dead — requeue elsewhere
``EXIT_INTERRUPTED``   130   SIGINT (Ctrl-C): lease released
=====================  ====  =================================================================

Service mode: ``--watch DIR`` evaluates any trainer's checkpoints in DIR — snapshots with a
``.complete`` marker at once, marker-less ones (an HF Trainer ``checkpoint-500/``) after
``--quiescence`` seconds without change and with every indexed shard present; the step comes from the
dir name's trailing digits or ``trainer_state.json``. Restarting never re-evaluates a unit with a
result. If ``RUN/run.json`` does not exist, ``--eval-config FILE`` creates the run from a JSON file::

    {"run_id": "my-eval",                                   # optional; default: the run dir's name
     "eval": {"datasets": [{"name": "gsm8k", "path": "gsm8k.jsonl", "n_prompts": 1319,
                            "scorer": "math", "shard_size": 64, "max_new_tokens": 256}],
              "engine": {"hf": {"dtype": "bfloat16"}}},
     "lease": {"duration_s": 120, "heartbeat_s": 20}}       # optional

Dataset paths are relative to the config file; the files are copied into ``RUN/data/``. The watch
dirs become the run's ``snapshot_roots`` and ``trainer.foreign_roots`` (so backfill and status see the
adopted checkpoints too). If run.json exists, the config must describe the same eval, else exit 2.

Limits: one unit at a time per worker process (run more workers, or pool engines, for throughput);
scoring is not interruptible mid-call — on preemption the worker releases first and does not wait for
it; adopting a foreign checkpoint checksums all its files once, in the polling thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from coord.atomic import dumps, publish_exclusive, read_json_object, write_bytes_atomic
from coord.discovery import SnapshotDiscovery, SnapshotRef
from coord.ledger import Ledger
from coord.manifest import RunManifest, parse_manifest
from coord.results import Result, ResultIndex, ok_result, skip_result, write_result
from coord.rundir import RunDir
from coord.snapshot import (
    Marker,
    SnapshotCorrupt,
    SnapshotError,
    producer_identity,
    snapshot_dirname,
    verify_snapshot,
)
from coord.units import Claim, UnitClaimer, WorkUnit, order_units, shard_range, units_for_step
from jobs.early_stop import early_stop_signal
from jobs.engines.base import Engine, EngineError
from jobs.engines.fn import CheckpointEvalFn, EvalSkip, build_input, parse_output
from jobs.scoring import DatasetCache, score_unit

EXIT_DONE = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PREEMPTED = 3
EXIT_UNHEALTHY = 4
EXIT_INTERRUPTED = 130

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# What scoring may raise and still be a ``crashed`` unit rather than a dead worker: engine/runtime, bad
# values, I/O, and the lookup/type/arithmetic errors a custom scorer or fn backend raises on bad input.
# Anything else is a bug in the worker itself: it stops (exit 1) with the unit's lease released.
SCORING_ERRORS = (RuntimeError, ValueError, OSError, LookupError, TypeError, ArithmeticError)
_WAIT_SLICE_S = 0.05  # how often the main thread looks at the stop flag while a unit runs


# -- options --------------------------------------------------------------------------------------------
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
        help="hf | http:URL | sglang | fn:module:Class (repeat for several engines; default hf)",
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


# -- skips raised while evaluating --------------------------------------------------------------------
class WorkerSkip(RuntimeError):
    """A unit outcome that is a skip with :attr:`reason`."""

    reason = "crashed"


class PinViolation(WorkerSkip):
    reason = "pin_violation"


class Unhealthy(WorkerSkip):
    reason = "unhealthy"


def call_with_timeout(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Run ``fn`` in a helper thread; :class:`EngineError` if it has not returned after ``timeout_s``.

    The helper thread cannot be killed: a wedged call keeps running in the background (and the engine
    typically stays unusable, which the health checks then report).
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 — carried to the calling thread and re-raised there
            box["error"] = e

    thread = threading.Thread(target=target, name=f"ckpteval-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise EngineError(f"{what} did not finish within {timeout_s:g}s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


# -- evaluators: the part between claim and result ------------------------------------------------------
@dataclass
class Evaluation:
    scores: list[float]
    weight_versions: list[str | None]
    message: str = ""


class Evaluator(Protocol):
    def evaluate(self, unit: WorkUnit, ref: SnapshotRef, timings: dict[str, float]) -> Evaluation: ...

    def close(self) -> None: ...


class EngineEvaluator:
    """Engines (:class:`~jobs.engines.base.Engine`): probe, heal, pin, score, check the pin again."""

    def __init__(
        self, engine: Engine, cache: DatasetCache, pin_timeout_s: float, load_timeout_s: float
    ) -> None:
        self.engine, self.cache = engine, cache
        self.pin_timeout_s, self.load_timeout_s = pin_timeout_s, load_timeout_s
        self._loaded_once = False

    def evaluate(self, unit: WorkUnit, ref: SnapshotRef, timings: dict[str, float]) -> Evaluation:
        want = str(unit.step)
        t0 = time.perf_counter()
        self._prepare(ref, want)
        timings["load_s"] = time.perf_counter() - t0
        try:
            scored = score_unit(self.engine, self.cache, unit)
        except EngineError:
            self._heal(ref, want)  # died mid-unit: bring it back, then one more try
            scored = score_unit(self.engine, self.cache, unit)
        timings["generate_s"] = scored.generate_s
        after = self.engine.weight_version()
        wrong = sorted({str(v) for v in scored.weight_versions if v != want})
        if wrong or after != want:
            raise PinViolation(
                f"want version {want}; samples carried {wrong or 'it'}, engine reports {after!r} after"
            )
        return Evaluation(scored.scores, scored.weight_versions)

    def _prepare(self, ref: SnapshotRef, want: str) -> None:
        """Probe (when something is loaded), pin, and probe again after a fresh load; heal on failure."""
        if self._loaded_once and not self.engine.healthy():
            self._heal(ref, want)
            return
        try:
            loaded = self._pin(ref, want)
        except EngineError:
            self._heal(ref, want)
            return
        if loaded and not self.engine.healthy():
            self._heal(ref, want)

    def _heal(self, ref: SnapshotRef, want: str) -> None:
        try:
            call_with_timeout(self.engine.restart, self.load_timeout_s, "engine restart")
            self._pin(ref, want)
        except EngineError as e:
            raise Unhealthy(f"engine dead after restart: {e}") from e
        if not self.engine.healthy():
            raise Unhealthy("engine failed its probe after restart and reload")

    def _pin(self, ref: SnapshotRef, want: str) -> bool:
        """Load ``ref`` as version ``want`` unless loaded; read the version back until it matches.

        Returns whether a load happened.
        """
        loaded = self.engine.weight_version() != want
        if loaded:
            try:
                call_with_timeout(lambda: self.engine.load(str(ref.path), want), self.load_timeout_s, "weight load")
            except EngineError as e:
                if not _is_version_mismatch(e):
                    raise
                # loaded, but the engine reads back another version: the read-back below decides
            self._loaded_once = True
        deadline, delay = time.monotonic() + self.pin_timeout_s, 0.02
        while (got := self.engine.weight_version()) != want:
            if time.monotonic() >= deadline:
                raise PinViolation(
                    f"engine reports version {got!r} after loading step {want} (waited {self.pin_timeout_s:g}s)"
                )
            time.sleep(delay)
            delay = min(2 * delay, 1.0)
        return loaded

    def close(self) -> None:
        self.engine.close()


class FnEvaluator:
    """A :class:`~jobs.engines.fn.CheckpointEvalFn`: hands it the unit, checks what comes back."""

    def __init__(self, backend: CheckpointEvalFn, cache: DatasetCache) -> None:
        self.backend, self.cache = backend, cache

    def evaluate(self, unit: WorkUnit, ref: SnapshotRef, timings: dict[str, float]) -> Evaluation:
        manifest = self.cache.manifest
        spec = manifest.dataset(unit.dataset)
        rows = [self.cache.rows(spec)[i] for i in shard_range(manifest, unit)]
        want = str(unit.step)
        t0 = time.perf_counter()
        output = self.backend.evaluate_checkpoint(str(ref.path), build_input(manifest, spec, unit, rows))
        timings["generate_s"] = time.perf_counter() - t0
        parsed = parse_output(output, len(rows) * spec.n_samples, want)
        wrong = sorted({str(v) for v in parsed.weight_versions if v != want})
        if wrong:
            raise PinViolation(f"want version {want}; backend reported {wrong}")
        return Evaluation(parsed.scores, parsed.weight_versions, parsed.message)

    def close(self) -> None:
        self.backend.dispose()


def _is_version_mismatch(error: EngineError) -> bool:
    """An HTTP engine's load that succeeded but read back another version (not a dead engine)."""
    if type(error).__name__ != "WeightVersionMismatch":
        return False
    from jobs.engines.http import WeightVersionMismatch

    return isinstance(error, WeightVersionMismatch)


def evaluate_unit(evaluator: Evaluator, unit: WorkUnit, ref: SnapshotRef, verify: str) -> Result:
    """Verify the snapshot and evaluate ``unit``; every expected failure becomes a skip result."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        marker = verify_snapshot(ref.path, verify, marker=ref.marker if ref.foreign else None)
        if marker.step != unit.step:
            raise SnapshotCorrupt(ref.path, f"marker says step {marker.step}, expected {unit.step}")
        timings["verify_s"] = time.perf_counter() - t0
        ev = evaluator.evaluate(unit, ref, timings)
        return ok_result(unit, ev.scores, ev.weight_versions, message=ev.message, timings=timings)
    except (SnapshotError, WorkerSkip, EvalSkip) as e:
        reason, message = e.reason, str(e)
    except EngineError as e:
        reason, message = "unhealthy", str(e)
    except SCORING_ERRORS as e:
        reason, message = "crashed", f"{type(e).__name__}: {e}"
    if reason in {"unhealthy", "crashed"}:
        # The snapshot may have gone away (or been damaged) after it was verified: then the load or the
        # backend failed because of the snapshot, and blaming the engine would restart a healthy one.
        try:
            verify_snapshot(ref.path, "fast", marker=ref.marker if ref.foreign else None)
        except SnapshotError as gone:
            reason, message = gone.reason, f"{gone} (after verification; the evaluation failed: {message})"
    return skip_result(unit, reason, message, timings=timings)


# -- run setup --------------------------------------------------------------------------------------------
def create_run_from_config(run_dir: Path, config_path: Path, roots: tuple[Path, ...]) -> RunDir:
    """Create (or check) a run from an eval-config file; see the module docstring for the format."""
    config_path = Path(config_path)
    cfg = read_json_object(config_path)
    if not isinstance(cfg.get("eval"), dict):
        raise ValueError(f"{config_path}: field eval must be an object (the eval section of run.json)")
    run = RunDir.create(run_dir)
    sources: dict[str, Path] = {}
    eval_section = json.loads(json.dumps(cfg["eval"]))
    for ds in eval_section.get("datasets") or []:
        if isinstance(ds, dict) and isinstance(ds.get("path"), str) and isinstance(ds.get("name"), str):
            src = Path(ds["path"])
            sources[ds["name"]] = src if src.is_absolute() else config_path.parent / src
            ds["path"] = f"data/{ds['name']}.jsonl"
    root_list = [str(Path(r).expanduser().resolve()) for r in roots]
    obj = {
        "run_id": cfg.get("run_id", run.path.name),
        "eval": eval_section,
        "snapshot_roots": root_list,
        "trainer": {"kind": "external", "foreign_roots": root_list},
        "lease": cfg.get("lease", {}),
        "created": time.time(),
    }
    manifest = parse_manifest(obj, config_path)
    if run.manifest_path.exists():
        existing = run.manifest()
        if existing.eval != manifest.eval:
            raise ValueError(f"{run.manifest_path} exists with a different eval config than {config_path}")
        return run
    for name, src in sources.items():
        if not src.is_file():
            raise FileNotFoundError(f"{config_path}: dataset {name!r} file {src} not found")
        write_bytes_atomic(run.data / f"{name}.jsonl", src.read_bytes())
    publish_exclusive(
        run.manifest_path, dumps(manifest.to_json())
    )  # a concurrent creator may win: same content
    return run


def open_run(opts: WorkerOptions) -> RunDir:
    if opts.eval_config is not None:
        if not opts.watch:
            raise ValueError("--eval-config creates a service run: give the checkpoint dir with --watch DIR")
        return create_run_from_config(opts.run_dir, opts.eval_config, opts.watch)
    return RunDir.open(opts.run_dir)


def check_datasets(cache: DatasetCache) -> None:
    """Load every eval set once so a broken one stops the worker at start, not unit by unit."""
    for spec in cache.manifest.eval.datasets:
        cache.rows(spec)
        cache.scorer(spec)


def build_evaluator(opts: WorkerOptions, manifest: RunManifest, cache: DatasetCache) -> Evaluator:
    from jobs.engines.factory import EnginePool, engine_settings, make_engine, spec_kind

    kinds = [spec_kind(s) for s in opts.engines]
    if kinds == ["fn"]:
        backend = make_engine(opts.engines[0], opts.device, engine_settings(manifest.eval.engine, "fn"))
        return FnEvaluator(backend, cache)  # type: ignore[arg-type]
    if manifest.eval.adapters:
        raise ValueError(
            f"run {manifest.run_id} evaluates adapters {list(manifest.eval.adapters)}; engines here would score the "
            "bare base weights — use an fn: backend that applies them"
        )
    engines = [
        make_engine(spec, opts.device, engine_settings(manifest.eval.engine, kind))
        for spec, kind in zip(opts.engines, kinds, strict=True)
        for _ in range(opts.replicas)
    ]
    engine: Engine = engines[0] if len(engines) == 1 else EnginePool(engines)  # type: ignore[assignment,arg-type]
    return EngineEvaluator(engine, cache, opts.pin_timeout_s, opts.load_timeout_s)


def dispatched_steps(ledger_path: Path) -> set[int]:
    """Steps the trainer dispatched, read as a reader (``repair=False``: never truncates a live ledger)."""
    return set(dispatch_records(ledger_path))


def dispatch_records(ledger_path: Path) -> dict[int, dict[str, Any]]:
    """step -> the trainer's latest ``dispatched`` record (read-only, like :func:`dispatched_steps`)."""
    return Ledger(ledger_path, repair=False).state.dispatched


def still_holds(claim: Claim) -> bool:
    """Whether ``claim`` is still ours: not reported lost, and the lease file still carries its token.

    The token check reads filelock's marker (``token=<hex>`` line); an unreadable file counts as held
    (the heartbeat reports real losses).
    """
    if claim.compromised.is_set():
        return False
    lost = claim.lease.compromise
    if lost is not None and lost.token == claim.token:
        return False
    try:
        content = Path(claim.lease.lock_file).read_text()
    except FileNotFoundError:
        return False
    except (OSError, UnicodeDecodeError):
        return True
    return f"token={claim.token}\n" in content


# -- the loop ---------------------------------------------------------------------------------------------
@dataclass
class _Discovered:
    discovery: SnapshotDiscovery
    foreign: bool


@dataclass
class Worker:
    """One worker's state across polls; :meth:`run` may be called again after it returns."""

    rundir: RunDir
    opts: WorkerOptions
    evaluator: Evaluator
    out: Callable[[str], None] = field(default=lambda line: print(line, flush=True))
    on_poll: Callable[[int], None] | None = None  # called with the number of outstanding units

    def __post_init__(self) -> None:
        self.manifest = self.rundir.manifest()
        self.claimer = UnitClaimer(self.rundir.leases, self.manifest.lease, results_dir=self.rundir.results)
        self.index = ResultIndex(self.rundir.results)
        self.discoveries = self._make_discoveries()
        self.identity = {
            **producer_identity(),
            "worker_id": self.opts.worker_id or f"{producer_identity()['host']}:{os.getpid()}",
            "engine": "+".join(self.opts.engines)
            + (f" x{self.opts.replicas}" if self.opts.replicas > 1 else ""),
        }
        self.refs: dict[int, SnapshotRef] = {}
        self.settled: set[int] = set()
        self.written = 0
        self.training_done = False  # as of the last poll
        self.stop_signal: int | None = None
        self.unit_thread: threading.Thread | None = None
        self._tried: set[WorkUnit] = set()
        self._warned: set[str] = set()
        self._pending_since: dict[tuple[str, str], float] = {}
        self._unhealthy_streak = 0
        self._dispatches: dict[int, dict[str, Any]] = {}  # ledger records, read once training is done
        self._unfound_since: dict[int, float] = {}

    def _make_discoveries(self) -> list[_Discovered]:
        foreign = {
            str(Path(r).resolve())
            for r in self.manifest.trainer.get("foreign_roots", [])
            if isinstance(r, str)
        }
        foreign |= {str(Path(w).resolve()) for w in self.opts.watch}
        roots = list(
            dict.fromkeys([str(Path(r).resolve()) for r in self.manifest.snapshot_roots] + sorted(foreign))
        )
        return [
            _Discovered(
                SnapshotDiscovery(
                    Path(r),
                    admit_foreign=r in foreign,
                    quiescence_s=self.opts.quiescence_s,
                    adoption_dir=self.rundir.adopted,
                ),
                r in foreign,
            )
            for r in roots
        ]

    # -- stopping ----------------------------------------------------------------------------------
    def request_stop(self, signum: int) -> None:
        """Signal-handler safe: only sets a flag, which the main thread acts on within ~50 ms."""
        self.stop_signal = signum

    def _stop_code(self) -> int:
        return EXIT_INTERRUPTED if self.stop_signal == signal.SIGINT else EXIT_PREEMPTED

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while self.stop_signal is None and (left := end - time.monotonic()) > 0:
            time.sleep(min(_WAIT_SLICE_S * 2, left))

    # -- polling -----------------------------------------------------------------------------------
    def poll(self) -> tuple[list[WorkUnit], int]:
        """(claimable units, number of outstanding units incl. those without a snapshot yet)."""
        current: dict[int, SnapshotRef] = {}
        for d in self.discoveries:
            for ref in d.discovery.poll():
                current.setdefault(ref.step, ref)
        self.refs.update(current)  # a vanished snapshot keeps its ref: its units become ckpt_missing
        results = self.index.refresh()
        self._forget_finished(results)
        for name, why in self.index.errors.items():
            self._warn_once(name, f"unit left alone: its result file is malformed ({why})")
        broken = {WorkUnit.from_id(n[: -len(".json")]) for n in self.index.errors if self._parsable_id(n)}
        outstanding = [
            u
            for s in sorted(self._steps())
            if s not in self.settled
            for u in self._open_units(s, results)
            if u not in broken  # a human must look at it; re-evaluating could never publish
        ]
        self._give_up_finding(outstanding)
        claimable = [u for u in outstanding if u.step in self.refs]
        if self.on_poll is not None:
            self.on_poll(len(outstanding))
        return claimable, len(outstanding)

    def _give_up_finding(self, outstanding: list[WorkUnit]) -> None:
        """Training is done, so every snapshot the trainer will publish is published: a dispatched step no
        poll has found for one lease duration (on this process's monotonic clock, which also covers a
        shared filesystem's slow visibility) gets a ref to where its snapshot should be. Its units then
        take the normal path and verification makes them ``ckpt_missing`` (or ``ckpt_corrupt`` for an
        unreadable marker) — instead of the fleet waiting forever for a snapshot that is gone."""
        now = time.monotonic()
        unfound = {u.step for u in outstanding if u.step not in self.refs and u.step in self._dispatches}
        for step in set(self._unfound_since) - unfound:
            del self._unfound_since[step]
        for step in sorted(unfound):
            if now - self._unfound_since.setdefault(step, now) < self.manifest.lease.duration_s:
                continue
            path = self._expected_snapshot(step)
            self.refs[step] = SnapshotRef(step, path, Marker(step, str(step), {}, {}, "missing", 0.0))
            self._warn_once(f"unfound:{step}", f"step {step} was dispatched but its snapshot {path} never appeared")

    def _expected_snapshot(self, step: int) -> Path:
        record = self._dispatches.get(step, {})
        if isinstance(record.get("snapshot"), str):
            return Path(record["snapshot"])
        root = Path(self.manifest.snapshot_roots[0]) if self.manifest.snapshot_roots else self.rundir.snapshots
        return root / (f"checkpoint-{step}" if record.get("mode") == "reuse" else snapshot_dirname(step))

    def _open_units(self, step: int, results: dict[WorkUnit, Result]) -> list[WorkUnit]:
        units = [u for u in units_for_step(self.manifest, step) if u not in results]
        if not units:
            self.settled.add(step)
        return units

    def _steps(self) -> set[int]:
        # TRAINING_DONE is read once per poll, *before* the ledger: the trainer appends its last dispatch
        # before writing it, so a worker that sees "done" also sees every dispatched step.
        self.training_done = self.rundir.training_done() is not None
        steps = set(self.refs)
        if self.training_done:
            try:
                self._dispatches = dispatch_records(self.rundir.ledger_path)
                steps |= set(self._dispatches)
            except ValueError as e:  # the trainer reports it; the fleet still ends on what it discovered
                self._warn_once("ledger", f"cannot read the trainer's dispatches: {e}")
        if self.opts.catchup == "latest":
            return {max(steps)} if steps else set()
        return steps

    @staticmethod
    def _parsable_id(name: str) -> bool:
        try:
            WorkUnit.from_id(name[: -len(".json")])
        except ValueError:
            return False
        return True

    def _forget_finished(self, results: dict[WorkUnit, Result]) -> None:
        for unit in [u for u in self._tried if u in results]:
            self.claimer.forget(unit)
            self._tried.discard(unit)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            print(f"ckpteval worker: {message}", file=sys.stderr, flush=True)

    def _awaiting_foreign(self) -> bool:
        """--once: whether a marker-less dir may still become quiescent (bounded wait per dir)."""
        now, waiting = time.monotonic(), False
        bound = 2 * self.opts.quiescence_s + 5 * self.opts.poll_interval_s
        for d in self.discoveries:
            for name in d.discovery.awaiting_quiescence if d.foreign else ():
                since = self._pending_since.setdefault((str(d.discovery.root), name), now)
                waiting |= now - since < bound
        return waiting

    def _finished(self, outstanding: int) -> bool:
        if self.opts.once:
            return outstanding == 0 and not self._awaiting_foreign()
        if self.opts.service:
            return False
        return outstanding == 0 and self.training_done

    # -- units ---------------------------------------------------------------------------------------
    def run(self) -> int:
        """Work until done (see the module docstring); returns an exit code."""
        self.written = 0
        while self.stop_signal is None:
            claimable, outstanding = self.poll()
            if not claimable:
                if self._finished(outstanding):
                    return EXIT_DONE
                self._sleep(self.opts.poll_interval_s)
                continue
            claim = self.claimer.claim_first(order_units(claimable, self.opts.newest_first, spread=os.getpid()))
            if claim is None:  # all held by other workers: wait, take over expired ones later
                self._sleep(self.opts.poll_interval_s)
                continue
            self._tried.add(claim.unit)
            result = self._process(claim)
            if self.stop_signal is not None:
                break
            if result is not None and result.skip_reason == "unhealthy":
                self._unhealthy_streak += 1
                if self.opts.max_unhealthy and self._unhealthy_streak >= self.opts.max_unhealthy:
                    self.out(
                        f"engine unhealthy for {self._unhealthy_streak} units in a row: exiting for a fresh start"
                    )
                    return EXIT_UNHEALTHY
            elif result is not None:
                self._unhealthy_streak = 0
            if self.opts.max_units is not None and self.written >= self.opts.max_units:
                return EXIT_DONE
        return self._stop_code()

    def _process(self, claim: Claim) -> Result | None:
        """Evaluate one claimed unit and publish its result; None when abandoned (nothing written)."""
        unit = claim.unit
        try:
            if (self.rundir.results / f"{unit.id}.json").exists():
                return None  # finished by someone else since the listing
            if self.stop_signal is not None:  # signalled between claim and start: same as mid-unit
                self.out(f"step={unit.step} {unit.dataset}[{unit.shard}] abandoned: stop signal, lease released")
                return None
            t0 = time.perf_counter()
            result = self._evaluate_interruptibly(unit, self.refs[unit.step])
            if result is None:
                self.out(
                    f"step={unit.step} {unit.dataset}[{unit.shard}] abandoned: stop signal, lease released"
                )
                return None
            if not still_holds(claim):
                self.out(f"step={unit.step} {unit.dataset}[{unit.shard}] abandoned: lease lost (taken over)")
                return None
            result = dataclasses.replace(
                result,
                timings={**result.timings, "total_s": time.perf_counter() - t0},
                worker=self.identity,
                lease_token=claim.token,
                attempt=claim.attempt,
                snapshot=str(self.refs[unit.step].path),
            )
            first = write_result(self.rundir.results, result)
            self.written += 1
            self.out(_unit_line(result, first))
            return result
        finally:
            claim.release()

    def _evaluate_interruptibly(self, unit: WorkUnit, ref: SnapshotRef) -> Result | None:
        """Run the unit in a helper thread so a stop signal can release the lease at once (None then)."""
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["result"] = evaluate_unit(self.evaluator, unit, ref, self.opts.verify)
            except BaseException as e:  # noqa: BLE001 — carried to the main thread and re-raised there
                box["error"] = e

        self.unit_thread = threading.Thread(target=target, name=f"ckpteval-unit-{unit.id}", daemon=True)
        self.unit_thread.start()
        while self.unit_thread.is_alive():
            self.unit_thread.join(_WAIT_SLICE_S)
            if self.stop_signal is not None:
                return None
        self.unit_thread = None
        if "error" in box:
            raise box["error"]
        return box["result"]

    @property
    def busy(self) -> bool:
        """A unit's evaluation is still running (only after an abandoning stop)."""
        return self.unit_thread is not None and self.unit_thread.is_alive()


def _unit_line(result: Result, first: bool) -> str:
    u, secs = result.unit, result.timings.get("total_s", 0.0)
    head = f"step={u.step} {u.dataset}[{u.shard}]"
    dup = "" if first else " (duplicate: another result was first)"
    if result.ok:
        n = len(result.scores)
        score = sum(result.scores) / n if n else float("nan")
        return f"{head} score={score:.4f} n={n} {secs:.2f}s{dup}"
    return f"{head} SKIP {result.skip_reason}: {result.message[:120]} {secs:.2f}s{dup}"


# -- entry points ---------------------------------------------------------------------------------------
def close_quietly(evaluator: Evaluator, timeout_s: float = 10.0) -> None:
    """Close the backend, bounded: a unit still running may hold the engine's locks."""
    try:
        call_with_timeout(evaluator.close, timeout_s, "engine close")
    except (EngineError, RuntimeError, ValueError, OSError) as e:
        print(f"ckpteval worker: closing the engine failed: {e}", file=sys.stderr, flush=True)


def install_signal_handlers(worker: Worker) -> dict[int, Any]:
    """Route SIGTERM/SIGUSR1/SIGINT to ``worker``; returns the previous handlers (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in STOP_SIGNALS:
        previous[sig] = signal.signal(sig, lambda signum, _frame: worker.request_stop(signum))
    if (early := early_stop_signal()) is not None:  # preempted while still starting up
        worker.request_stop(early)
    return previous


def prepare_worker(opts: WorkerOptions, **kw: Any) -> Worker:
    """Open (or create) the run, check its eval sets, build the backend: everything before the loop."""
    run = open_run(opts)
    manifest = run.manifest()
    cache = DatasetCache(run, manifest)
    check_datasets(cache)
    evaluator = build_evaluator(opts, manifest, cache)
    return Worker(run, opts, evaluator, **kw)


def service_ingestion(worker: Worker, opts: WorkerOptions) -> tuple[Callable[[int], None], Callable[[], None]]:
    """The service's own ingestion (jobs.ingest): log finished points into the training run's wandb."""
    from jobs.ingest import ServiceIngester
    from jobs.metrics import MetricsSink, init_wandb

    wandb_run = init_wandb(worker.rundir.path, str(opts.wandb_run_id), {"service": worker.identity},
                           join=opts.wandb_mode, label=f"ckpteval-service-{worker.identity['worker_id']}")
    ingester = ServiceIngester(worker.rundir, MetricsSink(worker.rundir.path / "service_metrics.jsonl", wandb_run),
                                lambda: max(worker.refs, default=0))
    previous = worker.on_poll

    def on_poll(outstanding: int) -> None:
        for step in ingester.poll():
            worker.out(f"point step={step} logged to wandb run {opts.wandb_run_id}")
        if previous is not None:
            previous(outstanding)

    def finish() -> None:
        on_poll(0)  # points completed by the last unit
        ingester.sink.close()

    return on_poll, finish


def run_worker(opts: WorkerOptions, *, exit_process: bool = False, **kw: Any) -> int:
    """Build, run and close a worker with signal handling; returns the exit code.

    ``exit_process`` (the CLI): after a stop signal abandoned a unit mid-call, end the process at once
    with the code instead of returning (the abandoned call would otherwise hold up interpreter exit).
    """
    try:
        worker = prepare_worker(opts, **kw)
    except EngineError as e:
        print(f"ckpteval worker: engine failed to start: {e}", file=sys.stderr)
        return EXIT_UNHEALTHY
    except (ValueError, FileNotFoundError) as e:
        print(f"ckpteval worker: {e}", file=sys.stderr)
        return EXIT_USAGE
    finish_ingestion: Callable[[], None] | None = None
    if opts.wandb:
        worker.on_poll, finish_ingestion = service_ingestion(worker, opts)
    previous = install_signal_handlers(worker)
    try:
        code = worker.run()
        if finish_ingestion is not None:
            finish_ingestion()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        close_quietly(worker.evaluator, timeout_s=2.0 if worker.busy else 10.0)
    if worker.busy and exit_process:  # abandoned mid-unit: neither wait for it nor let shutdown wait
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


EXIT_CODES_HELP = (
    f"exit codes: {EXIT_DONE} done, {EXIT_ERROR} unexpected error, {EXIT_USAGE} usage/config error, "
    f"{EXIT_PREEMPTED} preempted by SIGTERM/SIGUSR1 (lease released: requeue), {EXIT_UNHEALTHY} engine dead "
    f"(requeue elsewhere), {EXIT_INTERRUPTED} SIGINT"
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="ckpteval worker", description=__doc__.split("\n\n")[0], epilog=EXIT_CODES_HELP
    )
    add_worker_flags(parser)
    args = parser.parse_args(argv)
    try:
        opts = options_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    return run_worker(opts, exit_process=True)


__all__ = [
    "EXIT_DONE",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_PREEMPTED",
    "EXIT_UNHEALTHY",
    "EXIT_USAGE",
    "Worker",
    "WorkerOptions",
    "main",
    "run_worker",
]
