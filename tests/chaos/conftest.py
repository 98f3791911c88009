"""The chaos suite's report: a table of every fault class at the end of the session (bench/CHAOS.md at full
scale), plus fixtures that clean up every process a scenario started."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos import harness

REPORT_PATH = harness.REPO / "bench" / "CHAOS.md"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/chaos/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.chaos)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        harness.RESULTS[item.nodeid] = report.outcome


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not harness.ROWS:
        return
    terminalreporter.write_sep("=", f"chaos summary (scale: {harness.SCALE}, seed {harness.SEED})")
    terminalreporter.write_line(harness.table_markdown(harness.ROWS))
    if harness.FULL:
        terminalreporter.write_line(f"saved to {REPORT_PATH}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if harness.ROWS and harness.FULL:
        REPORT_PATH.write_text(harness.report_markdown(harness.ROWS))


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[harness.Procs]:
    """Processes of one scenario (logs under tmp_path/logs); survivors are killed by pid at teardown."""
    p = harness.Procs(tmp_path / "logs")
    try:
        yield p
    finally:
        p.reap()
