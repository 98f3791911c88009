"""Chat prompts rendered once for every engine, and per-sample seeds.

Real parts throughout: the tiny Llama snapshot published with a chat template, ``ckpteval serve`` as a
real subprocess behind a real recording HTTP proxy (so the test sees the exact bytes the http engine
sends), the in-process hf engine, the fn backend's input.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.results.files import ResultIndex, ok_result, write_result
from ckpteval.coord.results.points import derive_point, point_metrics
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
from ckpteval.coord.snapshots.snapshot import publish_snapshot
from ckpteval.coord.work.units import units_for_step
from ckpteval.jobs.eval.engines.base import SamplingParams
from ckpteval.jobs.eval.engines.factory import EnginePool
from ckpteval.jobs.eval.engines.fn import build_input
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.engines.http.engine import HTTPEngine
from ckpteval.jobs.eval.kinds.generate.evalsets import write_jsonl
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache, sample_seed, score_unit, unit_input
from ckpteval.jobs.eval.worker.evaluators import EngineEvaluator, evaluate_unit
from ckpteval.jobs.reference.model import (
    build_model,
    make_addition_examples,
    save_base_model_dir,
    save_tokenizer,
)
from ckpteval.jobs.trainer.export.hf_files import write_hf_files
from tests.support.workers import start_serve

CHAT_ROWS = [
    {"messages": [{"role": "user", "content": "07+35="}], "answer": "042"},
    {"messages": [{"role": "system", "content": "9"}, {"role": "user", "content": "11+11="}], "answer": "022"},
    {"prompt": "20+30=", "answer": "050"},
    {"messages": [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"},
                  {"role": "user", "content": "40+02="}], "answer": "042"},
]


def publish(root: Path, base: Path, step: int) -> Path:
    return publish_snapshot(root, step, lambda d: write_hf_files(d, build_model(seed=step).state_dict(), base))


def chat_run(tmp: Path, chat_template: bool) -> tuple[RunDir, RunManifest, Path]:
    """A run with one chat dataset and one published snapshot (step 3) with or without a chat template."""
    base = save_base_model_dir(tmp / "base")
    save_tokenizer(base, chat=chat_template)
    spec = GenerateEntry("chat", "data/chat.jsonl", n_prompts=len(CHAT_ROWS), shard_size=2, max_new_tokens=4,
                       prompt_format="chat", system_prompt="1")
    manifest = RunManifest(run_id="chat", eval=EvalSpec(entries=(spec,)),
                           snapshot_roots=(str(tmp / "run" / "snapshots"),), lease=LeaseSettings(30.0, 5.0))
    run = RunDir.create(tmp / "run", manifest)
    write_jsonl(run.data / "chat.jsonl", CHAT_ROWS)
    return run, manifest, publish(run.snapshots, base, 3)


class RecordingHF(HFEngine):
    """The real hf engine, remembering the prompt text it was asked to generate from."""

    def __init__(self) -> None:
        super().__init__(device="cpu")
        self.seen: list[str] = []

    def generate(self, prompts: list[str], params: SamplingParams, seeds: list[int] | None = None) -> list:
        self.seen.extend(prompts)
        return super().generate(prompts, params, seeds)


class Proxy:
    """A real HTTP proxy in front of ``ckpteval serve`` that records every /generate body it forwards."""

    def __init__(self, upstream: str) -> None:
        self.bodies: list[dict] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self, method: str) -> None:
                data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/generate":
                    proxy.bodies.append(json.loads(data))
                reply = httpx.request(method, upstream + self.path, content=data or None,
                                      headers={"Content-Type": "application/json"}, timeout=60)
                self.send_response(reply.status_code)
                self.send_header("Content-Length", str(len(reply.content)))
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(reply.content)

            def do_GET(self) -> None:
                self._forward("GET")

            def do_POST(self) -> None:
                self._forward("POST")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def chat(tmp_path: Path) -> Iterator[tuple[RunDir, RunManifest, Path]]:
    yield chat_run(tmp_path, chat_template=True)


def test_chat_rendering_is_identical_across_engines(chat: tuple[RunDir, RunManifest, Path], tmp_path: Path) -> None:
    """The http engine sends exactly the text the hf engine generates from, for every row of a chat set;
    the fn backend gets the same text; and it is the snapshot tokenizer's own template rendering."""
    run, manifest, snapshot = chat
    cache = DatasetCache(run, manifest)
    units = units_for_step(manifest, 3)
    hf = RecordingHF()
    hf.load(str(snapshot), "3")
    hf_scores = [score_unit(hf, cache, u, str(snapshot)) for u in units]

    url, server = start_serve(snapshot, "3", tmp_path / "serve.log")
    proxy = Proxy(url)
    try:
        with HTTPEngine(proxy.url) as http:
            http_scores = [score_unit(http, cache, u, str(snapshot)) for u in units]
    finally:
        proxy.close()
        server.terminate()
        server.wait(30)
    sent = [text for body in proxy.bodies for text in body["text"]]
    assert sent == hf.seen and len(sent) == len(CHAT_ROWS)
    assert [c for s in http_scores for c in s.completions] == [c for s in hf_scores for c in s.completions]

    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    expected = []
    for row in CHAT_ROWS:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        if messages[0]["role"] != "system":
            messages = [{"role": "system", "content": "1"}, *messages]
        expected.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert sent == expected
    assert sent[0] == "=1\n+07+35=\n " and sent[1].startswith("=9\n")  # the row's own system turn wins

    spec = manifest.entry("chat")
    fn_prompts = []
    for u in units:
        work = unit_input(cache, u, str(snapshot))
        rows = [cache.rows(spec)[i] for i in work.prompt_indices]
        fn_prompts += build_input(manifest, spec, u, rows, work.prompts[:: spec.n_samples], work.seeds)["prompts"]
    assert fn_prompts == sent


def test_chat_dataset_on_a_snapshot_without_chat_template_is_a_no_chat_template_skip(tmp_path: Path) -> None:
    run, manifest, _ = chat_run(tmp_path, chat_template=False)
    (ref,) = SnapshotDiscovery(run.snapshots).poll()
    engine = HFEngine()
    try:
        evaluator = EngineEvaluator(engine, DatasetCache(run, manifest), pin_timeout_s=5, load_timeout_s=60)
        result = evaluate_unit(evaluator, units_for_step(manifest, 3)[0], ref, "fast")
    finally:
        engine.close()
    assert result.skip_reason == "no_chat_template", result.message
    assert "no chat template" in result.message


def test_sample_seed_is_stable_31_bit_and_distinct() -> None:
    seeds = {sample_seed(0, i, j) for i in range(50) for j in range(8)}
    assert len(seeds) == 400 and all(0 <= s < 2**31 for s in seeds)
    assert sample_seed(7, 3, 1) == sample_seed(7, 3, 1) != sample_seed(8, 3, 1)


def test_distinct_seeds_give_distinct_samples_and_an_identical_rerun(tiny_snapshot: Path) -> None:
    """Eight copies of one prompt at temperature > 0 draw eight different samples, the same eight again
    on a rerun, and each the same whatever else is in its batch (and through a pool of engines)."""
    prompts = ["07+35="] * 8
    seeds = [sample_seed(0, 0, j) for j in range(8)]
    params = SamplingParams(max_new_tokens=8, temperature=1.5)
    engine, other = HFEngine(), HFEngine()
    engine.load(str(tiny_snapshot), "1")
    other.load(str(tiny_snapshot), "1")
    try:
        first = [g.text for g in engine.generate(prompts, params, seeds=seeds)]
        assert len(set(first)) == 8, first
        assert [g.text for g in engine.generate(prompts, params, seeds=seeds)] == first
        # the same (prompt, seed) pairs in another batch order, between other prompts
        mates = [ex["prompt"] for ex in make_addition_examples(8, seed=5)]
        mixed = [g.text for g in engine.generate(mates + prompts[::-1], params, seeds=list(range(8)) + seeds[::-1])]
        assert mixed[8:][::-1] == first
        pooled = EnginePool([engine, other]).generate(prompts, params, seeds=seeds)
        assert [g.text for g in pooled] == first
        # one shared seed for the whole call (params.seed, no per-sample seeds): reproducible, not per sample
        shared = replace(params, seed=0)
        assert engine.generate(prompts, shared) == engine.generate(prompts, shared)
    finally:
        engine.close()
        other.close()


def test_sharding_leaves_samples_and_every_metric_unchanged(tmp_path: Path, tiny_snapshot: Path) -> None:
    """The same sampled dataset (4 samples per prompt, pass@k, maj@n) scored in 1 shard and in 3: every
    sample gets the same seed, so every per-sample score and every derived metric is the same."""
    rows = make_addition_examples(6, seed=9)
    engine = HFEngine()
    engine.load(str(tiny_snapshot), "2")
    metrics = []
    try:
        for shard_size in (6, 2):
            spec = GenerateEntry("s", "data/s.jsonl", n_prompts=6, shard_size=shard_size, n_samples=4,
                               temperature=1.5, max_new_tokens=3, pass_k=(1, 4),
                               scorer="tests.support.workers:digit_overlap")
            manifest = RunManifest(run_id="s", eval=EvalSpec(entries=(spec,)), lease=LeaseSettings(30.0, 5.0),
                                   snapshot_roots=(str(tmp_path / f"r{shard_size}" / "snapshots"),))
            run = RunDir.create(tmp_path / f"r{shard_size}", manifest)
            write_jsonl(run.data / "s.jsonl", rows)
            cache = DatasetCache(run, manifest)
            for unit in units_for_step(manifest, 2):
                s = score_unit(engine, cache, unit, str(tiny_snapshot))
                answers = [c.strip() for c in s.completions]
                write_result(run.results, ok_result(unit, s.scores, s.weight_versions, answers))
            metrics.append(point_metrics(derive_point(manifest, 2, ResultIndex(run.results).refresh())))
    finally:
        engine.close()
    assert metrics[0] == metrics[1]
    assert {"eval/s/pass@1", "eval/s/pass@4", "eval/s/maj@4", "eval/s/stderr"} <= set(metrics[0])
