"""End to end: a trainer run whose eval config has a judged set, its judge killed mid-run, then a backfill.

Real processes throughout: the reference trainer (``ckpteval train``) with ``--eval-config`` naming a judged
set, one fleet worker (``ckpteval worker --engine hf``, the real tiny model), and the judge stand-in
(``ckpteval serve --judge exact``: ``VERDICT: 1`` when the completion equals the reference). The judge is
SIGKILLed once the first point is judged. The run is in reuse mode (its HF checkpoints are the snapshots
and are never deleted), so the backfill finds every snapshot; a staging snapshot is retired once its point
settles. Every point that was judged is pinned and logs the verdicts'
mean; every unit after the kill is a ``judge_failed`` skip (never a 0); a judge started again on the same
address and ``ckpteval backfill`` then supersede those skips (``results/<unit>.retry1.json``), answering
what was judged before from ``RUN/judge_cache/`` and paying the judge only for the rest.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from ckpteval.coord.results.files import Result, ResultIndex
from ckpteval.coord.results.points import derive_point, point_metrics
from ckpteval.coord.run.manifest import load_manifest
from ckpteval.coord.run.rundir import unit_dir
from ckpteval.coord.work.units import shard_range
from tests.support.workers import finish, kill_all, spawn, start_judge

pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(300)

ROWS = [{"prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"} for a, b in
        [(12, 30), (7, 7), (45, 45), (3, 9), (20, 20), (11, 1), (5, 50), (9, 9)]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def verdicts(run: Path, result: Result) -> list[float]:
    """What the stand-in judge says of each sample: its stripped completion (the result's answer) equals
    the row's reference."""
    manifest = load_manifest(run / "run.json")
    refs = [ROWS[i]["answer"] for i in shard_range(manifest, result.unit)]
    return [float(a == r) for a, r in zip(result.answers, refs, strict=True)]


def judge_requests(url: str) -> int:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/judge_stats", timeout=10) as r:
        return int(json.loads(r.read())["chat_completions"])


def test_judged_run_judge_killed_mid_run_then_backfilled(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "eval.json").write_text(json.dumps({"eval": {"datasets": [
        {"name": "qa", "path": "qa.jsonl", "n_prompts": len(ROWS), "shard_size": 4, "max_new_tokens": 4,
         "scorer": "judge", "scorer_options": {"url": url, "retries": 1, "timeout_s": 5}}]}}))
    run = tmp_path / "run"
    _, judge = start_judge("exact", tmp_path / "judge1.log", "--port", str(port))
    trainer = spawn("train", "--run-dir", str(run), "--steps", "30", "--eval-interval", "10", "--eval-config",
                    str(tmp_path / "eval.json"), "--threads", "1", "--no-progress",
                    "--save-hf", str(tmp_path / "hf"), "--save-interval", "10")  # reuse: checkpoints stay for the backfill
    worker = spawn("worker", "--run-dir", str(run), "--engine", "hf", "--poll-interval", "0.2", "--wait-for-run", "120")
    procs = [trainer, worker, judge]
    try:
        index = ResultIndex(run / "results")
        deadline = time.monotonic() + 180
        while sum(u.step == 0 for u in index.refresh()) < 2:  # point 0 (2 units) judged: kill the judge
            assert time.monotonic() < deadline and worker.poll() is None, "step 0 was never judged"
            time.sleep(0.1)
        judge.kill()
        judge.wait()
        rc_t, out_t = finish(trainer, 240)
        rc_w, out_w = finish(worker, 120)
        assert rc_t == 0 and rc_w == 0, out_t[-3000:] + out_w[-3000:]
    finally:
        kill_all(procs)

    # during the run: judged units carry the judge's verdicts, the rest are judge_failed skips (never a 0)
    results = ResultIndex(run / "results").refresh()
    assert len(results) == 8  # 4 points x 2 shards
    ok = [r for r in results.values() if r.ok]
    failed = [r for r in results.values() if not r.ok]
    assert {u.step for u in results if results[u].ok} >= {0} and failed
    assert all(r.skip_reason == "judge_failed" and "Connection error" in r.message for r in failed)
    for r in ok:
        assert list(r.scores) == verdicts(run, r)
        assert r.scorer["model"] == "ckpteval-judge"  # read from the judge's /v1/models
    logged = {int(m["eval/step"]): m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if "eval/step" in m}
    assert sorted(logged) == [0, 10, 20, 30]
    for step, m in logged.items():
        units = [r for r in results.values() if r.unit.step == step]
        if all(r.ok for r in units):
            flat = [v for r in sorted(units, key=lambda r: r.unit.shard) for v in verdicts(run, r)]
            assert m["eval/qa"] == pytest.approx(sum(flat) / len(flat))
            assert m["eval/qa/weight_version/mean"] == step and m["eval/qa/weight_version/mixed_version_ratio"] == 0
            assert m["eval/qa/judge_unparsed"] == 0 and 0 <= m["eval/qa/judge_cache_hit_rate"] <= 1
        else:
            assert "eval/qa" not in m and m["eval/skipped_judge_failed"] >= 1

    # the judge comes back on the same address; backfill supersedes every judge_failed skip
    cached_before = len(list((run / "judge_cache").glob("*/*.json")))
    _, judge = start_judge("exact", tmp_path / "judge2.log", "--port", str(port))
    try:
        rc, out = finish(spawn("backfill", "--run-dir", str(run), "--engine", "hf"), 240)
        assert rc == 0, out[-3000:]
        paid = judge_requests(url)
    finally:
        kill_all([judge])
    index = ResultIndex(run / "results")
    after = index.refresh()
    assert all(r.ok for r in after.values()), [r.message for r in after.values() if not r.ok]
    retried = [after[r.unit] for r in failed]
    assert all(index.generation(r.unit) == 1 for r in retried)
    assert all((unit_dir(run / "results", r.unit.step) / r.unit.result_name_at(1)).is_file()
               for r in retried)
    for r in retried:
        assert list(r.scores) == verdicts(run, r)
    # the cache answered what had been judged before, the judge only what was new
    samples = sum(len(r.scores) for r in retried)
    hits = sum(r.counters.get("judge_cache_hits", 0) for r in retried)
    assert paid == len(list((run / "judge_cache").glob("*/*.json"))) - cached_before
    assert hits == samples - paid
    manifest = load_manifest(run / "run.json")
    for step in logged:
        point = point_metrics(derive_point(manifest, step, {u: r for u, r in after.items() if u.step == step}))
        assert point["eval/qa/weight_version/mean"] == step
