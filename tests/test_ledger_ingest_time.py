"""The ledger's ``ingested`` record carries the wall clock of the ingestion (bench/bench_trainer.py
reads it for the result -> ingested latency)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ckpteval.jobs.metrics import MetricsSink
from ckpteval.jobs.reference.model import ModelConfig, build_model
from ckpteval.jobs.trainer.dispatcher import EvalDispatcher
from tests.support.training import fill_results, make_train_run

SMALL = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)


def test_ingested_record_has_wall_clock_time(tmp_path: Path) -> None:
    run, dispatch = make_train_run(tmp_path / "run", eval_interval=2)
    d = EvalDispatcher.open(dispatch.with_waits(poll_interval_s=0.0), run, MetricsSink(run.metrics_path), run.base)
    model = build_model(SMALL, "llama", seed=0)
    d.maybe_dispatch(2, model)
    d.exporter.wait()
    d.poll(force=True)
    fill_results(run, 2)
    before = time.time()
    d.poll(force=True)
    after = time.time()
    records = [json.loads(line) for line in run.ledger_path.read_text().splitlines()]
    (ingested,) = [r for r in records if r["event"] == "ingested"]
    assert ingested["step"] == 2 and before <= ingested["time"] <= after
