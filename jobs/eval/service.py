"""The external-service posture's two extras: creating a run from ``--eval-config`` and
logging finished points into the training run's wandb (through :mod:`jobs.ingest`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from coord.atomic import dumps, publish_exclusive, read_json_object, write_bytes_atomic
from coord.manifest import RunManifest, parse_manifest
from coord.rundir import RunDir
from jobs.eval.evalsets import load_rows
from jobs.eval.loop import Worker
from jobs.eval.options import WorkerOptions


def read_eval_config(run_dir: Path, config_path: Path, roots: tuple[Path, ...]) -> tuple[RunManifest, dict[str, Path]]:
    """Validate an eval-config file without writing anything: the manifest it makes and its dataset files.

    Every dataset file is read and checked (rows, count against ``n_prompts``), so a bad config fails
    here, before ``create_run_from_config`` writes run.json or copies any data. Used by the worker and,
    on the submit host, by ``ckpteval submit service --eval-config``.
    """
    config_path = Path(config_path)
    cfg = read_json_object(config_path)
    if not isinstance(cfg.get("eval"), dict):
        raise ValueError(f"{config_path}: field eval must be an object (the eval section of run.json)")
    sources: dict[str, Path] = {}
    eval_section = json.loads(json.dumps(cfg["eval"]))
    for ds in eval_section.get("datasets") or []:
        if isinstance(ds, dict) and isinstance(ds.get("path"), str) and isinstance(ds.get("name"), str):
            src = Path(ds["path"])
            sources[ds["name"]] = src if src.is_absolute() else config_path.parent / src
            ds["path"] = f"data/{ds['name']}.jsonl"
    root_list = [str(Path(r).expanduser().resolve()) for r in roots]
    obj = {
        "run_id": cfg.get("run_id", RunDir(run_dir).path.name),
        "eval": eval_section,
        "snapshot_roots": root_list,
        "trainer": {"kind": "external", "foreign_roots": root_list},
        "lease": cfg.get("lease", {}),
        "created": time.time(),
    }
    manifest = parse_manifest(obj, config_path)
    for name, src in sources.items():
        if not src.is_file():
            raise FileNotFoundError(f"{config_path}: dataset {name!r} file {src} not found")
        rows = load_rows(src)
        want = manifest.dataset(name).n_prompts
        if len(rows) != want:
            raise ValueError(f"{config_path}: dataset {name!r} file {src} has {len(rows)} rows, n_prompts says {want}")
    return manifest, sources


def create_run_from_config(run_dir: Path, config_path: Path, roots: tuple[Path, ...]) -> RunDir:
    """Create (or check) a run from an eval-config file; see :mod:`jobs.eval.worker` for the format.

    Everything is validated first (:func:`read_eval_config`); only then are the run dir, the dataset
    copies and run.json written (run.json last), so a rejected config leaves nothing behind.
    """
    manifest, sources = read_eval_config(run_dir, config_path, roots)
    run = RunDir(run_dir)
    if run.manifest_path.exists():
        existing = run.manifest()
        if existing.eval != manifest.eval:
            raise ValueError(f"{run.manifest_path} exists with a different eval config than {config_path}")
        return run
    run = RunDir.create(run_dir)
    for name, src in sources.items():
        write_bytes_atomic(run.data / f"{name}.jsonl", src.read_bytes())
    publish_exclusive(
        run.manifest_path, dumps(manifest.to_json())
    )  # a concurrent creator may win: same content
    return run


def service_ingestion(worker: Worker, opts: WorkerOptions) -> tuple[Callable[[int], None], Callable[[], None]]:
    """The service's own ingestion (jobs.ingest): log finished points into the training run's wandb."""
    from jobs.ingest import ServiceIngester
    from jobs.metrics import MetricsSink, init_wandb

    wandb_run = init_wandb(worker.rundir.path, str(opts.wandb_run_id), {"service": worker.identity},
                           join=opts.wandb_mode, label=f"ckpteval-service-{worker.identity['worker_id']}")
    ingester = ServiceIngester(worker.rundir, MetricsSink(worker.rundir.service_metrics_path, wandb_run),
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
