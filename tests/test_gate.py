"""Shared-engine posture: a real producer thread generating on a real HFEngine while evals pause it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from ckpteval.coord.results.files import ResultIndex
from ckpteval.coord.results.points import derive_point
from ckpteval.jobs.eval.engines.base import SamplingParams
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.metrics import MetricsSink
from ckpteval.jobs.reference.model import ModelConfig, build_model
from ckpteval.jobs.trainer.dispatcher import EvalDispatcher
from ckpteval.jobs.trainer.gate import ProducerGate, SharedEval, shared_eval
from tests.support.training import eval_lines, make_train_run
from tests.support.workers import version

PARAMS = SamplingParams(max_new_tokens=6)
PROMPTS = ["12+34=", "07+35=", "99+01=", "50+50="] * 16


class Producer(threading.Thread):
    """Rollout generation: one request after another, each inside ``gate.submission()``."""

    def __init__(self, engine: HFEngine, gate: ProducerGate) -> None:
        super().__init__(daemon=True)
        self.engine, self.gate = engine, gate
        self.stop = threading.Event()
        self.spans: list[tuple[float, float, int, set[str | None]]] = []  # start, end, n, versions

    def run(self) -> None:
        while not self.stop.is_set():
            with self.gate.submission():
                start = time.monotonic()
                out = self.engine.generate(PROMPTS, PARAMS)
                self.spans.append((start, time.monotonic(), len(out), {g.weight_version for g in out}))


@pytest.fixture
def engine(tiny_snapshot: Path):
    eng = HFEngine(device="cpu")
    eng.load(str(tiny_snapshot), "0")
    yield eng
    eng.close()


def test_pause_blocks_new_submissions_and_lets_in_flight_ones_finish(engine: HFEngine) -> None:
    gate = ProducerGate()
    producer = Producer(engine, gate)
    producer.start()
    while gate.in_flight == 0:  # catch the producer mid-request
        time.sleep(0.001)
    requested = time.monotonic()
    with gate.paused():
        held = time.monotonic()
        assert gate.in_flight == 0
        n_at_pause = len(producer.spans)
        time.sleep(0.5)
        assert len(producer.spans) == n_at_pause  # nothing started or finished while held
        released = time.monotonic()
    time.sleep(0.3)
    producer.stop.set()
    producer.join(10)
    spans = producer.spans
    assert all(n == len(PROMPTS) for _, _, n, _ in spans)  # every request completed, none aborted
    in_flight = [s for s in spans if s[0] < requested < s[1]]
    assert len(in_flight) == 1 and in_flight[0][1] <= held  # the pause waited for it
    assert not [s for s in spans if held <= s[0] < released]  # no submission started during the pause
    assert any(s[0] >= released for s in spans)  # producers resumed
    assert gate.pauses == 1


def test_submission_inside_own_pause_is_refused_not_deadlocked() -> None:
    gate = ProducerGate()
    with gate.paused(), pytest.raises(RuntimeError, match="deadlock"), gate.submission():
        pass


def test_shared_eval_pins_and_scores_every_unit_while_producers_wait(tmp_path: Path, engine: HFEngine,
                                                                     snapshot_factory) -> None:
    run, _ = make_train_run(tmp_path / "run")
    gate = ProducerGate()
    producer = Producer(engine, gate)
    producer.start()
    results = shared_eval(engine, gate, run, 5, snapshot_factory(seed=1))
    producer.stop.set()
    producer.join(10)
    assert [r.status for r in results] == ["ok", "ok"]
    assert all(v == version(run, 5) for r in results for v in r.weight_versions)
    assert all(r.attest["how"] == "none" and "no readable .complete marker" in r.attest["detail"]
               for r in results)  # a bare model dir: nothing to attest against (#19)
    index = ResultIndex(run.results)
    point = derive_point(run.manifest(), 5, index.refresh())
    assert point.complete and point.datasets["addition"].weight_version_mean == 5.0
    assert point.datasets["addition"].mixed_version_ratio == 0.0
    # producers never saw a half-loaded engine: each request is all-old or all-new
    assert all(len(versions) == 1 for *_, versions in producer.spans)


class ReloadedDuringEval:
    """A real engine that someone else reloads in the middle of the eval (what the pin check catches)."""

    def __init__(self, inner: HFEngine, other: Path) -> None:
        self.inner, self.other = inner, other

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def generate(self, prompts: list[str], params: SamplingParams):
        out = self.inner.generate(prompts, params)
        if self.inner.weight_version() != "999":
            self.inner.load(str(self.other), "999")
        return out


def test_version_change_during_eval_is_pin_violation_for_every_unit(tmp_path: Path, engine: HFEngine,
                                                                      snapshot_factory) -> None:
    run, _ = make_train_run(tmp_path / "run")
    rogue = ReloadedDuringEval(engine, snapshot_factory(seed=2))
    results = shared_eval(rogue, ProducerGate(), run, 5, snapshot_factory(seed=1))  # type: ignore[arg-type]
    assert {r.skip_reason for r in results} == {"pin_violation"} and len(results) == 2
    assert "after='999'" in results[0].message


def test_dispatcher_shared_posture_evaluates_at_the_dispatch_step(tmp_path: Path) -> None:
    run, dispatch = make_train_run(tmp_path / "run", eval_interval=2)
    engine = HFEngine(device="cpu")
    gate = ProducerGate()
    d = EvalDispatcher.open(dispatch.with_waits(poll_interval_s=0.0), run, MetricsSink(run.metrics_path), run.base,
                       shared=SharedEval(engine, gate))
    model = build_model(ModelConfig(), "llama")
    for step in range(1, 5):
        d.maybe_dispatch(step, model)
        assert d.pending == []  # blocking: every point landed before training went on
    d.close(4, model)
    engine.close()
    points = {r["eval/step"]: r for r in eval_lines(run.path)}
    assert sorted(points) == [2, 4]
    for step, p in points.items():
        assert p["eval/lag_steps"] == 0 and p["eval/addition/weight_version/mean"] == step
        assert p["eval/addition/weight_version/mixed_version_ratio"] == 0
        assert p["eval/shared_eval_seconds"] > 0
        assert p["eval/addition/attested"] == 1.0  # the exported snapshot's digests matched (#19)
    assert gate.pauses == 2


def test_paused_gives_up_when_in_flight_work_does_not_finish() -> None:
    gate = ProducerGate()
    entered, release = threading.Event(), threading.Event()

    def stuck_producer() -> None:
        with gate.submission():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=stuck_producer)
    thread.start()
    entered.wait(5)
    with pytest.raises(TimeoutError), gate.paused(drain_timeout_s=0.2):
        pass
    assert not gate.is_paused  # reopened: producers are not left blocked
    release.set()
    thread.join(5)
