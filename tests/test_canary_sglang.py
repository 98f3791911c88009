"""The canary on the sglang engine (#19 §2): teacher-forced input-token log-probs over ``/generate``.

Real parts: snapshots of the reference trainer's tiny model exported with their canary by the exporter,
the real tokenizer, and the sglang stand-in (``ckpteval serve``'s :class:`EngineHTTPServer` and
:class:`EngineService` over a real :class:`HFEngine`) listening on a real socket, in this process (a
subprocess would add seconds of imports per test). :class:`SGLangEngine` is attached to it by URL, as
the worker attaches to a running sglang. Real sglang needs a GPU; the stand-in answers ``return_logprob``
the way sglang 0.5.23 does (cited in ``jobs/eval/engines/sglang/logprobs.py``).
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from tokenizers import processors
from transformers import AutoModelForCausalLM, AutoTokenizer

from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.engines.base import SamplingParams
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.engines.http.engine import HTTPEngine
from ckpteval.jobs.eval.engines.sglang.engine import SGLangEngine
from ckpteval.jobs.eval.kinds.generate.evalsets import load_dataset
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
from ckpteval.jobs.eval.proof.canary import CANARY_MAX_DIFF_SAME_DTYPE, canary_bytes, probe_rows
from ckpteval.jobs.eval.worker.evaluators import EngineEvaluator, evaluate_unit
from ckpteval.jobs.reference.model import build_model
from ckpteval.jobs.reference.serve.engine import EngineService
from ckpteval.jobs.reference.serve.http import EngineHTTPServer
from ckpteval.jobs.trainer.export.async_export import AsyncExporter
from tests.support.workers import base_dir, make_eval_run, version


def _export(run: Any, base: Path, step: int) -> Path:  # noqa: ANN401
    """Export ``step`` of the tiny model with ``base``'s tokenizer and a canary computed with it."""
    model = build_model(seed=step)
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    pairs = probe_rows(load_dataset(run, run.manifest().eval.entries[0]))
    exporter = AsyncExporter(run.snapshots, base, run=None)
    exporter.submit(step, model, canary=canary_bytes(model, tokenizer, pairs))
    exporter.wait()
    (outcome,) = exporter.poll()
    assert outcome.ok, outcome.error
    return outcome.path


def _base_without_bos(tmp_path: Path) -> Path:
    """A copy of the base model dir whose tokenizer no longer adds ``<bos>`` (the trainer changed it)."""
    base = shutil.copytree(base_dir(tmp_path), tmp_path / "base-no-bos")
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A", special_tokens=[])
    tokenizer.save_pretrained(base)
    return base


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Any, str, EngineService]]:
    """A run with steps 1 (the base tokenizer) and 2 (a tokenizer without ``<bos>``); the stand-in
    launched on step 1."""
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4, max_new_tokens=2)
    first = _export(run, base_dir(tmp_path), 1)
    _export(run, _base_without_bos(tmp_path), 2)
    engine = HFEngine(dtype="float32")
    engine.load(str(first), version(run, 1))
    server = EngineHTTPServer(("127.0.0.1", 0), EngineService(engine, str(first)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield run, f"http://127.0.0.1:{server.server_address[1]}", server.service
    finally:
        server.shutdown()
        server.server_close()
        engine.close()


def test_the_stand_in_returns_input_token_logprobs_as_sglang_does(served: tuple[Any, str, EngineService]) -> None:
    run, url, _ = served
    (ref, _) = sorted(SnapshotDiscovery(run.snapshots).poll(), key=lambda r: r.step)
    text = "12+34="
    body = {"text": [text], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 2, "top_logprobs_num": 2}
    (item,) = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    ids = AutoTokenizer.from_pretrained(ref.path, local_files_only=True)(text)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(ref.path, local_files_only=True).eval()
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    meta = item["meta_info"]
    tokens, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert [t[1] for t in tokens] == ids[2:] and tokens[0][0] is None and tops[0] is None
    for i, (lp, token, text_) in enumerate(tokens[1:], start=3):
        assert token == ids[i] and text_ is None and abs(lp - float(want[i - 1, ids[i]])) < 1e-5
        assert [t[1] for t in tops[i - 2]] == want[i - 1].topk(2).indices.tolist()
    assert meta["output_token_logprobs"] == [] and meta["prompt_tokens"] == len(ids)
    # what the stand-in cannot do, or sglang refuses, is a 400 naming it
    too_far = httpx.post(f"{url}/generate", json=body | {"logprob_start_len": len(ids) + 1}, timeout=60)
    assert too_far.status_code == 400 and "higher than the number of input tokens" in too_far.text
    decoding = httpx.post(f"{url}/generate", json=body | {"sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert decoding.status_code == 400 and "prefill-only" in decoding.text


def _evaluate(run: Any, url: str, step: int, kind: type[HTTPEngine] = SGLangEngine,  # noqa: ANN401
              bound: float | None = None) -> Any:
    refs = {r.step: r for r in SnapshotDiscovery(run.snapshots).poll()}
    engine = SGLangEngine(url=url) if kind is SGLangEngine else kind(url)
    try:
        evaluator = EngineEvaluator(engine, DatasetCache(run, run.manifest()), 5.0, 120.0, bound)
        return evaluate_unit(evaluator, WorkUnit(step, "addition", 0), refs[step], "fast")
    finally:
        engine.close()


def test_an_honest_sglang_engine_passes_the_canary_and_a_tokenizer_changed_after_launch_fails_it(
    served: tuple[Any, str, EngineService],
) -> None:
    """sglang keeps the tokenizer it was launched with across ``update_weights_from_disk`` (cited in
    docs/PROTOCOL.md "The canary"): a step whose tokenizer changed is loaded in place, attested, and then
    scored by the launch tokenizer. The canary (not attestation: the weights are right) catches it."""
    run, url, _ = served
    honest = _evaluate(run, url, 1)  # the tokenizer the server was launched with: the trainer's
    assert honest.ok, honest.message
    assert honest.fidelity["tokens"] > 0 and honest.fidelity["max_abs_logprob_diff"] <= CANARY_MAX_DIFF_SAME_DTYPE
    assert honest.fidelity["argmax_agreement"] == 1.0
    changed = _evaluate(run, url, 2)  # in-place load of step 2; the server still adds <bos>
    assert changed.skip_reason == "canary_failed", changed.message
    assert "max |Δ log-prob| inf" in changed.message
    info = httpx.get(f"{url}/model_info", timeout=30).json()
    assert info["weight_version"] == version(run, 2) and info["tokenizer_path"] != info["model_path"]


def test_a_plain_http_engine_runs_the_canary_too(served: tuple[Any, str, EngineService]) -> None:
    """``--engine http:URL`` speaks the same sglang API as the launching engine, so the canary is not
    absent behind it: an honest step passes with the stand-in's log-probs, a tokenizer changed after launch
    fails it."""
    run, url, _ = served
    honest, changed = _evaluate(run, url, 1, HTTPEngine), _evaluate(run, url, 2, HTTPEngine)
    assert honest.ok and honest.fidelity["tokens"] > 0, honest.message
    assert honest.fidelity["max_abs_logprob_diff"] <= CANARY_MAX_DIFF_SAME_DTYPE
    assert changed.skip_reason == "canary_failed" and "max |Δ log-prob| inf" in changed.message


def test_a_server_that_refuses_to_score_prompts_reports_the_canary_absent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A server speaking sglang's API that answers ``return_logprob`` with a 400 (a stand-in from before
    this feature; a small stdlib server here, since the real stand-in now answers it): the canary is
    absent for it (None, one line on stderr), not failed and not an engine error."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from ckpteval.coord.snapshots.snapshot import read_marker
    from ckpteval.jobs.eval.proof.canary_check import check_canary

    class Refusing(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._reply(200, {"version": "0.5.23"})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self._reply(400, {"error": {"message": "ckpteval serve does not implement ['return_logprob']"}})

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4, max_new_tokens=2)
    path = _export(run, base_dir(tmp_path), 1)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine = SGLangEngine(url=f"http://127.0.0.1:{server.server_address[1]}")
    try:
        assert check_canary(engine, path, read_marker(path), None) is None
        assert "no canary from this engine" in capsys.readouterr().err
    finally:
        engine.close()
        server.shutdown()
        server.server_close()


BOUND = 2.0**-4  # a binary fraction: offsets of 2**-5, 2**-4, 2**-3 are added to the log-probs exactly


@pytest.mark.parametrize(("offset", "outcome"), [(2.0**-5, "passed"), (BOUND, "passed"), (2.0**-3, "canary_failed")])
def test_the_bound_is_exercised_below_at_and_above_it(
    served: tuple[Any, str, EngineService], offset: float, outcome: str
) -> None:
    """The stand-in's ``logprob_offset`` makes its log-probs differ from the trainer's by a set amount (the
    trainer's own function otherwise gives 0 by construction): an explicit bound passes a difference at or
    below it and skips one above it."""
    run, url, service = served
    service.logprob_offset = offset
    result = _evaluate(run, url, 1, bound=BOUND)
    assert (result.skip_reason or "passed") == outcome, result.message
    if result.ok:
        assert result.fidelity["max_abs_logprob_diff"] == offset and result.fidelity["flagged"] == 0.0
        assert result.fidelity["bound"] == BOUND and result.fidelity["bound_unmeasured"] == 0.0


def test_an_unmeasured_engine_kind_is_flagged_not_skipped(
    served: tuple[Any, str, EngineService], capsys: pytest.CaptureFixture[str]
) -> None:
    """sglang's kernels were never measured against the trainer (no GPU): over the provisional default the
    unit is scored, flagged, and the result says the bound is unmeasured; a tokenizer change still fails."""
    run, url, service = served
    service.logprob_offset = 0.5  # ten times the provisional 0.05
    result = _evaluate(run, url, 1)
    assert result.ok, result.message
    assert result.fidelity["flagged"] == 1.0 and result.fidelity["bound_unmeasured"] == 1.0
    assert result.fidelity["max_abs_logprob_diff"] == pytest.approx(0.5)
    assert "bound for this engine kind is unmeasured" in capsys.readouterr().err
    assert _evaluate(run, url, 2).skip_reason == "canary_failed"  # ids differ: inf, whatever the bound


def test_ids_are_compared_modulo_sglangs_clip_of_the_last_vocabulary_id(served: tuple[Any, str, EngineService]) -> None:
    """sglang reports input ids >= vocab_size - 1 as 0 (logprob_result_processor.py): the stand-in does, and
    the canary compares ids modulo that clip when the trainer stored its vocab_size."""
    from ckpteval.jobs.eval.proof.canary import compare

    run, url, service = served
    vocab = service.engine.model.config.vocab_size
    body = {"input_ids": [[1, 5, vocab - 1, 7]], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 1}
    (item,) = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    assert [t[1] for t in item["meta_info"]["input_token_logprobs"]] == [1, 5, 0, 7]
    probe = {"ids": [1, 5, vocab - 1, 7], "start": 2, "logprobs": [-1.0, -2.0], "argmax": [3, 4]}
    got = probe | {"ids": [1, 5, 0, 7], "logprobs": [-1.0, -2.5]}
    assert compare({"probes": [probe], "vocab_size": vocab}, [got]).max_abs_logprob_diff == 0.5
    assert compare({"probes": [probe]}, [got]).max_abs_logprob_diff == float("inf")  # no vocab_size stored
    wrong = got | {"ids": [1, 6, 0, 7]}
    assert compare({"probes": [probe], "vocab_size": vocab}, [wrong]).max_abs_logprob_diff == float("inf")


def _canary_pairs(run: Any) -> list[tuple[str, str]]:  # noqa: ANN401
    return probe_rows(load_dataset(run, run.manifest().eval.entries[0]))


def test_the_canary_fits_the_servers_queue(served: tuple[Any, str, EngineService]) -> None:
    """The stand-in sheds a request whose prompts exceed ``--max-queued-requests`` (503 'The request queue is
    full.', as sglang 0.5.23): with 4 queued prompts allowed, the canary's 8 texts go 2 per request (half the
    queue, :func:`queue_chunk`), none is shed, and the records equal one unlimited request's. Before: one
    request of 8 texts, shed on every retry (``overloaded``)."""
    run, url, service = served
    pairs = _canary_pairs(run)
    assert len(pairs) == 4
    with HTTPEngine(url) as engine:
        whole = engine.teacher_forced(pairs)
    service.max_queued = 4
    with HTTPEngine(url, busy_retries=1, busy_retry_delay=0.01) as engine:
        assert engine.teacher_forced(pairs) == whole
    assert service.shed == 0


def test_a_waiting_timeout_halves_the_canarys_and_a_generates_chunk(served: tuple[Any, str, EngineService]) -> None:
    """A real HTTP server in front of the stand-in answers a ``/generate`` of more than 2 texts as sglang
    0.5.23 does when they waited past ``SGLANG_REQ_WAITING_TIMEOUT`` (503 'Request waiting timeout
    reached.', scheduler.py ``_poll_timeout_aborts``): the canary and a generate halve their requests until
    they pass, and get what an unrefused request gets. Before: ``ServerBusy`` on the first request."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    run, url, _ = served
    sizes: list[int] = []

    class Front(BaseHTTPRequestHandler):
        def _forward(self, method: str) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            texts = json.loads(body).get("text") if body and self.path == "/generate" else None
            if isinstance(texts, list):
                sizes.append(len(texts))
            if isinstance(texts, list) and len(texts) > 2:
                status, payload = 503, json.dumps({"object": "error", "message": "Request waiting timeout reached.",
                                                   "type": "Service Unavailable", "code": 503}).encode()
            else:
                reply = httpx.request(method, url + self.path, content=body or None, timeout=60)
                status, payload = reply.status_code, reply.content
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self) -> None:  # noqa: N802
            self._forward("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._forward("POST")

        def log_message(self, *args: Any) -> None:  # noqa: ANN401
            pass

    front = ThreadingHTTPServer(("127.0.0.1", 0), Front)
    threading.Thread(target=front.serve_forever, daemon=True).start()
    pairs = _canary_pairs(run)
    prompts = [p for p, _ in pairs]
    greedy = SamplingParams(max_new_tokens=3, temperature=0.0)
    try:
        with HTTPEngine(url) as direct:
            want, want_generated = direct.teacher_forced(pairs), direct.generate(prompts, greedy)
        with HTTPEngine(f"http://127.0.0.1:{front.server_address[1]}", busy_retries=1,
                        busy_retry_delay=0.01) as engine:
            assert engine.teacher_forced(pairs) == want
            assert sizes == [8, 8, 4, 4, 2, 2, 2, 2]  # each refusal tried twice (busy_retries=1), then halved
            sizes.clear()
            assert [s.text for s in engine.generate(prompts, greedy)] == [s.text for s in want_generated]
            assert sizes == [4, 4, 2, 2]
    finally:
        front.shutdown()
        front.server_close()
