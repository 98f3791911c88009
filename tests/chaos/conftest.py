"""The chaos suite's report: a table of every fault class at the end of the session (bench/CHAOS.md at full
scale), plus fixtures that clean up every process a scenario started."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos import harness

REPORT_PATH = harness.REPO / "bench" / "CHAOS.md"


_COMPLETE = {"value": False}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    files = set()
    for item in items:
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.chaos)
            files.add(Path(str(item.fspath)).name)
    # bench/CHAOS.md is the record of the whole suite: a selection (one file, -k, -m) does not overwrite it
    everything = {p.name for p in here.glob("test_*.py")}
    _COMPLETE["value"] = files == everything and not config.option.keyword and not config.option.markexpr


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
    if harness.FULL and _COMPLETE["value"]:
        terminalreporter.write_line(f"saved to {REPORT_PATH}")


KEEP_MARKER = "<!-- sections below are written by other reports and kept when the chaos table is regenerated -->"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if harness.ROWS and harness.FULL and _COMPLETE["value"]:
        old = REPORT_PATH.read_text() if REPORT_PATH.exists() else ""
        kept = old[old.index(KEEP_MARKER):] if KEEP_MARKER in old else ""
        REPORT_PATH.write_text(harness.report_markdown(harness.ROWS) + ("\n" + kept if kept else ""))


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[harness.Procs]:
    """Processes of one scenario (logs under tmp_path/logs); survivors are killed by pid at teardown."""
    p = harness.Procs(tmp_path / "logs")
    try:
        yield p
    finally:
        p.reap()
