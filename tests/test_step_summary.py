"""Step summaries (ckpteval.coord.results.summary): ingestion writes them, status and plot read them when fresh, and
what they print is the same with a summary, without one, with a stale one and with a corrupt one."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from ckpteval.coord.results.files import ResultIndex, ok_result, skip_result, write_result
from ckpteval.coord.results.summary import read_step_facts, write_step_summary
from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.run.rundir import STEP_SUMMARY, RunDir, step_dir_name
from ckpteval.coord.work.units import units_for_step
from ckpteval.jobs.ingest import ingest_point
from ckpteval.jobs.metrics import MetricsSink
from ckpteval.jobs.views.plot import plot_series
from ckpteval.jobs.views.status.main import collect_status, show
from ckpteval.jobs.views.tables import PlainTable
from tests.support.runs import make_run

STEPS = (10, 20, 30)
TITLE = "points of a run: a title longer than its table"


def _ingested_run(tmp_path: Path) -> RunDir:
    """Three points ingested through :func:`ingest_point` as the trainer does (an index of the step's
    directory): scores, costs from two workers, a pin violation, and a judge skip at step 20."""
    run = make_run(tmp_path, n_prompts=4, shard_size=2, datasets=("add", "mul"))
    manifest = run.manifest()
    ledger, sink, index = Ledger(run.ledger_path), MetricsSink(run.metrics_path), ResultIndex(run.results)
    for step in STEPS:
        ledger.append("dispatched", step)
        for i, unit in enumerate(units_for_step(manifest, step)):
            worker = {"host": "h", "pid": i % 2}
            cost = {"gpu_s": 0.1 * (i + 1), "generated_tokens": 7.0 * i, "engine_s": 0.3}
            if step == 20 and i == 0:
                result = skip_result(unit, "judge_failed", "judge down", worker=worker)
            else:
                version = "other-run@1" if step == 30 and i == 1 else str(step)
                result = ok_result(unit, [0.1 * i, 1.0], [version] * 2, answers=["a", "b"], worker=worker, cost=cost)
            write_result(run.results, result)
        index.refresh(only_steps={step})
        assert ingest_point(manifest, step, index.for_step(step), sink=sink, ledger=ledger, lag_steps=5, index=index)
    return run


def _summaries(run: RunDir) -> list[Path]:
    return sorted(run.results.glob(f"step-*/{STEP_SUMMARY}"))


def _shown(run: RunDir) -> tuple[str, str, dict]:
    """What status prints (JSON and tables; the two numbers that move with the clock and the disk fixed) and
    plot's data."""
    status = collect_status(run.path)
    status["cost"]["training_wall_hours"], status["health"]["staging_free_bytes"] = 0.0, {}
    console = Console(file=io.StringIO(), width=120)
    show(console, [status], False)
    return json.dumps(status, default=str), console.file.getvalue(), plot_series(status)  # type: ignore[attr-defined]


def _without_summaries(run: RunDir) -> tuple[str, str, dict]:
    for path in _summaries(run):
        path.unlink()
    return _shown(run)


def test_ingestion_writes_summaries_and_status_reads_them(tmp_path: Path) -> None:
    run = _ingested_run(tmp_path)
    assert [p.parent.name for p in _summaries(run)] == [step_dir_name(s) for s in STEPS]
    # the summary, not the result files, is what a reader uses: a result changed under its name (which
    # the protocol never does) is not seen while the summary's fingerprint of the names still matches
    manifest = run.manifest()
    unit = units_for_step(manifest, 10)[0]
    path = run.results / step_dir_name(10) / unit.result_name_at(0)
    obj = json.loads(path.read_text())
    obj["scores"] = [1.0, 1.0]
    path.write_text(json.dumps(obj))
    facts, errors = read_step_facts(run.results, manifest)
    assert not errors and set(facts) == set(STEPS)
    assert facts[10].point["datasets"]["add"]["score"] == pytest.approx(0.525)  # as ingested: (0 + 1 + 0.1 + 1) / 4
    (run.results / step_dir_name(10) / STEP_SUMMARY).unlink()
    assert read_step_facts(run.results, manifest)[0][10].point["datasets"]["add"]["score"] == pytest.approx(0.775)


def test_status_and_plot_are_the_same_with_and_without_summaries(tmp_path: Path) -> None:
    run = _ingested_run(tmp_path)
    with_summaries = _shown(run)
    status = json.loads(with_summaries[0])
    assert status["units"]["skipped"] == {"judge_failed": 1} and status["points"][2]["skips"] == {"pin_violation": 1}
    assert status["cost"]["tokens_per_s"] and "points of test-run" in with_summaries[1]
    assert with_summaries == _without_summaries(run)
    assert not _summaries(run)  # status and plot never write one (the run dir may be read-only)


def test_a_retry_landing_after_ingestion_makes_the_summary_stale(tmp_path: Path) -> None:
    run = _ingested_run(tmp_path)
    before = _shown(run)
    unit = units_for_step(run.manifest(), 20)[0]  # its judge_failed skip is superseded by a retry's result
    write_result(run.results, ok_result(unit, [1.0, 1.0], ["20"] * 2, answers=["a", "a"]), generation=1)
    after = _shown(run)
    assert after != before and json.loads(after[0])["units"]["skipped"] == {}
    assert after == _without_summaries(run)


def test_a_corrupt_or_foreign_summary_is_ignored(tmp_path: Path) -> None:
    run = _ingested_run(tmp_path)
    expected = _shown(run)
    summaries = _summaries(run)
    summaries[0].write_bytes(b'{"summary": 1, "step": 1')  # torn
    summaries[1].write_bytes(summaries[2].read_bytes())  # another step's
    obj = json.loads(summaries[2].read_text())
    obj["facts"]["done"] = "many"
    summaries[2].write_text(json.dumps(obj))  # the right fingerprints, a wrong field
    assert _shown(run) == expected


def test_no_summary_from_a_read_that_is_not_current_or_whole(tmp_path: Path) -> None:
    """The writer lists the step again after the read: a result that landed since, or a malformed one in
    the read, leaves the step without a summary (readers read it in full)."""
    run = make_run(tmp_path, n_prompts=4, shard_size=2)
    manifest = run.manifest()
    first, second = units_for_step(manifest, 10)
    write_result(run.results, ok_result(first, [1.0], ["10"]))
    index = ResultIndex(run.results)
    index.refresh(only_steps={10})
    write_result(run.results, ok_result(second, [0.0], ["10"]))
    assert not write_step_summary(index, manifest, 10) and not _summaries(run)
    index.refresh(only_steps={10})
    (run.results / step_dir_name(10) / "0000000010.add.00009.json").write_text("{not json")
    index.refresh(only_steps={10})
    assert not write_step_summary(index, manifest, 10) and not _summaries(run)


def _printed(table: object, width: int, color: bool = False) -> str:
    console = Console(file=io.StringIO(), width=width, force_terminal=color, color_system="truecolor" if color else None)
    console.print(table)
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_plain_table_prints_what_rich_prints() -> None:
    rows = [("10", "0.250±0.010", "", "busy×2"), ("2000", "nan", "x", "-"), ("3", "1.000", "yy", "[b]bold[/b]")]
    for cells in (rows[:2], rows):  # plain cells (written fast), then one with markup (rich throughout)
        for width, color in ((200, False), (30, False), (200, True)):  # fits; folds; a colour terminal
            plain, rich = PlainTable(TITLE), Table(title=TITLE)
            for header, justify in (("step", "right"), ("add ±se", "right"), ("note", "left"), ("skips", "right")):
                plain.add_column(header, justify=justify, overflow="fold")
                rich.add_column(header, justify=justify, overflow="fold")  # type: ignore[arg-type]
            for row in cells:
                plain.add_row(*row)
                rich.add_row(*row)
            assert _printed(plain, width, color) == _printed(rich, width, color), (width, color)
            assert plain.maximum_width() == Console(width=10_000, file=io.StringIO()).measure(rich).maximum


def test_the_service_ingester_writes_summaries(tmp_path: Path) -> None:
    """The service posture ingests through the same :func:`ingest_point`, with its own index: summaries too."""
    from ckpteval.jobs.ingest import ServiceIngester

    run = make_run(tmp_path, n_prompts=4, shard_size=2)
    for step in (10, 20):
        for unit in units_for_step(run.manifest(), step):
            write_result(run.results, ok_result(unit, [1.0, 0.0], [str(step)] * 2))
    ingester = ServiceIngester(run, MetricsSink(run.service_metrics_path))
    assert ingester.poll() == [10, 20]
    assert [p.parent.name for p in _summaries(run)] == [step_dir_name(10), step_dir_name(20)]
    assert _shown(run) == _without_summaries(run)
