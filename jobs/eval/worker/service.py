"""The external-service posture's extra: logging finished points into the training run's wandb (through
:mod:`ckpteval.jobs.ingest`). Creating a run from ``--eval-config`` is :mod:`ckpteval.jobs.eval.worker.evalconfig`'s.

Guarantee: a point is logged once per step (the ingester's ledger). Limits: wandb is optional; without it the
points are still in ``service_metrics.jsonl``.
"""

from __future__ import annotations

from collections.abc import Callable

from ckpteval.jobs.eval.worker.loop import Worker
from ckpteval.jobs.eval.worker.options import WorkerOptions


def service_ingestion(worker: Worker, opts: WorkerOptions) -> tuple[Callable[[int], None], Callable[[], None]]:
    """The service's own ingestion (ckpteval.jobs.ingest): log finished points into the training run's wandb."""
    from ckpteval.jobs.ingest import ServiceIngester
    from ckpteval.jobs.metrics import MetricsSink, init_wandb

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
