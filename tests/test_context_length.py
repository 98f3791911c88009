"""A prompt longer than the model's context: one rule, one outcome on every engine path.

Real parts: the tiny reference model (64 positions) published as a real snapshot; ``ckpteval worker
--engine hf`` in-process weights vs ``ckpteval worker --engine http:URL`` against a real ``ckpteval
serve`` process on the same snapshot and the same run config. Both skip the unit ``rejected`` with
sglang's message (the serve path through HTTP 400), never score a prompt run past the position table.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.engines.base import RequestRejected, SamplingParams, context_problem
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.lifecycle import EXIT_DONE
from tests.support.workers import finish, make_eval_run, publish_model, results, spawn, start_serve, version

LONG = "12+34=" * 12  # 72 characters: 72+ tokens, over the tiny model's 64 positions
CONTEXT_MESSAGE = "is longer than the model's context length (64 tokens)"


def _long_prompt_run(tmp: Path, name: str):
    run = make_eval_run(tmp, n_prompts=2, shard_size=2, name=name)
    rows = [{"prompt": LONG, "answer": "46"}, {"prompt": "1+1=", "answer": "2"}]
    (run.data / "addition.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_context_rule_matches_sglangs_two_cases() -> None:
    assert context_problem(10, 4, 64) is None and context_problem(60, 4, 64) is None
    assert "The input (64 tokens) is longer than the model's context length (64 tokens)." == context_problem(64, 1, 64)
    assert "maximum context length of 64 tokens" in context_problem(61, 4, 64)
    assert context_problem(10_000, 4, None) is None  # a model that states no context


def test_hf_engine_refuses_what_does_not_fit(tmp_path: Path) -> None:
    snapshot = publish_model(tmp_path, tmp_path / "snaps", 1)
    engine = HFEngine()
    try:
        engine.load(str(snapshot), "1")
        with pytest.raises(RequestRejected, match=r"The input \(\d+ tokens\) " + CONTEXT_MESSAGE.replace("(", r"\(")
                           .replace(")", r"\)")):
            engine.generate([LONG, "1+1="], SamplingParams(max_new_tokens=4))
        with pytest.raises(RequestRejected, match="maximum context length of 64 tokens"):
            engine.generate(["1+1="], SamplingParams(max_new_tokens=62))
        (fits,) = engine.generate(["1+1="], SamplingParams(max_new_tokens=4))
        assert fits.weight_version == "1"
    finally:
        engine.close()


def test_one_config_one_snapshot_one_outcome_on_hf_and_through_serve(tmp_path: Path) -> None:
    """The same run config and snapshot: ``--engine hf`` and ``--engine http:`` (``ckpteval serve``) both
    skip the unit ``rejected`` with the same sglang message."""
    hf_run = _long_prompt_run(tmp_path, "hf")
    http_run = _long_prompt_run(tmp_path, "http")
    publish_model(tmp_path, hf_run.snapshots, 1)
    snapshot = publish_model(tmp_path, http_run.snapshots, 1)
    code, out = finish(spawn("worker", "--run-dir", str(hf_run.path), "--engine", "hf", "--once",
                             "--poll-interval", "0.1"), 120)
    assert code == EXIT_DONE, out
    url, serve = start_serve(snapshot, version(http_run, 1), tmp_path / "serve.log")
    try:
        code, out = finish(spawn("worker", "--run-dir", str(http_run.path), "--engine", f"http:{url}", "--once",
                                 "--poll-interval", "0.1"), 120)
    finally:
        serve.terminate()
        serve.communicate(timeout=30)
    assert code == EXIT_DONE, out
    unit = WorkUnit(1, "addition", 0)
    hf, http = results(hf_run)[unit], results(http_run)[unit]
    assert (hf.skip_reason, http.skip_reason) == ("rejected", "rejected"), (hf.message, http.message)
    for r in (hf, http):
        assert CONTEXT_MESSAGE in r.message, r.message
    sglang_words = hf.message.split(" (the hf engine")[0]
    assert sglang_words in http.message, (hf.message, http.message)
