"""`ckpteval status` and `ckpteval plot` over a real run dir built through the protocol."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

from coord.ledger import Ledger
from coord.results import ok_result, write_point_skip, write_result
from coord.snapshot import publish_snapshot
from coord.units import UnitClaimer, WorkUnit, units_for_step
from jobs.views.plot import plot_run
from jobs.views.status import collect_status
from tests.support.runs import make_run, write_tiny_shards

ROOT = Path(__file__).parents[1]


def _build_run(tmp_path: Path):
    run = make_run(tmp_path, n_prompts=4, shard_size=2)
    m = run.manifest()
    ledger = Ledger(run.ledger_path)
    for step, score in ((10, 0.25), (20, 0.75)):
        publish_snapshot(run.snapshots, step, lambda d: write_tiny_shards(d, n_shards=1, numel=8))
        ledger.append("dispatched", step)
        for unit in units_for_step(m, step):
            write_result(run.results, ok_result(unit, [score, score], [str(step)] * 2))
        ledger.append("ingested", step)
        with open(run.metrics_path, "a") as f:
            f.write(json.dumps({"step": step, "eval/step": step, "eval/lag_steps": 3}) + "\n")
    write_point_skip(run.results, m, 30, "busy")
    publish_snapshot(run.snapshots, 40, lambda d: write_tiny_shards(d, n_shards=1, numel=8))
    claim = UnitClaimer(run.leases, m.lease).try_claim(WorkUnit(40, "add", 0))
    return run, claim


def test_status_collects_snapshots_units_points(tmp_path: Path) -> None:
    run, claim = _build_run(tmp_path)
    try:
        status = collect_status(run.path)
    finally:
        claim.release()
    assert [s["step"] for s in status["snapshots"]] == [10, 20, 40]
    points = {p["step"]: p for p in status["points"]}
    assert points[10]["datasets"]["add"]["score"] == 0.25 and points[10]["lag_steps"] == 3
    assert points[30]["skips"] == {"busy": 2} and points[30]["complete"]
    assert not points[40]["complete"]
    pending = {p["unit"]: p for p in status["units"]["pending"]}
    assert set(pending) == {"0000000040.add.00000", "0000000040.add.00001"}
    assert pending["0000000040.add.00000"]["lease"]["expired"] is False
    assert "lease" not in pending["0000000040.add.00001"]
    assert status["units"]["done"] == 4 and status["units"]["skipped"] == {"busy": 2}


def test_status_cli_json_and_table(tmp_path: Path) -> None:
    run, claim = _build_run(tmp_path)
    claim.release()
    out = subprocess.run([sys.executable, "-m", "jobs.cli", "status", str(run.path), "--json"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(out.stdout)["run_id"] == "test-run"
    table = subprocess.run([sys.executable, "-m", "jobs.cli", "status", str(run.path)],
                           capture_output=True, text=True, check=True, cwd=ROOT, env={"COLUMNS": "200", "PATH": ""})
    assert "points of test-run" in table.stdout and "busy×2" in table.stdout
    bad = subprocess.run([sys.executable, "-m", "jobs.cli", "status", str(tmp_path / "nope")],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "no run.json" in bad.stderr


def test_plot_is_a_png_of_the_derived_points(tmp_path: Path) -> None:
    run, claim = _build_run(tmp_path)
    claim.release()
    out = tmp_path / "curve.png"
    data = plot_run(run.path, out)
    raw = out.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", raw[16:24])
    assert width > 300 and height > 200
    assert data["series"]["add"] == ([10, 20], [0.25, 0.75])
    assert data["skipped"] == [(30, "busy")]
    assert data["lag"] == ([10, 20], [3, 3])
