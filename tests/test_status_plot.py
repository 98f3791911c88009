"""`ckpteval status` and `ckpteval plot` over a real run dir built through the protocol."""

from __future__ import annotations

import json
import os
import shlex
import signal
import struct
import subprocess
import sys
from pathlib import Path

from ckpteval.coord.results.files import ok_result, write_point_skip, write_result
from ckpteval.coord.run.identity import run_key
from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.snapshots.snapshot import publish_snapshot
from ckpteval.coord.work.claims import UnitClaimer
from ckpteval.coord.work.units import WorkUnit, units_for_step
from ckpteval.jobs.views.plot import figure, plot_run, plot_series
from ckpteval.jobs.views.status.main import collect_status, health_line
from tests.support.runs import make_run, write_tiny_shards
from tests.support.workers import wait_for

ROOT = Path(__file__).parents[1]


def _build_run(tmp_path: Path):
    run = make_run(tmp_path, n_prompts=4, shard_size=2)
    m = run.manifest()
    ledger = Ledger(run.ledger_path)
    key = run_key(m)  # as the run's trainer stamps its markers
    for step, score in ((10, 0.25), (20, 0.75)):
        publish_snapshot(run.snapshots, step, lambda d: write_tiny_shards(d, n_shards=1, numel=8), run=key)
        ledger.append("dispatched", step)
        for unit in units_for_step(m, step):
            write_result(run.results, ok_result(unit, [score, score], [str(step)] * 2))
        ledger.append("ingested", step)
        with open(run.metrics_path, "a") as f:
            f.write(json.dumps({"step": step, "eval/step": step, "eval/lag_steps": 3}) + "\n")
    write_point_skip(run.results, m, 30, "busy")
    publish_snapshot(run.snapshots, 40, lambda d: write_tiny_shards(d, n_shards=1, numel=8), run=key)
    # a marker without a run key in the run's own staging: not its snapshot (the worker ignores it too)
    publish_snapshot(run.snapshots, 50, lambda d: write_tiny_shards(d, n_shards=1, numel=8))
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
    out = subprocess.run([sys.executable, "-m", "ckpteval.jobs.cli", "status", str(run.path), "--json"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(out.stdout)["run_id"] == "test-run"
    table = subprocess.run([sys.executable, "-m", "ckpteval.jobs.cli", "status", str(run.path)],
                           capture_output=True, text=True, check=True, cwd=ROOT, env={"COLUMNS": "200", "PATH": ""})
    assert "points of test-run" in table.stdout and "busy×2" in table.stdout
    bad = subprocess.run([sys.executable, "-m", "ckpteval.jobs.cli", "status", str(tmp_path / "nope")],
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


def test_plot_without_o_writes_into_the_run_dir_not_the_working_dir(tmp_path: Path) -> None:
    """``ckpteval plot RUN`` (no ``-o``) writes ``RUN/curve.png`` and prints its path (was: ``./curve.png`` in
    whatever directory the command ran from, one run's curve overwriting another's)."""
    run, claim = _build_run(tmp_path)
    claim.release()
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    proc = subprocess.run([sys.executable, "-m", "ckpteval.jobs.cli", "plot", str(run.path)], capture_output=True,
                          text=True, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT.parent)})
    assert proc.returncode == 0, proc.stderr
    assert not (cwd / "curve.png").exists()
    assert proc.stdout.strip() == str(run.path / "curve.png")
    assert (run.path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _status_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ckpteval.jobs.cli", "status", *args]


def test_status_watch_takes_run_either_way_and_ends_quietly_on_ctrl_c_or_sigterm(tmp_path: Path) -> None:
    """``status --watch RUN`` reads RUN as the run dir (not as a bad interval); Ctrl-C and SIGTERM end a
    watch without a traceback, also when the watch was started with SIGINT ignored (a background job)."""
    run, claim = _build_run(tmp_path)
    claim.release()
    for argv, sig in ((["--watch", str(run.path)], signal.SIGINT),
                      (["--watch", "0.2", "--run-dir", str(run.path)], signal.SIGTERM)):
        # started as a shell starts a background job (``&``, nohup): SIGINT ignored, which the watch must undo
        proc = subprocess.Popen(_status_cmd(*argv), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "COLUMNS": "200"},
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        try:
            wait_for(lambda p=proc: p.poll() is not None or _printed(run.path, p), 60, what="a first refresh")
            assert proc.poll() is None, proc.communicate()
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        assert proc.returncode == (0 if sig == signal.SIGINT else 128 + sig), err
        assert "points of test-run" in out


def _printed(run_dir: Path, proc: subprocess.Popen) -> bool:
    """The watch has drawn once: the process's status table reached its stdout pipe (peeked without reading)."""
    import select

    return bool(select.select([proc.stdout], [], [], 0)[0])


def test_status_json_into_head_has_no_traceback(tmp_path: Path) -> None:
    """``status --json | head``: the reader closes the pipe early; status ends quietly (no BrokenPipeError)."""
    run = make_run(tmp_path, n_prompts=3000, shard_size=1)  # 3000 pending units: JSON far beyond a pipe buffer
    publish_snapshot(run.snapshots, 10, lambda d: write_tiny_shards(d, n_shards=1, numel=8))
    err = tmp_path / "stderr"
    proc = subprocess.run(f"{shlex.join(_status_cmd('--json', str(run.path)))} 2>{shlex.quote(str(err))} | head -n 3",
                          shell=True, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert len(proc.stdout.splitlines()) == 3
    assert err.read_text() == ""


def test_status_and_plot_take_run_dir_as_flag_too_and_health_line_has_no_dangling_separator(tmp_path: Path) -> None:
    run, claim = _build_run(tmp_path)
    claim.release()
    positional = subprocess.run(_status_cmd("--json", str(run.path)), cwd=ROOT, capture_output=True, text=True)
    flag = subprocess.run(_status_cmd("--json", "--run-dir", str(run.path)), cwd=ROOT, capture_output=True, text=True)
    assert flag.returncode == 0 and json.loads(flag.stdout)["run_id"] == json.loads(positional.stdout)["run_id"]
    two = subprocess.run(_status_cmd(str(run.path), "--run-dir", str(tmp_path)), cwd=ROOT, capture_output=True,
                         text=True)
    assert two.returncode == 2 and "two run directories" in two.stderr and "Traceback" not in two.stderr
    none = subprocess.run(_status_cmd("--json"), cwd=ROOT, capture_output=True, text=True)
    assert none.returncode == 2 and "give RUN or --run-dir RUN" in none.stderr
    png = tmp_path / "c.png"
    plot = subprocess.run([sys.executable, "-m", "ckpteval.jobs.cli", "plot", "--run-dir", str(run.path), "-o", str(png)],
                          cwd=ROOT, capture_output=True, text=True)
    assert plot.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG", plot.stderr
    status = collect_status(run.path)
    status["health"]["staging_free_bytes"] = {}  # a staging root that does not exist (yet)
    line = health_line(status)
    assert not line.rstrip().endswith("|") and line.startswith("training running | units done 4"), line


def test_plot_legend_is_off_the_data_and_the_lag_panel_only_when_there_is_lag(tmp_path: Path) -> None:
    """The legend sits outside the score axes (it cannot cover a point); a run without lag (service,
    backfill: no trainer ingested its points) gets no empty lag panel."""
    run, claim = _build_run(tmp_path)
    claim.release()
    data = plot_series(collect_status(run.path))
    fig = figure(data, "t")
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent()
    assert not legend.overlaps(ax.get_window_extent()), (legend, ax.get_window_extent())
    assert len(fig.axes) == 2  # a trainer run: scores + lag
    data["lag"] = ([], [])
    assert len(figure(data, "t").axes) == 1


def _scored_run(tmp_path: Path, scores: tuple[float, ...], datasets: tuple[str, ...] = ("add",)):
    """A run whose every unit is scored: per step ``10 * (i + 1)`` the samples score ``s`` and ``s + 1/8``
    (so a point's mean and standard error need all three decimals); no snapshot, nothing pending."""
    run = make_run(tmp_path, n_prompts=4, shard_size=2, datasets=datasets)
    m = run.manifest()
    for i, score in enumerate(scores):
        for unit in units_for_step(m, 10 * (i + 1)):
            write_result(run.results, ok_result(unit, [score, score + 0.125], [str(10 * (i + 1))] * 2))
    return run


def test_status_piped_at_80_columns_cuts_no_number_and_empty_sections_are_one_line(tmp_path: Path) -> None:
    """``ckpteval status`` into a pipe with COLUMNS=80 (a SLURM log, ``watch``): no cell is ellipsized,
    every point's score ± stderr is printed whole, and the empty snapshot / pending-unit sections are a
    line each instead of empty tables."""
    run = _scored_run(tmp_path, (0.125, 0.5, 0.875), datasets=("addition", "multiplication", "subtraction"))
    out = subprocess.run(_status_cmd(str(run.path)), cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "COLUMNS": "80"}).stdout
    assert "…" not in out, out
    assert max(len(line) for line in out.splitlines() if "│" in line or "┃" in line) <= 80, out
    points = collect_status(run.path)["points"]
    cells = [f"{d['score']:.3f}±{d['stderr']:.3f}" for p in points for d in p["datasets"].values()]
    assert len(cells) == 9 and all(cell in out for cell in cells), (cells, out)
    assert "snapshots: none" in out.splitlines() and "pending units: none" in out.splitlines(), out
    assert "claimed by" not in out and "retired" not in out, out  # no empty snapshot or pending-unit table


def test_status_of_two_runs_shows_each(tmp_path: Path) -> None:
    """``ckpteval status RUN_A RUN_B``: one block per run, each with its own points; ``--json`` a list."""
    a = _scored_run(tmp_path / "a", (0.125, 0.5))
    b = _scored_run(tmp_path / "b", (0.25, 0.625, 0.875))
    out = subprocess.run(_status_cmd(str(a.path), str(b.path)), cwd=ROOT, capture_output=True, text=True,
                         check=True, env={**os.environ, "COLUMNS": "120"}).stdout
    block_a, block_b = out.split(f"({b.path})")
    assert f"({a.path})" in block_a
    for block, run in ((block_a, a), (block_b, b)):
        cells = [f"{d['score']:.3f}±{d['stderr']:.3f}" for p in collect_status(run.path)["points"]
                 for d in p["datasets"].values()]
        assert cells and all(cell in block for cell in cells), (cells, block)
    assert "0.688±" in block_b and "0.688±" not in block_a  # step 30 exists in run B only
    js = json.loads(subprocess.run(_status_cmd("--json", str(a.path), str(b.path)), cwd=ROOT, capture_output=True,
                                   text=True, check=True).stdout)
    assert [s["run_dir"] for s in js] == [str(a.path), str(b.path)]
    assert [len(s["points"]) for s in js] == [2, 3]


def test_plot_of_two_runs_overlays_them_by_step_a_colour_each(tmp_path: Path) -> None:
    """``ckpteval plot RUN_A RUN_B -o out.png`` writes one PNG; the legend names both runs (by dir:
    both are ``test-run``), each run in its own colour with its ± stderr band."""
    from ckpteval.jobs.views.plot import figure, plot_runs

    a = _scored_run(tmp_path / "a", (0.125, 0.5))
    b = _scored_run(tmp_path / "b", (0.25, 0.625, 0.875))
    png = tmp_path / "two.png"
    proc = subprocess.run([sys.executable, "-m", "ckpteval.jobs.cli", "plot", str(a.path), str(b.path), "-o", str(png)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", proc.stderr
    runs = plot_runs([a.path, b.path], tmp_path / "again.png")
    assert [label for label, _ in runs] == [str(a.path), str(b.path)]
    assert runs[0][1]["series"]["add"][0] == [10, 20] and runs[1][1]["series"]["add"][0] == [10, 20, 30]
    ax = figure(runs, "t").axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [f"{a.path} add", f"{b.path} add"], legend
    colours = [line.get_color() for line in ax.get_lines()]
    assert len(set(colours)) == 2, colours
    assert len(ax.collections) == 2  # a stderr band per run


def _hf_weights(directory: Path) -> None:
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.zeros(8)}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text('{"model_type": "llama"}')


def _watched_run(tmp_path: Path, watch: Path) -> Path:
    from ckpteval.jobs.eval.worker.evalconfig import create_run_from_config

    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "sums.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    cfg = tmp_path / "eval.json"
    cfg.write_text(json.dumps({"eval": {"datasets": [{"name": "sums", "path": "sums.jsonl", "n_prompts": 1,
                                                      "scorer": "exact", "shard_size": 1, "max_new_tokens": 2}]}}))
    return create_run_from_config(tmp_path / "run", cfg, (watch,)).path


def test_status_shows_saves_waiting_for_their_trainers_signal(tmp_path: Path) -> None:
    """A verl save without its tracker file and a prime-rl step without its marker are not admitted; status
    names each, its layout, the signal it waits for and since when — not `snapshots: none` alone."""
    from ckpteval.jobs.views.status.main import render, waiting_table

    verl = tmp_path / "verl"
    _hf_weights(verl / "global_step_20" / "actor" / "huggingface")
    prime = tmp_path / "prime"
    (prime / "weights" / "step_30").mkdir(parents=True)
    (prime / "weights" / "step_30" / "STABLE").touch()  # old layout: a finished step_30 reveals prime-rl ...
    _hf_weights(prime / "weights" / "step_40")  # ... step_40 waits for its STABLE
    run = _watched_run(tmp_path, verl)
    status = collect_status(run)
    [w] = status["waiting"]
    assert (w["step"], w["layout"]) == (20, "verl") and "latest_checkpointed_iteration.txt" in w["waits_for"]
    assert w["since"] is not None and abs(w["since"] - os.stat(verl / "global_step_20" / "actor" / "huggingface"
                                                                / "model.safetensors").st_mtime) < 5
    rendered = " ".join(str(getattr(t, "title", t)) for t in render(status))
    assert "saves found, not admitted" in rendered
    table = waiting_table(status["waiting"], now=w["since"] + 7)
    assert table.rows[0][:3] == ("20", "verl", w["waits_for"]) and table.rows[0][3].endswith("(7s)")
    (verl / "latest_checkpointed_iteration.txt").write_text("20")
    assert "a worker to admit it" in collect_status(run)["waiting"][0]["waits_for"]  # signal there, no worker yet
    prime_status = collect_status(_watched_run(tmp_path / "p", prime))
    assert [(w["step"], w["layout"]) for w in prime_status["waiting"]] == [(30, "prime-rl"), (40, "prime-rl")]
    assert "HF weights" in prime_status["waiting"][0]["waits_for"]  # marked but empty: no weights
    assert "STABLE" in prime_status["waiting"][1]["waits_for"]


def test_status_table_shows_the_scorers_counters(tmp_path: Path) -> None:
    """Counters a scorer keeps per sample (code: errors, timeouts) are in the table, not only in --json."""
    from ckpteval.jobs.views.status.main import points_table

    run = make_run(tmp_path, n_prompts=4, shard_size=2)
    m = run.manifest()
    for i, unit in enumerate(units_for_step(m, 10)):
        write_result(run.results, ok_result(unit, [0.0, 1.0], ["10"] * 2, counters={"code_errors": 1 + i, "timeouts": 1}))
    table = points_table(collect_status(run.path))
    headers = [c.header for c in table.columns]
    assert "add counts" in headers
    assert table.rows[0][headers.index("add counts")] == "code_errors=3 timeouts=2"  # summed over the shards


def test_plot_of_a_single_step_has_whole_step_ticks(tmp_path: Path) -> None:
    """One point (step 10): the x axis shows whole steps around it, not matplotlib's 9.96…10.04."""
    run = make_run(tmp_path, n_prompts=4, shard_size=2)
    for unit in units_for_step(run.manifest(), 10):
        write_result(run.results, ok_result(unit, [0.5, 0.5], ["10"] * 2))
    fig = figure(plot_series(collect_status(run.path)), "one step")
    ax = fig.axes[0]
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks) and 10 in ticks, ticks


def test_a_scored_point_the_stopped_trainer_never_logged_is_not_pending(tmp_path: Path) -> None:
    """Ctrl-C'd trainer (INTERRUPTED), a point dispatched and then fully scored: not `ledger_pending` forever,
    but `scored_not_logged`, and the health line says what a --resume does."""
    run = make_run(tmp_path, n_prompts=4, shard_size=2)
    Ledger(run.ledger_path).append("dispatched", 10)
    Ledger(run.ledger_path).append("dispatched", 20)
    for unit in units_for_step(run.manifest(), 10):
        write_result(run.results, ok_result(unit, [1.0, 1.0], ["10"] * 2))
    run.mark_interrupted("ckpteval train", "SIGINT")
    status = collect_status(run.path)
    assert status["health"]["ledger_pending"] == [20] and status["health"]["scored_not_logged"] == [10]
    assert "scored, never logged by the stopped trainer: steps 10" in health_line(status)
