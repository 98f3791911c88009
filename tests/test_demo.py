"""`ckpteval demo` end to end, every posture, as a real process tree (trainer + workers/service).

Runs are tiny (20 steps, 16 eval prompts, a sampled set of 2 samples per prompt) so the test checks the
wiring — every point lands (step 0 included where the trainer evaluates), pinned to its step, the sampled
set's pass@k is in the table, and a PNG curve is written — not learning; the README shows a full run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize("posture", ["fleet-staging", "fleet-reuse", "shared", "service"])
def test_demo_posture_lands_every_point_pinned(tmp_path: Path, posture: str) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "demo", "--posture", posture, "--steps", "20", "--eval-interval", "10",
         "--eval-n-prompts", "16", "--eval-samples", "2", "--run-dir", str(run_dir), "--staging", "run"],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "demo_summary.json").read_text())
    # steps 0 (initial weights), 10 and 20 (the final point); the service only sees the saved checkpoints
    assert summary["points_scored"] == (2 if posture == "service" else 3), summary
    assert summary["all_points_pinned"]
    assert set(summary["last_sampled"]) == {"score", "pass@1", "pass@2", "maj@2"}, summary
    assert "pass@2" in proc.stdout and "maj@2" in proc.stdout
    assert summary["skips"] == {}
    assert Path(summary["curve_png"]).read_bytes()[:4] == b"\x89PNG"
    assert "points of" in proc.stdout and "every point pinned to its step: True" in proc.stdout


def test_demo_rejects_bad_options(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "demo", "--posture", "fleet-reuse", "--workers", "0"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "needs --workers >= 1" in proc.stderr
