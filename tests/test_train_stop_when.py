"""``ckpteval train --eval-stop-when COND``: the trainer finishes cleanly once an ingested point meets it.

The reference trainer runs in-process with an engine-free fleet thread whose scores are known in
advance (every unit of step ``s`` scores ``min(1, s / 100)``), so the first point meeting
``eval/addition >= 0.2`` is step 20.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
from ckpteval.jobs.reference.train.main import main
from tests.support.training import eval_lines, fill_results, make_train_run


def _fleet(run: RunDir, stop: threading.Event) -> None:
    """Fill results for every snapshot it discovers: step ``s`` scores ``min(1, s / 100)``."""
    discovery, done = SnapshotDiscovery(Path(run.manifest().snapshot_roots[0])), set()
    while not stop.is_set():
        for ref in discovery.poll():
            if ref.step not in done:
                fill_results(run, ref.step, score=min(1.0, ref.step / 100))
                done.add(ref.step)
        stop.wait(0.05)


def test_training_stops_cleanly_at_the_first_point_meeting_the_condition(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    run, _ = make_train_run(run_dir, eval_interval=10, eval_max_in_flight=4, eval_keep_snapshots=4)
    stop = threading.Event()
    fleet = threading.Thread(target=_fleet, args=(run, stop), daemon=True)
    fleet.start()
    try:
        code = main(["--run-dir", str(run_dir), "--resume", "--steps", "5000", "--batch-size", "8", "--no-progress",
                     "--eval-interval", "10", "--eval-poll-interval", "0", "--eval-max-in-flight", "4",
                     "--eval-keep-snapshots", "4", "--eval-stop-when", "eval/addition >= 0.2"])
    finally:
        stop.set()
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    final = summary["final_step"]
    assert summary["stopped"] == {"reason": "--eval-stop-when eval/addition >= 0.2", "point_step": 20}
    assert 20 <= final < 5000 and run.training_done() == final
    state = Ledger(run.ledger_path, repair=False).state
    assert list(state.stop_requested) == [20] and state.stop_requested[20]["condition"] == "eval/addition >= 0.2"
    assert final in {int(r["eval/step"]) for r in eval_lines(run_dir)}  # the final point landed
    assert (run.train_ckpt / f"step-{final:010d}").is_dir()  # the final training checkpoint


def test_a_stop_condition_on_an_unknown_dataset_is_one_line(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    make_train_run(run_dir)
    assert main(["--run-dir", str(run_dir), "--resume", "--steps", "2", "--no-progress",
                 "--eval-stop-when", "eval/nope >= 0.2"]) == 2
    err = capsys.readouterr().err
    assert "--eval-stop-when" in err and "no dataset or task 'nope'" in err and len(err.strip().splitlines()) == 1
