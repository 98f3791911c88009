"""Your trainer, in a few lines: create (or resume) an eval run and get its dispatcher.

What ``ckpteval train`` does for its own run, as a library call any training loop can make — the
reference trainer itself goes through it::

    from ckpteval.jobs.trainer.config import DispatchConfig
    from ckpteval.jobs.trainer.session import EvalRun, start_eval

    dispatcher = start_eval(EvalRun(
        run_dir="runs/r1", eval_config="eval.json", base_model_dir="my-hf-model-dir",
        dispatch=DispatchConfig(eval_interval=100), resume=True))  # staging into RUN/snapshots
    dispatcher.dispatch_initial(model)               # optional: step 0 is a point
    for step in range(1, steps + 1):
        ...                                          # forward, backward, optimizer step
        dispatcher.maybe_dispatch(step, model, final=step == steps)
    dispatcher.close(steps, model)                   # final point, TRAINING_DONE, drain

With an HF ``Trainer``, pass the dispatcher to :class:`ckpteval.jobs.trainer.hf_callback.EvalDispatchCallback`.
:class:`EvalRun` is the trainer's run flags; its ``dispatch`` is the one eval config,
:class:`~ckpteval.jobs.trainer.config.DispatchConfig` (the ``--eval-*`` flags: the same names and defaults,
declared once there; waits: ``DispatchConfig(..., waits=Waits(poll_interval_s=0.2))``).

Guarantee (the same checks as ``ckpteval train``): everything is validated before anything is
written — the eval flags as one (:meth:`DispatchConfig.validate`), the eval-config file and every row
of its datasets (:func:`ckpteval.jobs.eval.worker.evalconfig.read_eval_config`), ``stop_when`` against the run's datasets;
an existing run is continued only with ``resume=True`` and only with the same eval; ``run.json`` is
written last, once. Limits: the caller's model dir must hold ``config.json`` and the tokenizer files
(exports copy them into each snapshot; weights are not needed); one trainer per run dir.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckpteval.coord.results.conditions import check_metric, eval_names, parse_condition
from ckpteval.coord.run.identity import run_key
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.snapshot import producer_identity
from ckpteval.jobs.eval.worker.evalconfig import EvalConfig, install_eval_data, read_eval_config
from ckpteval.jobs.metrics import MetricsSink
from ckpteval.jobs.pathchecks import check_dir_creatable
from ckpteval.jobs.trainer.config import DispatchConfig
from ckpteval.jobs.trainer.dispatcher import EvalDispatcher

# a trainer-specific builder of the eval section and RUN/base (the reference trainer's built-in set);
# called only when the run is created, with the eval-config file if one was given
BuildEval = Callable[[RunDir, EvalConfig | None], EvalSpec]


@dataclass
class EvalRun:
    """A trainer's run, as ``ckpteval train`` takes it on its command line."""

    run_dir: Path
    """the run directory (--run-dir)"""
    dispatch: DispatchConfig | None
    """the eval config, the --eval-* flags (no snapshot dir: RUN/snapshots); None: --no-eval"""
    eval_config: Path | None = None
    """the datasets: an eval-config file (the format `worker --eval-config` takes)"""
    base_model_dir: Path | None = None
    """config.json + tokenizer files, copied into RUN/base when the run is created"""
    resume: bool = False
    """continue an existing run (--resume); without it an existing run.json is refused"""
    run_id: str | None = None
    """default: the eval-config's run_id, else the run dir's name"""
    trainer: dict[str, Any] = field(default_factory=dict)
    """who trains: recorded in run.json's trainer section"""
    lease: LeaseSettings = field(default_factory=LeaseSettings)
    """--lease-duration/-heartbeat, written to run.json (an eval-config's lease settings win)"""

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self.eval_config = None if self.eval_config is None else Path(self.eval_config)
        self.base_model_dir = None if self.base_model_dir is None else Path(self.base_model_dir)
        check_dir_creatable("--run-dir", self.run_dir)
        if self.dispatch is not None:
            self.dispatch = self.dispatch.for_run(self.run_dir)
        if self.base_model_dir is not None and not (self.base_model_dir / "config.json").is_file():
            raise ValueError(f"base_model_dir {self.base_model_dir}: no config.json (an HF model dir: config + tokenizer)")


def _copy_base(run: RunDir, base: Path) -> None:
    """``base``'s small files (config, generation config, tokenizer) into RUN/base; weights are left out."""
    run.base.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".pt", ".pth", ".index.json")):
            shutil.copy2(f, run.base / f.name)


def _default_eval(spec: EvalRun) -> BuildEval:
    def build(run: RunDir, config: EvalConfig | None) -> EvalSpec:
        if config is None:
            raise ValueError("no datasets: give eval_config")
        if spec.base_model_dir is not None:
            _copy_base(run, spec.base_model_dir)
        install_eval_data(run, config)
        return config.spec
    return build


def prepare_eval_run(spec: EvalRun, build_eval: BuildEval | None = None) -> RunDir:
    """Create the run (or reopen it with ``resume``); ``run.json`` is written last, once.

    ``build_eval`` writes RUN/base and the datasets of a new run and returns its eval section
    (default: the eval-config file's, and ``base_model_dir`` copied). ValueError names what is wrong."""
    _install_checks()
    run = RunDir(spec.run_dir)
    config = read_eval_config(spec.eval_config) if spec.eval_config is not None else None
    if run.manifest_path.is_file():
        if not spec.resume:
            raise ValueError(f"{run.path} already holds a run; pass EvalRun(resume=True) to continue it")
        if config is not None and not same_eval(run.manifest().eval, config.spec):
            raise ValueError(f"{run.manifest_path} holds a different eval than --eval-config {config.path}")
        _check_stop_when(spec, run.manifest())
        _check_output_dir(spec, run_key(run.manifest()))
        run.clear_interrupted()  # running again: readers must not take it as ended
        return run
    if config is None and build_eval is None:
        raise ValueError("no datasets: give eval_config (an eval-config file, the format `ckpteval worker "
                         "--eval-config` takes)")
    if spec.base_model_dir is None and build_eval is None:
        raise ValueError("base_model_dir: exports copy its config and tokenizer into every snapshot; give the "
                         "HF model dir the trainer started from")
    if config is not None:  # checked before anything is written
        _check_stop_when(spec, RunManifest(run_id="check", eval=config.spec, snapshot_roots=()))
    _check_output_dir(spec, None)  # before anything is written
    run = RunDir.create(spec.run_dir)
    eval_spec = (build_eval or _default_eval(spec))(run, config)
    manifest = RunManifest(
        run_id=spec.run_id or (config.raw.get("run_id") if config else None) or _run_id(run.path),
        eval=eval_spec,
        snapshot_roots=(str(run.snapshots),),
        trainer={"program": "library", **producer_identity(), **spec.trainer},
        lease=config.lease if config is not None and config.lease else spec.lease,
        created=time.time(),
    )
    _check_stop_when(spec, manifest)
    if spec.dispatch is not None:  # a shared staging dir gets a per-run subdir (named by the run key)
        manifest = replace(manifest, snapshot_roots=(str(spec.dispatch.run_snapshot_root(run_key(manifest), run.path)),))
    RunDir.create(run.path, manifest)
    return run


def same_eval(recorded: EvalSpec, config: EvalSpec) -> bool:
    """Whether a resumed run's recorded eval is the eval-config's: a config naming no ``base_model``
    matches the one the trainer recorded (``ckpteval train --lora`` adds its own base)."""
    if config.base_model is None:
        recorded = replace(recorded, base_model=None)
    return recorded == config


def _check_output_dir(spec: EvalRun, own: str | None) -> None:
    """A ``save_hf_dir`` holding another run's checkpoints is refused (``refuse_other_runs``; ``own``: this
    run's key, None for a run not created yet)."""
    if spec.dispatch is not None and spec.dispatch.save_hf_dir is not None:
        # imported here, not at the top: keeps the trainer library light
        from ckpteval.coord.snapshots.discovery import refuse_other_runs

        refuse_other_runs(Path(spec.dispatch.save_hf_dir), own, "save_hf_dir (--save-hf)")


def _install_checks() -> None:
    """jobs' run.json name checks (imported here, not at the top: the kinds pull the engines' base)."""
    from ckpteval.jobs.eval.kinds.evaluate import install_checks

    install_checks()


def _check_stop_when(spec: EvalRun, manifest: RunManifest) -> None:
    """The flags naming a dataset's metric (--eval-stop-when, --eval-stop-plateau, --eval-adaptive) name one of
    this run's (one ValueError naming the flag otherwise)."""
    for flag, metric in spec.dispatch.metric_flags() if spec.dispatch is not None else []:
        check_metric(parse_condition(f"{metric} >= 0", flag), eval_names(manifest), flag)


def _run_id(path: Path) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", path.name)[:64] or "run"


def open_dispatcher(spec: EvalRun, run: RunDir, sink: MetricsSink | None = None, **kw: Any) -> EvalDispatcher:
    """The run's :class:`EvalDispatcher` with ``spec.dispatch``; ``sink`` defaults to ``RUN/metrics.jsonl``
    alone (give a :class:`MetricsSink` with a wandb run to log there too); ``kw`` goes to the dispatcher
    (``shared``, ``should_stop``)."""
    if spec.dispatch is None:
        raise ValueError("no dispatch config: this run trains without evaluation")
    _install_checks()
    return EvalDispatcher.open(spec.dispatch, run, sink or MetricsSink(run.metrics_path), run.base, **kw)


def start_eval(spec: EvalRun, sink: MetricsSink | None = None, **kw: Any) -> EvalDispatcher:
    """:func:`prepare_eval_run` then :func:`open_dispatcher`: the one call a training loop needs."""
    return open_dispatcher(spec, prepare_eval_run(spec), sink, **kw)
