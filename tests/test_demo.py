"""`ckpteval demo` end to end, every posture, as a real process tree (trainer + workers/service).

Runs are tiny (20 steps, 16 eval prompts, a sampled set of 2 samples per prompt) so the test checks the
wiring — every point lands (step 0 included where the trainer evaluates), pinned to its step, the sampled
set's pass@k is in the table, and a PNG curve is written — not learning; the README shows a full run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckpteval.coord.atomic import read_jsonl
from tests.support.workers import wait_for

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize("posture", ["fleet-staging", "fleet-reuse", "shared", "service"])
def test_demo_posture_lands_every_point_pinned(tmp_path: Path, posture: str) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ckpteval.jobs.cli", "demo", "--posture", posture, "--steps", "20", "--eval-interval", "10",
         "--eval-n-prompts", "16", "--eval-samples", "2", "--run-dir", str(run_dir), "--staging", "run"],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "demo_summary.json").read_text())
    # steps 0 (initial weights), 10 and 20 (the final point); the service only sees the saved checkpoints
    assert summary["points_scored"] == (2 if posture == "service" else 3), summary
    assert summary["all_points_pinned"]
    assert set(summary["last_sampled"]) == {"score", "pass@1", "pass@2", "pass^2", "maj@2"}, summary
    assert "pass@2" in proc.stdout and "maj@2" in proc.stdout
    assert summary["skips"] == {}
    assert Path(summary["curve_png"]).read_bytes()[:4] == b"\x89PNG"
    assert "points of" in proc.stdout and "every point pinned to its step: True" in proc.stdout


def test_demo_rejects_bad_options(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "ckpteval.jobs.cli", "demo", "--posture", "fleet-reuse", "--workers", "0"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "needs --workers >= 1" in proc.stderr


# -- stopping the demo: Ctrl-C (SIGINT) and SIGTERM --------------------------------------------------------
def _processes_naming(text: str) -> list[int]:
    """PIDs of live processes whose command line mentions ``text`` (the run dir: trainer and workers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if text in cmdline and "zombie" not in state:
            pids.append(int(entry.name))
    return pids


def _exported_steps(run_dir: Path) -> set[int]:
    path = run_dir / "ledger.jsonl"
    if not path.exists():
        return set()
    return {rec["step"] for rec in read_jsonl(path) if rec.get("event") == "exported"}


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm: the tmpfs staging is what is under test")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_demo_stopped_by_a_signal_leaves_no_process_no_staging_and_no_unit_pending(tmp_path: Path, sig: int) -> None:
    """A stop signal mid-run (a snapshot exported, its units not all evaluated): one line, exit 128+N, the
    trainer and both workers stopped (no orphan process names the run dir), the run's tmpfs staging
    removed, the run marked INTERRUPTED, and every unit of a step whose snapshot went with the staging a
    ``ckpt_missing`` result — so status shows nothing pending and backfill agrees there is nothing to do."""
    run_dir = tmp_path / f"run-{signal.Signals(sig).name}"
    demo = subprocess.Popen(
        [sys.executable, "-m", "ckpteval.jobs.cli", "demo", "--steps", "400", "--eval-interval", "10", "--eval-n-prompts",
         "16", "--eval-samples", "0", "--run-dir", str(run_dir), "--staging", "shm"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        # the trainer may export step 0 before the demo has started its workers: wait for both
        wait_for(lambda: (_exported_steps(run_dir) and len(_processes_naming(str(run_dir))) >= 3)
                 or demo.poll() is not None, 240, what="a first exported snapshot and trainer + 2 workers")
        assert demo.poll() is None, demo.communicate()
        demo.send_signal(sig)
        out, err = demo.communicate(timeout=120)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.communicate()
    assert demo.returncode == 128 + sig, err
    assert "Traceback" not in err and "Traceback" not in out, err
    assert err.strip().splitlines() == [err.strip()] and "interrupted" in err and str(run_dir) in err, err
    wait_for(lambda: not _processes_naming(str(run_dir)), 10, what="no process of the run left")
    left = sorted(str(p) for p in (Path("/dev/shm") / "ckpteval" / run_dir.name).rglob("*"))
    assert not left, f"tmpfs staging left behind: {left[:20]}"
    marker = json.loads((run_dir / "INTERRUPTED").read_text())
    assert marker["signal"] == signal.Signals(sig).name and marker["by"] == "ckpteval demo"

    status = subprocess.run([sys.executable, "-m", "ckpteval.jobs.cli", "status", "--json", str(run_dir)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    state = json.loads(status.stdout)
    assert state["units"]["pending"] == [], state["units"]
    assert state["units"]["skipped"].get("ckpt_missing", 0) >= 1, state["units"]  # the exported step's units
    assert state["interrupted"]["signal"] == signal.Signals(sig).name
    table = subprocess.run([sys.executable, "-m", "ckpteval.jobs.cli", "status", str(run_dir)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert "training interrupted" in table.stdout and "pending 0" in table.stdout, table.stdout[-2000:]
    backfill = subprocess.run([sys.executable, "-m", "ckpteval.jobs.cli", "backfill", "--run-dir", str(run_dir), "--engine",
                               "hf"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert backfill.returncode == 0, backfill.stderr[-2000:]
    assert "nothing to do" in backfill.stdout, backfill.stdout


# -- the fleet on vLLM (--engine vllm; make demo ENGINE=vllm): the commands, no server ---------------------
def test_demo_engine_vllm_builds_vllm_workers_and_make_installs_vllm_on_that_path_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--engine vllm``: each worker runs ``--engine vllm`` with the KV-cache default for CPU, the trainer waits
    long enough for a server relaunched per snapshot; plain ``make demo`` never installs vLLM."""
    from ckpteval.jobs.reference import demo

    monkeypatch.setenv("CKPTEVAL_VLLM_PYTHON", sys.executable)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cfg = demo.parse_args(["--engine", "vllm", "--workers", "1", "--run-dir", str(tmp_path / "run")])
    args = demo.worker_args(cfg, tmp_path / "run", 0)
    assert args[args.index("--engine") + 1] == "vllm"
    assert demo.worker_env(cfg) == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    train = demo.trainer_args(cfg, tmp_path / "run")
    assert train[train.index("--eval-drain-timeout") + 1] == str(demo.VLLM_WAIT_S)
    hf = demo.parse_args(["--run-dir", str(tmp_path / "run2")])
    assert "--eval-drain-timeout" not in demo.trainer_args(hf, tmp_path / "run2") and demo.worker_env(hf) == {}
    hf_args = demo.worker_args(hf, tmp_path / "run2", 0)
    assert hf_args[hf_args.index("--engine") + 1] == "hf"

    plain = subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    on_vllm = subprocess.run(["make", "-n", "demo", "ENGINE=vllm"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert plain.returncode == on_vllm.returncode == 0, plain.stderr + on_vllm.stderr
    if not (ROOT / ".venv-vllm" / ".installed").exists():  # make -n lists vllm-setup's commands only when due
        assert "vllm-cpu" in on_vllm.stdout
    assert "vllm-cpu" not in plain.stdout and "demo --engine hf" in plain.stdout
    assert "demo --engine vllm" in on_vllm.stdout


def test_demo_engine_vllm_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from ckpteval.jobs.reference import demo

    monkeypatch.setenv("CKPTEVAL_VLLM_PYTHON", sys.executable)
    with pytest.raises(ValueError, match="shared posture evaluates in the trainer's process"):
        demo.parse_args(["--engine", "vllm", "--posture", "shared"])
    monkeypatch.setenv("CKPTEVAL_VLLM_PYTHON", str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="is not an executable python"):
        demo.parse_args(["--engine", "vllm"])
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is importable in this venv: the demo's workers would run it")
    monkeypatch.delenv("CKPTEVAL_VLLM_PYTHON")
    proc = subprocess.run([sys.executable, "-m", "ckpteval.jobs.cli", "demo", "--engine", "vllm"], cwd=ROOT,
                          capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                               if k != "CKPTEVAL_VLLM_PYTHON"}, timeout=120)
    assert proc.returncode == 2 and "make demo ENGINE=vllm" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
