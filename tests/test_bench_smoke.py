"""Every benchmark still runs (issue 16): each ``bench/bench_*.py`` in its smoke mode (``bench.run_all.SMOKE``:
tiny sizes, seconds each) as a real subprocess must exit 0 and print its ratio line. The numbers are not
asserted (no timing asserts; the machine is shared) — this is what makes a benchmark that no longer runs
(``bench_stall.py`` once died on the resume of an explicit staging dir) fail CI instead of ``make bench``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.run_all import SMOKE

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (REPO / "bench").glob("bench_*.py"))


def test_every_benchmark_has_a_smoke_mode() -> None:
    assert sorted(SMOKE) == SCRIPTS, "add the new benchmark's smoke arguments to bench/run_all.py SMOKE"


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_smoke_run(script: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), *SMOKE.get(script, [])], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{out[-4000:]}"
    assert re.search(r"\bratio\b", proc.stdout, re.IGNORECASE), f"{script} printed no ratio line:\n{out[-4000:]}"


def test_a_merge_rewrites_only_the_re_measured_sections_and_keeps_the_hand_written_ones() -> None:
    """``run_all.py --only X --merge``: the header, the goals and X's section are the new report's; every other
    section of the old RESULTS.md (a hand-measured one, another benchmark's) stays as it was, in its place."""
    from bench.run_all import keep_written

    old = ("# results\nold header\n## Machine\nold machine\n## Goals\nold goals\n## Code sandbox\nold sandbox\n"
           "## Code sandbox: by hand\nnotes\n## Export\nold export\n")
    new = "# results\nnew header\n## Machine\nnew machine\n## Goals\nnew goals\n## Code sandbox\nnew sandbox\n" \
          "## Export\nnew export\n## Fleet\nnew fleet\n"
    assert keep_written(new, old, {"Code sandbox"}) == (
        "# results\nnew header\n## Machine\nnew machine\n## Goals\nnew goals\n## Code sandbox\nnew sandbox\n"
        "## Code sandbox: by hand\nnotes\n## Export\nold export\n## Fleet\nnew fleet\n")
