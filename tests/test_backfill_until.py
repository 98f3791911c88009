"""``ckpteval backfill --until COND``: evaluate saved checkpoints in step order, stop at the first passing.

Real backfill processes (two array tasks) on real snapshots; the backend is the real fn backend
:class:`StepBackend` below, whose score is known in advance (``min(1, step / 100)`` for every row), so
the first step passing ``eval/addition >= 0.3`` is step 30.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ckpteval.coord.run.rundir import step_dir_name
from ckpteval.jobs.lifecycle import EXIT_DONE
from tests.support.workers import (
    SumBackend,
    claimed_at,
    finish,
    kill_all,
    make_eval_run,
    publish_model,
    results,
    spawn,
)

FN = "fn:tests.test_backfill_until:StepBackend"
CTIME_SLACK_S = max(0.02, 4 * time.clock_getres(5))  # 5: CLOCK_REALTIME_COARSE, the clock file times come from


class StepBackend(SumBackend):
    """Every row of step ``s`` scores ``min(1, s / 100)`` (after the configured delay)."""

    def evaluate_checkpoint(self, checkpoint_dir: str, input: dict[str, Any]) -> dict[str, Any]:  # noqa: A002
        out = super().evaluate_checkpoint(checkpoint_dir, input)
        return {**out, "scores": [min(1.0, input["step"] / 100)] * len(out["scores"])}


def test_until_stops_every_array_task_at_the_first_passing_step(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=2, engine={"fn": {"delay_s": 0.2}})
    for step in range(10, 110, 10):
        publish_model(tmp_path, run.snapshots, step)
    procs = [spawn("backfill", "--run-dir", str(run.path), "--engine", FN, "--poll-interval", "0.1",
                   "--until", "eval/addition >= 0.3", "--worker-id", f"task{i}") for i in range(2)]
    try:
        outs = [finish(p, timeout=120) for p in procs]
    finally:
        kill_all(procs)
    assert [code for code, _ in outs] == [EXIT_DONE, EXIT_DONE], outs
    assert all("first step passing eval/addition >= 0.3: 30" in out for _, out in outs), outs
    got = results(run)
    # the point of step 30 completed when its last result became visible: the ctime its publication (rename or
    # link) set, not its written_at, stamped before the fsync that may take long on a loaded disk. A ctime comes
    # from the kernel's coarse clock, up to a tick or two behind the precise one claimed_at reads (4 ms ticks
    # here; 7.7 ms seen between a time.time() and the ctime of a file created right after it): a claim within
    # that slack may have read the step limit before the result was there. A unit that ignored the pass would
    # start after a whole unit's delay (0.2 s), far past it.
    passed_at = max(p.stat().st_ctime for p in (run.results / step_dir_name(30)).glob("*.json")) + CTIME_SLACK_S
    assert {u.step for u in got} >= {10, 20, 30}
    late = [u for u, r in got.items() if u.step > 30 and claimed_at(r) > passed_at]
    assert late == [], f"units of later steps started after step 30 passed: {late}"
    assert max(u.step for u in got) < 100  # not every checkpoint was evaluated
    record = json.loads(run.until_path.read_text())
    assert record["passing_step"] == 30 and record["evaluated_steps"] == [10, 20, 30]
    assert record["condition"] == "eval/addition >= 0.3"


def test_until_bad_input_is_one_line(tmp_path: Path) -> None:
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=2)
    for argv, says in (
        (["--until", "eval/addition => 0.3"], "expected 'eval/<dataset>[/pass@k] OP NUMBER'"),
        (["--until", "eval/nope >= 0.3"], "no dataset or task 'nope'"),
        (["--until", "eval/addition >= 0.3", "--order", "descending"], "use --order ascending"),
    ):
        code, out = finish(spawn("backfill", "--run-dir", str(run.path), "--engine", FN, *argv), 60)
        assert code == 2 and says in out and "Traceback" not in out, out
