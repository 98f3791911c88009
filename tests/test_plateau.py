"""The plateau stopping rule (``--eval-stop-plateau``, #40): its parse, its false-stop rate by simulation against
the nominal error, and a real reference trainer that stops on it (ledger ``stop_requested`` with the rule)."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import binom, norm

from ckpteval.coord.results.files import ok_result, write_result
from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
from ckpteval.coord.work.units import shard_range, units_for_step
from ckpteval.jobs.trainer.plateau import PlateauRule, PointValue, parse_plateau
from tests.support.training import make_train_run, train_beside


def test_the_rule_parses_and_refuses_with_one_line_naming_the_flag() -> None:
    assert parse_plateau("eval/gsm8k over 5", "F") == PlateauRule("eval/gsm8k", 5, 0.05)
    assert parse_plateau(" eval/a over 3 alpha 0.1 ", "F").alpha == 0.1
    for bad in ("eval/a/pass@4 over 3", "eval/a over 0", "eval/a over 3 alpha 1.5", "eval/a >= 3", "a over 3"):
        with pytest.raises(ValueError, match="^--eval-stop-plateau"):
            parse_plateau(bad, "--eval-stop-plateau")


def test_the_looks_spend_the_error_once() -> None:
    rule = PlateauRule("eval/a", 3, 0.05)
    assert math.isclose(sum(rule.look_alpha(k) for k in range(1, 200_000)), 0.05, rel_tol=1e-4)


def _false_stops(rule: PlateauRule, pre: int, se: float, reps: int, rng: np.random.Generator) -> int:
    """Runs (of ``reps``) stopped at a look whose window holds a point truly better than every earlier point by
    the MDE: ``pre`` flat points, then a jump of exactly the MDE (the least favourable case)."""
    jump = (norm.ppf(0.975) + norm.ppf(0.8)) * se * math.sqrt(2)
    stops = 0
    for _ in range(reps):
        history = [PointValue(t, (jump if t >= pre else 0.0) + rng.normal(0, se), se) for t in range(pre + rule.window)]
        stops += any(rule.verdict(history[: t + 1]) is not None for t in range(pre, pre + rule.window))
    return stops


@pytest.mark.parametrize("pre", [2, 5])
def test_false_stop_rate_is_at_most_nominal_by_simulation(pre: int) -> None:
    rule, reps = PlateauRule("eval/a", 3, 0.2), 600
    stops = _false_stops(rule, pre, 0.02, reps, np.random.default_rng(40 + pre))
    assert stops <= binom.ppf(0.999, reps, rule.alpha), f"{stops}/{reps} false stops at nominal {rule.alpha}"


def test_without_spending_the_same_looks_stop_falsely_more_often() -> None:
    """What the spending buys: the same rule with the whole error at every look stops falsely more often."""
    spent = PlateauRule("eval/a", 3, 0.2)
    unspent = PlateauRule("eval/a", 3, 0.2)
    object.__setattr__(unspent, "look_alpha", lambda look: 0.2)
    a = _false_stops(spent, 5, 0.02, 400, np.random.default_rng(7))
    b = _false_stops(unspent, 5, 0.02, 400, np.random.default_rng(7))
    assert b > a


def test_a_flat_curve_below_its_best_stops() -> None:
    history = [PointValue(10 * t, v, 0.03) for t, v in enumerate([0.1, 0.3, 0.6, 0.45, 0.45, 0.45])]
    verdict = PlateauRule("eval/a", 3).verdict(history)
    assert verdict is not None and verdict.best_step == 20 and verdict.window == (30, 40, 50)
    assert PlateauRule("eval/a", 3).verdict(history[:-1]) is None  # the window still holds the best
    no_se = [PointValue(p.step, p.value, 0.0) for p in history]
    assert PlateauRule("eval/a", 3).verdict(no_se) is None  # no standard error: no look


def _value(step: int) -> float:
    return step / 100 if step <= 60 else 0.4  # rises by 0.1 a point to 0.6 at step 60, then 0.4


def _fleet(run: RunDir, stop: threading.Event) -> None:
    """Score prompt i of step s 1.0 when i < value(s) x prompts (so each point has a standard error)."""
    manifest = run.manifest()
    discovery, done = SnapshotDiscovery(Path(manifest.snapshot_roots[0])), set()
    while not stop.is_set():
        for ref in discovery.poll():
            if ref.step in done:
                continue
            for unit in units_for_step(manifest, ref.step):
                prompts = shard_range(manifest, unit)
                scores = [float(i < round(_value(ref.step) * 40)) for i in prompts]
                write_result(run.results, ok_result(unit, scores, [str(ref.step)] * len(scores)))
            done.add(ref.step)
        stop.wait(0.05)


def test_the_trainer_stops_on_the_plateau(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    run, _ = make_train_run(run_dir, eval_interval=10, eval_n_prompts=40, eval_shard_size=20,
                            eval_max_in_flight=4, eval_keep_snapshots=4)
    code = train_beside(run, _fleet, ["--run-dir", str(run_dir), "--resume", "--steps", "5000", "--batch-size", "8",
                                      "--no-progress", "--eval-interval", "10", "--eval-poll-interval", "0",
                                      "--eval-max-in-flight", "4", "--eval-keep-snapshots", "4",
                                      "--eval-stop-plateau", "eval/addition over 3"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["stopped"]["point_step"] == 90, summary
    assert "no point of steps 70..90 beats step 60" in summary["stopped"]["reason"]
    record = Ledger(run.ledger_path, repair=False).state.stop_requested[90]
    assert record["rule"] == "plateau" and record["condition"] == "eval/addition over 3 alpha 0.05"
    assert record["best_step"] == 60
