"""The chaos suite's report: a table of every fault class at the end of the session (bench/CHAOS.md at full
scale), plus fixtures that clean up every process a scenario started."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos import harness

REPORT_PATH = harness.REPO / "bench" / "CHAOS.md"


_COMPLETE = {"value": False}
_MATRIX_WHOLE = {"value": False}  # every cell of the requeue matrix selected


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    files = set()
    for item in items:
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.chaos)
            files.add(Path(str(item.fspath)).name)
    # bench/CHAOS.md is the record of the whole suite: a selection (one file, -k, -m) does not overwrite it
    everything = {p.name for p in here.glob("test_*.py")}
    unfiltered = not config.option.keyword and not config.option.markexpr
    _COMPLETE["value"] = files == everything and unfiltered
    _MATRIX_WHOLE["value"] = MATRIX_FILE in files and unfiltered


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


MATRIX_FILE = "test_requeue_matrix.py"
MATRIX_HEADING = "## Requeue matrix (issue 16)"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """At full scale: the whole suite rewrites the main table; the requeue matrix (run whole, alone or
    with the rest) rewrites its own section below :data:`KEEP_MARKER`."""
    if not harness.FULL:
        return
    matrix = [r for r in harness.ROWS if MATRIX_FILE in r.nodeid]
    others = [r for r in harness.ROWS if MATRIX_FILE not in r.nodeid]
    old = REPORT_PATH.read_text() if REPORT_PATH.exists() else ""
    if others and _COMPLETE["value"]:
        kept = old[old.index(KEEP_MARKER):] if KEEP_MARKER in old else ""
        old = harness.report_markdown(others) + ("\n" + kept if kept else "")
    if matrix and _MATRIX_WHOLE["value"]:
        old = replace_section(old if KEEP_MARKER in old else old + "\n" + KEEP_MARKER + "\n", MATRIX_HEADING,
                              harness.matrix_markdown(MATRIX_HEADING, matrix))
    if (others and _COMPLETE["value"]) or (matrix and _MATRIX_WHOLE["value"]):
        REPORT_PATH.write_text(old)


def replace_section(text: str, heading: str, section: str) -> str:
    """``text`` with the ``heading`` section (up to the next ``## `` heading) replaced by ``section``, or
    ``section`` appended below the keep marker when it is not there yet."""
    if heading in text:
        start = text.index(heading)
        end = text.find("\n## ", start + len(heading))
        return text[:start] + section + (text[end + 1:] if end >= 0 else "")
    at = text.index(KEEP_MARKER) + len(KEEP_MARKER)
    return text[:at] + "\n\n" + section + text[at:].lstrip("\n")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[harness.Procs]:
    """Processes of one scenario (logs under tmp_path/logs); survivors are killed by pid at teardown."""
    p = harness.Procs(tmp_path / "logs")
    try:
        yield p
    finally:
        p.reap()
