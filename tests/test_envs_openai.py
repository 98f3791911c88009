"""The pinned engine's OpenAI-compatible endpoint (jobs/eval/kinds/env/endpoint.py) and the verifiers adapter.

What is real: the engines (the in-process hf engine on the reference trainer's tiny model; the real
:class:`ckpteval.jobs.eval.engines.http.engine.HTTPEngine` against :class:`tests.support.canned_engine.ScriptedEngine`, a
real stdlib HTTP server replying by a scripted policy, where a reply must be a chosen text), the
endpoint's real HTTP server on loopback, and the real ``openai`` client talking to it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from ckpteval.coord.entries.env import EnvEntry
from ckpteval.coord.snapshots.snapshot import publish_snapshot
from ckpteval.jobs.eval.engines.base import SamplingParams
from ckpteval.jobs.eval.engines.factory import make_engine
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.kinds.env.endpoint import Endpoint, reply_version
from ckpteval.jobs.eval.kinds.env.runner import Renderer, render_transcript
from ckpteval.jobs.eval.proof.pinning import PinViolation, pin
from ckpteval.jobs.eval.scorers import ScorerInfraError
from tests.support.canned_engine import ScriptedEngine
from tests.support.runs import write_tiny_shards
from tests.support.workers import publish_model, version

openai = pytest.importorskip("openai", reason="the openai client is in the test extra ('.[test]')")

SPEC = EnvEntry(name="chat", path="data/chat.jsonl", n_prompts=1, env="arithmetic", max_new_tokens=8, max_turns=3)
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "evaluate",
                                            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


def snapshot(tmp: Path, model: bool = False) -> str:
    """Step 1's snapshot: the tiny model (``model``) or plain shards (an HTTP engine never reads them)."""
    if model:
        return str(publish_model(tmp, tmp / "snapshots", 1))
    return str(publish_snapshot(tmp / "snapshots", 1, lambda d: write_tiny_shards(d)))


def client(endpoint: Endpoint, row: int = 0, sample: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=endpoint.base_url(row, sample), api_key="unused", max_retries=0, timeout=60)


def test_the_hf_engines_loopback_endpoint_stamps_every_turn_and_refuses_one_from_other_weights(tmp_path: Path) -> None:
    snap = snapshot(tmp_path, model=True)
    engine = HFEngine()
    try:
        pin(engine, snap, "1")
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        direct = engine.generate([render_transcript(messages, [])], SamplingParams(max_new_tokens=8))[0]
        with Endpoint(engine, "1", SPEC, Renderer(SPEC, snap)) as endpoint:
            reply = client(endpoint).chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
            assert reply_version(reply.model_dump()) == "1"
            assert reply.choices[0].message.content == direct.text  # the runner's rendering, the same generate
            endpoint.check()  # every turn so far pinned
            engine.load(snap, "someone-else@9")  # another writer reloads the engine between two turns
            with pytest.raises(openai.ConflictError, match="changed mid-episode.*someone-else@9"):
                client(endpoint).chat.completions.create(model="m", messages=messages)  # type: ignore[arg-type]
            assert endpoint.turns(0, 0).versions == ["1", "someone-else@9"]
            with pytest.raises(PinViolation, match="someone-else@9"):
                endpoint.check()
    finally:
        engine.close()


def test_tool_calls_come_back_as_openai_tool_calls_per_episode_and_a_malformed_one_as_text(tmp_path: Path) -> None:
    def policy(text: str, _engine: ScriptedEngine) -> str:
        if "malformed" in text:
            return "<tool_call>{calculator: 1}</tool_call>"
        if "tool: 4" in text:  # the tool's result, folded into the transcript: the model answers
            seen.append(text.count('"2+2"'))  # how often the transcript shows the call
            return "ANSWER: 4"
        return 'Let me add. <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'

    seen: list[int] = []
    snap = snapshot(tmp_path)
    with ScriptedEngine(policy) as url:
        engine = make_engine(f"http:{url}", "cpu", {})
        pin(engine, snap, "1")
        with Endpoint(engine, "1", SPEC, Renderer(SPEC, snap)) as endpoint:
            ask = [{"role": "user", "content": "What is 2 + 2?"}]
            first = client(endpoint, 3, 1).chat.completions.create(model="m", messages=ask, tools=TOOLS)  # type: ignore[arg-type]
            (call,) = first.choices[0].message.tool_calls or []
            assert first.choices[0].finish_reason == "tool_calls"
            assert (call.function.name, call.function.arguments) == ("calculator", '{"expression": "2+2"}')
            assert first.choices[0].message.content == "Let me add."  # the markup only in tool_calls, as sglang
            follow = [*ask, first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "4"}]
            second = client(endpoint, 3, 1).chat.completions.create(model="m", messages=follow, tools=TOOLS)  # type: ignore[arg-type]
            assert second.choices[0].message.content == "ANSWER: 4" and not second.choices[0].message.tool_calls
            assert seen == [1]  # the follow-up's transcript showed the call once (the policy answered it)
            bad = client(endpoint, 0, 0).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "malformed"}], tools=TOOLS)  # type: ignore[arg-type]
            assert bad.choices[0].message.content == "<tool_call>{calculator: 1}</tool_call>"
            assert not bad.choices[0].message.tool_calls
            assert endpoint.turns(3, 1).versions == ["1", "1"] and endpoint.turns(0, 0).versions == ["1"]
            endpoint.check()
        with pytest.raises(openai.APIConnectionError):  # closed with its context: nothing listens any more
            client(endpoint).chat.completions.create(model="m", messages=ask)  # type: ignore[arg-type]


# -- the verifiers adapter -----------------------------------------------------------------------------------
def vf_run(tmp: Path, tasks: list[int], **kw: Any) -> Any:
    pytest.importorskip("verifiers.v1", reason="verifiers is the optional extra ckpteval[envs] (also in '.[test]')")
    from tests.test_envs import env_run

    return env_run(tmp, [{"task": t} for t in tasks], env="verifiers",
                   env_options={"taskset": "tests.support.vf_arith", "timeout_s": 60.0}, **kw)


def answering(text: str, _engine: ScriptedEngine) -> str:
    """Right for every task but the second (tests.support.vf_arith's rows), read off the transcript."""
    m = re.search(r"What is ([0-9 *+()-]+)\?", text)
    if m is None:
        return "no idea"
    expression = m.group(1)
    value = eval(expression, {"__builtins__": {}})  # digits and + - * ( ) only: the regex above
    return "ANSWER: 0" if expression == vf_rows()[1]["expression"] else f"ANSWER: {value}"


def vf_rows() -> list[dict[str, Any]]:
    from tests.support.vf_arith import ROWS

    return ROWS


def test_a_verifiers_taskset_runs_on_the_pinned_engine_with_its_rewards_and_every_turn_stamped(tmp_path: Path) -> None:
    from tests.test_envs import evaluate

    run = vf_run(tmp_path, [0, 1, 2])
    with ScriptedEngine(answering) as url:
        out = evaluate(run, url)
    episodes = out.scored["episodes"]
    assert [e["reward"] for e in episodes] == [1.0, 0.0, 1.0]  # verifiers' own reward function scored them
    assert {(e["ended"], e["blame"], e["turns"]) for e in episodes} == {("done", "model", 1)}
    assert [e["versions"] for e in episodes] == [[version(run, 1)]] * 3
    assert out.scored["scorer"]["env"] == "verifiers"


def test_a_verifiers_verifier_that_crashes_is_infra_retried_then_env_failed(tmp_path: Path) -> None:
    from tests.test_envs import evaluate

    run = vf_run(tmp_path, [3], infra_retries=1)
    scripted = ScriptedEngine(answering)
    with scripted as url, pytest.raises(ScorerInfraError, match="TaskError.*backend is down") as caught:
        evaluate(run, url)
    assert caught.value.reason == "env_failed"
    assert len(scripted.texts) == 2  # the episode was played again once (its reply was fine: the verifier broke)


def test_a_verifiers_episode_whose_engine_is_reloaded_mid_episode_is_a_pin_violation(tmp_path: Path) -> None:
    from tests.test_envs import evaluate

    def reloaded(text: str, engine: ScriptedEngine) -> str:
        engine.label = "other-run@7"  # someone else reloads the server before this turn is generated
        return answering(text, engine)

    run = vf_run(tmp_path, [0], infra_retries=0)
    with ScriptedEngine(reloaded) as url, pytest.raises(PinViolation, match="other-run@7"):
        evaluate(run, url)


def test_a_verifiers_entry_is_refused_at_worker_start_without_the_extra_or_with_rows_it_cannot_read() -> None:
    """Runs in both set-ups: without verifiers (only the core installed) the refusal names the extra; with
    it ('.[envs]', '.[test]'), a row must name a task by index."""
    import importlib.util

    from ckpteval.jobs.eval.kinds.env.verifiers_env import INSTALL, VerifiersEnv

    if importlib.util.find_spec("verifiers") is None:
        with pytest.raises(ValueError, match=re.escape(INSTALL)):
            VerifiersEnv.check_row({"task": 0}, "rows.jsonl: row 0")
        return
    VerifiersEnv.check_row({"task": 0}, "rows.jsonl: row 0")
    for bad in ({}, {"task": -1}, {"task": "0"}):
        with pytest.raises(ValueError, match="rows.jsonl: row 3: a verifiers row needs 'task'"):
            VerifiersEnv.check_row(bad, "rows.jsonl: row 3")


def test_an_engine_that_fails_during_a_verifiers_episode_fails_the_unit_not_the_episode(tmp_path: Path) -> None:
    """The scripted server drops the connection (its policy raises): the engine's error, not an infra episode."""
    from ckpteval.jobs.eval.engines.base import EngineError
    from tests.test_envs import evaluate

    def dying(_text: str, _engine: ScriptedEngine) -> str:
        raise RuntimeError("the GPU fell off the bus")

    run = vf_run(tmp_path, [0], infra_retries=0)
    with ScriptedEngine(dying) as url, pytest.raises(EngineError) as caught:
        evaluate(run, url)
    assert caught.value.reason == "unhealthy" and "/generate failed" in str(caught.value)  # the engine's, re-raised


def test_a_verifiers_episode_reads_the_answer_and_a_turn_that_never_stops_thinking_is_no_answer(tmp_path: Path) -> None:
    """``reasoning`` on a driven entry: the endpoint replies as sglang's reasoning parser does (``content``
    the answer, ``reasoning_content`` the thoughts; ``""`` when they never end), so verifiers' reward reads
    the answer only; an episode with a turn whose reasoning never ended is ``no_answer`` like the runner's."""
    from tests.test_envs import evaluate

    def thinking(text: str, engine: ScriptedEngine) -> str | tuple[str, str]:
        reply = answering(text, engine)  # right for tasks 0 and 2, "ANSWER: 0" for task 1
        right = next(f"ANSWER: {r['answer']}" for r in vf_rows() if f"What is {r['expression']}?" in text)
        if right.endswith(str(vf_rows()[2]["answer"])):
            return (f"<think>{right} " * 3, "length")
        return f"<think>{'ANSWER: 0' if reply == right else right}</think> {reply}"

    run = vf_run(tmp_path, [0, 1, 2], reasoning={"end": "</think>", "start": "<think>"})
    with ScriptedEngine(thinking) as url:
        out = evaluate(run, url)
    episodes = out.scored["episodes"]
    assert [e["reward"] for e in episodes] == [1.0, 0.0, 0.0]
    assert [e["ended"] for e in episodes] == ["done", "done", "no_answer"]
    assert out.scored["extras"]["no_answer"] == {"sum": 1.0, "n": 3} and out.scored["extras"]["truncated"]["sum"] == 1.0


def test_the_endpoint_replies_with_the_answer_as_content_and_the_thoughts_as_reasoning_content(tmp_path: Path) -> None:
    spec = EnvEntry(name="chat", path="data/chat.jsonl", n_prompts=1, env="arithmetic", max_new_tokens=8,
                   reasoning={"end": "</think>", "start": "<think>"})
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    replies = {"a": "<think>ANSWER: 5</think>ANSWER: 4", "b": f"<think>{call}</think>no call", "c": ("<think>4 4 4", "length")}

    def scripted(text: str, _engine: ScriptedEngine) -> str | tuple[str, str]:
        return replies[text.split("\n")[-2].removeprefix("user: ")]

    snap = snapshot(tmp_path)
    with ScriptedEngine(scripted) as url:
        engine = make_engine(f"http:{url}", "cpu", {})
        pin(engine, snap, "1")
        with Endpoint(engine, "1", spec, Renderer(spec, None)) as endpoint:
            got = {key: client(endpoint, i).chat.completions.create(
                       model="m", messages=[{"role": "user", "content": key}], tools=TOOLS).choices[0]  # type: ignore[arg-type]
                   for i, key in enumerate(replies)}
            assert [endpoint.turns(i, 0).unanswered for i in range(3)] == [0, 0, 1]
    assert (got["a"].message.content, got["a"].message.model_extra["reasoning_content"]) == ("ANSWER: 4", "ANSWER: 5")
    assert got["b"].message.content == "no call" and not got["b"].message.tool_calls  # a call in thoughts is not made
    assert got["c"].message.content == "" and got["c"].finish_reason == "length"
    assert got["c"].message.model_extra["reasoning_content"] == "4 4 4"
