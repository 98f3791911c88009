"""The ``env`` dataset kind (jobs/eval/envs): episodes with known rewards, failures attributed right.

What is real: the engine path is the real :class:`ckpteval.jobs.eval.engines.http.engine.HTTPEngine` (load, pin,
``/generate`` with per-sample versions) against :class:`tests.support.canned_engine.ScriptedEngine`, a real
stdlib HTTP server whose replies come from a scripted policy reading the transcript it is sent (a model
cannot be scripted, and the ``fn`` backend cannot play turns); tools run in the real sandbox (bwrap);
workers are real (in-process, or a subprocess killed with a real SIGKILL); the trainer test runs the
real ``ckpteval train`` with its real tiny model (its rewards are what its episodes' results say).
Tests that need bwrap are skipped, with the probe's reason, where it cannot start.
"""

from __future__ import annotations

import json
import re
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from ckpteval.coord.entries.env import EnvEntry
from ckpteval.coord.results.points import derive_point, point_metrics
from ckpteval.coord.run.identity import run_key
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest, parse_manifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.engines.factory import make_engine
from ckpteval.jobs.eval.kinds.env.examples import arithmetic_rows
from ckpteval.jobs.eval.kinds.env.runner import evaluate_env
from ckpteval.jobs.eval.kinds.env.tools import MalformedCall, parse_tool_calls
from ckpteval.jobs.eval.kinds.generate.evalsets import write_jsonl
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
from ckpteval.jobs.eval.proof.pinning import PinViolation, pin
from ckpteval.jobs.eval.sandbox.core import probe_bwrap
from ckpteval.jobs.eval.scorers import ScorerInfraError
from ckpteval.jobs.eval.worker.evalconfig import read_eval_config
from ckpteval.jobs.eval.worker.options import WorkerOptions
from tests.support import envs as test_envs
from tests.support.canned_engine import ScriptedEngine
from tests.support.runs import write_tiny_shards
from tests.support.training import read_jsonl
from tests.support.workers import (
    PYTHON,
    REPO,
    finish,
    kill_all,
    publish_as_trainer,
    results,
    run_inprocess,
    spawn,
    version,
    wait_for,
)

WHY_NOT = probe_bwrap()
needs_bwrap = pytest.mark.skipif(WHY_NOT is not None, reason=f"bwrap cannot start here: {WHY_NOT}")
ROWS = arithmetic_rows(4, seed=7)
EXPR = re.compile(r"What is (.+?)\? You may")


# -- the scripted policy ----------------------------------------------------------------------------------
def behaviour(text: str) -> str:
    """right | wrong | malformed | chatty: by the row the transcript is about (ROWS[0..3])."""
    m = EXPR.search(text)
    expression = m.group(1) if m else ""
    return {r["expression"]: kind for r, kind in zip(ROWS, ("right", "wrong", "malformed", "chatty"), strict=True)}.get(
        expression, "right")


def policy(text: str, _engine: ScriptedEngine) -> str:
    """right: call the calculator, then answer with its value; wrong: answer 0; malformed: a call that is
    not JSON; chatty: never answers."""
    last = text.split("\n")[-2]  # the message before "assistant:"
    kind = behaviour(text)
    if kind == "right":
        if last.startswith("tool: "):
            return f"ANSWER: {last[len('tool: '):]}"
        expression = EXPR.search(text).group(1)  # type: ignore[union-attr]
        return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'
    return {"wrong": "ANSWER: 0", "malformed": "<tool_call>{calculator: 1+1}</tool_call>", "chatty": "hmm"}[kind]


def env_run(tmp: Path, rows: list[dict[str, Any]], env: str = "arithmetic", lease: LeaseSettings | None = None,
            **kw: Any) -> RunDir:
    run = RunDir.create(tmp / "run")
    write_jsonl(run.data / "arith.jsonl", rows)
    spec = EnvEntry(name="arith", path="data/arith.jsonl", n_prompts=len(rows), env=env,
                   **{"shard_size": len(rows), "max_turns": 3, "max_new_tokens": 32, **kw})
    manifest = RunManifest(run_id="test-env", eval=EvalSpec(entries=(spec,)), snapshot_roots=(str(run.snapshots),),
                           lease=lease or LeaseSettings(30.0, 5.0))
    run = RunDir.create(run.path, manifest)
    publish_as_trainer(run.snapshots, 1, lambda d: write_tiny_shards(d))
    return run


def evaluate(run: RunDir, url: str) -> Any:
    """One unit through the real HTTP engine, pinned to step 1's version like a worker does."""
    engine = make_engine(f"http:{url}", "cpu", {})
    snapshot = str(next(run.snapshots.iterdir()))
    want = version(run, 1)
    pin(engine, snapshot, want)
    cache = DatasetCache(run, run.manifest())
    return evaluate_env(engine, cache, run.manifest().entry("arith"), WorkUnit(1, "arith", 0),  # type: ignore[arg-type]
                        snapshot, want)


# -- pure parts ---------------------------------------------------------------------------------------------
def test_tool_calls_parse_in_the_hermes_format_and_malformed_ones_are_the_models() -> None:
    from ckpteval.jobs.eval.kinds.env.examples import CALCULATOR

    (call,) = parse_tool_calls('ok <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>',
                               [CALCULATOR])
    assert (call.tool.name, call.arguments) == ("calculator", {"expression": "1+2"})
    assert parse_tool_calls("ANSWER: 3", [CALCULATOR]) == []
    for bad, why in (("<tool_call>{x}</tool_call>", "not JSON"), ('<tool_call>{"name": "search"}</tool_call>', "no tool"),
                     ('<tool_call>{"name": "calculator"', "closing")):
        with pytest.raises(MalformedCall, match=why):
            parse_tool_calls(bad, [CALCULATOR])


def test_env_entries_are_validated_where_run_json_is_parsed(tmp_path: Path) -> None:
    def parse(entry: dict[str, Any]) -> Any:
        obj = {"run_id": "r", "snapshot_roots": [], "eval": {"datasets": [
            {"name": "e", "kind": "env", "path": "e.jsonl", "n_prompts": 1, **entry}]}}
        return parse_manifest(obj, tmp_path / "run.json")

    assert parse({"env": "guess", "env_options": {"efficiency": True}}).eval.entries[0].max_turns == 4
    with pytest.raises(ValueError, match=r"datasets\[0\].env 'gues' is not an environment \(did you mean 'guess'"):
        parse({"env": "gues"})
    with pytest.raises(ValueError, match=r"env_options does not fit environment 'guess'"):
        parse({"env": "guess", "env_options": {"effort": 1}})
    with pytest.raises(ValueError, match=r"max_turns must be >= 1"):
        parse({"env": "guess", "max_turns": 0})
    with pytest.raises(ValueError, match=r"max_turn is not a setting .*did you mean 'max_turns'"):
        parse({"env": "guess", "max_turn": 3})
    spec = parse({"env": "tests.support.envs:FlakyToolEnv"}).eval.entries[0]  # imported only after the trust check
    assert spec.env == "tests.support.envs:FlakyToolEnv"
    manifest = parse({"env": "guess", "max_turns": 2})
    written = manifest.to_json()  # run.json keeps an env entry's kind (only the default kind is left out)
    assert written["eval"]["datasets"][0]["kind"] == "env" and parse_manifest(written, tmp_path / "run.json") == manifest


def test_example_env_sets_are_generated_and_their_configs_read(tmp_path: Path) -> None:
    import shutil
    import subprocess

    copy = tmp_path / "envs"
    shutil.copytree(REPO / "examples/envs", copy)
    subprocess.run([PYTHON, str(copy / "generate.py")], check=True, capture_output=True, timeout=60)
    for name in ("arithmetic", "guess"):
        assert (copy / f"{name}.jsonl").read_bytes() == (REPO / f"examples/envs/{name}.jsonl").read_bytes()
        (spec,) = read_eval_config(REPO / f"examples/envs/{name}.eval.json").spec.entries
        assert (spec.kind, spec.env, spec.n_prompts) == ("env", name, 16)


# -- episodes on the real engine path -----------------------------------------------------------------------
@needs_bwrap
def test_scripted_episodes_get_their_known_rewards_and_every_turn_is_pinned(tmp_path: Path) -> None:
    """Through a real in-process worker: right call (1), wrong answer (0), malformed call (0), out of turns (0)."""
    run = env_run(tmp_path, ROWS, pass_k=(1,))
    with ScriptedEngine(policy) as url:
        code, _ = run_inprocess(WorkerOptions(run_dir=run.path, engines=(f"http:{url}",), once=True,
                                              poll_interval_s=0.05), out=lambda _l: None)
    assert code == 0
    r = results(run)[WorkUnit(1, "arith", 0)]
    assert r.ok and r.scores == (1.0, 0.0, 0.0, 0.0)
    eps = r.episodes
    assert [e["ended"] for e in eps] == ["done", "done", "malformed_tool_call", "out_of_turns"]
    assert [e["blame"] for e in eps] == ["model"] * 4 and [e["turns"] for e in eps] == [2, 1, 1, 3]
    assert eps[0]["answer"] == str(ROWS[0]["answer"]) and eps[1]["answer"] == "0"
    assert all(e["versions"] == [version(run, 1)] * e["turns"] and e["tokens"] >= e["turns"] for e in eps)
    assert r.counters == {"infra_retries": 0} and r.scorer["env"] == "arithmetic" and r.scorer["sandbox"] == "bwrap"
    metrics = point_metrics(derive_point(run.manifest(), 1, results(run)))
    assert metrics["eval/arith"] == metrics["eval/arith/reward"] == 0.25
    assert metrics["eval/arith/turns"] == 7 / 4 and metrics["eval/arith/infra_retries"] == 0
    assert metrics["eval/arith/pass@1"] == 0.25 and metrics["eval/arith/weight_version/mixed_version_ratio"] == 0


@needs_bwrap
def test_a_crashing_tool_is_infra_retried_and_never_scored(tmp_path: Path) -> None:
    rows = [ROWS[0], ROWS[0]]
    test_envs.FlakyToolEnv.starts = 0  # the class counts this process's starts: the first two crash
    run = env_run(tmp_path, rows, env="tests.support.envs:FlakyToolEnv", env_options={"flaky_starts": 2})
    with ScriptedEngine(policy) as url:
        ev = evaluate(run, url)
    assert ev.scores == [1.0, 1.0]  # both re-run from the start after the crash, then right
    assert [e["infra_retries"] for e in ev.scored["episodes"]] == [1, 1]
    assert ev.scored["counters"] == {"infra_retries": 2}
    assert all(e["ended"] == "done" and e["blame"] == "model" for e in ev.scored["episodes"])


@needs_bwrap
def test_a_tool_that_stays_down_skips_the_unit_env_failed_with_the_cause(tmp_path: Path) -> None:
    test_envs.FlakyToolEnv.starts = 0
    run = env_run(tmp_path, [ROWS[0]], env="tests.support.envs:FlakyToolEnv", env_options={"flaky_starts": 99},
                  infra_retries=1)
    with ScriptedEngine(policy) as url:  # a real in-process worker writes the unit's skip
        code, _ = run_inprocess(WorkerOptions(run_dir=run.path, engines=(f"http:{url}",), once=True, max_attempts=1,
                                              poll_interval_s=0.05), out=lambda _l: None)
    r = results(run)[WorkUnit(1, "arith", 0)]
    assert (r.status, r.skip_reason, r.scores) == ("skipped", "env_failed", ())
    assert "tool_error" in r.message and "calculator backend is down" in r.message and "after 1 re-run(s)" in r.message
    assert test_envs.FlakyToolEnv.starts == 2  # the first try and its one retry


@needs_bwrap
def test_a_tool_past_its_deadline_answers_an_error_and_the_episode_scores(tmp_path: Path) -> None:
    """The model chose the call's arguments (#37): a tool that hangs on them answers an error as its tool
    message and the episode goes on to its score (0 here), never a skip the policy could choose."""
    run = env_run(tmp_path, [ROWS[0]], env="tests.support.envs:HangingToolEnv", infra_retries=0, tool_timeout_s=1.0)
    with ScriptedEngine(policy) as url:
        ev = evaluate(run, url)
    (episode,) = ev.scored["episodes"]
    assert (episode["blame"], episode["reward"], episode["infra_retries"]) == ("model", 0.0, 0), episode


def test_an_environment_that_raises_is_infra_not_the_models(tmp_path: Path) -> None:
    run = env_run(tmp_path, [ROWS[1]], env="tests.support.envs:BrokenStepEnv", infra_retries=1)
    with ScriptedEngine(policy) as url, pytest.raises(ScorerInfraError) as info:
        evaluate(run, url)
    assert "env_error" in str(info.value) and "verifier service unreachable" in str(info.value)


@needs_bwrap
def test_an_engine_reloaded_between_two_turns_is_a_pin_violation(tmp_path: Path) -> None:
    def reloading(text: str, engine: ScriptedEngine) -> str:
        if text.split("\n")[-2].startswith("tool: "):  # the second turn: someone else reloaded the server
            engine.label = "other-run@7"
        return policy(text, engine)

    run = env_run(tmp_path, [ROWS[0]])
    with ScriptedEngine(reloading) as url, pytest.raises(PinViolation, match="other-run@7"):
        evaluate(run, url)


# -- a worker killed mid-episode --------------------------------------------------------------------------
@needs_bwrap
def test_a_worker_killed_mid_episode_is_rerun_by_another_and_one_result_is_written(tmp_path: Path) -> None:
    run = env_run(tmp_path, ROWS[:1], lease=LeaseSettings(4.0, 1.0))
    second_turn = threading.Event()
    release = threading.Event()

    def stalling(text: str, engine: ScriptedEngine) -> str:
        if text.split("\n")[-2].startswith("tool: ") and not release.is_set():
            second_turn.set()
            release.wait(60)  # worker a is killed while it waits for this reply
        return policy(text, engine)

    procs = []
    server = ScriptedEngine(stalling)
    with server as url:
        try:
            a = spawn("worker", "--run-dir", str(run.path), "--once", "--engine", f"http:{url}", "--worker-id", "a",
                      "--poll-interval", "0.05")
            procs.append(a)
            wait_for(second_turn.is_set, 120, what="worker a's second turn")
            a.send_signal(signal.SIGKILL)
            a.communicate()
            release.set()
            b = spawn("worker", "--run-dir", str(run.path), "--once", "--engine", f"http:{url}", "--worker-id", "b",
                      "--poll-interval", "0.05")
            procs.append(b)
            code, out = finish(b, timeout=120)
        finally:
            kill_all(procs)
    assert code == 0, out
    got = results(run)
    assert list(got) == [WorkUnit(1, "arith", 0)]
    r = got[WorkUnit(1, "arith", 0)]
    assert r.ok and r.worker["worker_id"] == "b" and r.scores == (1.0,) and r.episodes[0]["turns"] == 2
    assert r.attempt == 2  # a's claim was attempt 1
    first_turns = [t for t in server.texts if t.split("\n")[-2].startswith("user: What is")]
    assert len(first_turns) == 2  # b re-ran the episode from its first turn (a's turns are not reused)
    assert not (run.results / "duplicates").exists()


# -- a trainer run with an env entry --------------------------------------------------------------------------
def test_trainer_logs_the_rewards_its_episodes_results_say(tmp_path: Path) -> None:
    """``ckpteval train --eval-config`` (shared posture) with the guess example's first 4 rows: the real tiny
    model plays for real (no tools: no sandbox needed); every turn of every point is pinned to its step and
    the logged ``eval/guess`` is the mean of the rewards its episodes' results record."""
    rows = [json.loads(line) for line in (REPO / "examples/envs/guess.jsonl").read_text().splitlines()[:4]]
    # one short turn: the tiny model's context is 64 tokens, and a prompt over it is `rejected` (as sglang does);
    # multi-turn episodes are the scripted-engine tests' above
    rows = [{**r, "ask": "GUESS 1-100"} for r in rows]
    write_jsonl(tmp_path / "guess.jsonl", rows)
    config = tmp_path / "envs.eval.json"
    config.write_text(json.dumps({"eval": {"datasets": [
        {"name": "guess", "kind": "env", "env": "guess", "path": "guess.jsonl", "max_turns": 1,
         "max_new_tokens": 4, "shard_size": 4}]}}))
    run_dir = tmp_path / "train"
    proc = spawn("train", "--run-dir", str(run_dir), "--steps", "4", "--eval-interval", "2", "--no-progress",
                 "--eval-posture", "shared", "--eval-config", str(config), "--threads", "1", "--batch-size", "8")
    code, out = finish(proc, timeout=600)
    assert code == 0, out[-3000:]
    run = RunDir(run_dir)
    manifest, got = run.manifest(), results(run)
    points = {m["eval/step"]: m for m in read_jsonl(run_dir / "metrics.jsonl") if "eval/step" in m}
    assert sorted(points) == [0, 2, 4]
    for step, logged in points.items():
        r = got[WorkUnit(int(step), "guess", 0)]
        assert r.ok and len(r.episodes) == 4, r.message
        assert all(v == f"{run_key(manifest)}@{int(step)}" for e in r.episodes for v in e["versions"])
        assert all(e["turns"] == 1 and e["blame"] == "model" for e in r.episodes)
        assert logged["eval/guess"] == logged["eval/guess/reward"] == sum(e["reward"] for e in r.episodes) / 4
        assert logged["eval/guess/weight_version/mixed_version_ratio"] == 0
        assert logged["eval/guess/infra_retries"] == 0


# -- where episodes may run, and what they may import ------------------------------------------------------------
def test_env_entries_need_an_engine_and_their_module_class_is_run_code(tmp_path: Path) -> None:
    from ckpteval.jobs.eval.proof.trust import run_code
    from ckpteval.jobs.eval.worker.evaluators import build_evaluator

    run = env_run(tmp_path, [ROWS[0]], env="tests.support.envs:FlakyToolEnv")
    assert run_code(run.manifest()) == ["tests.support.envs:FlakyToolEnv"]  # imported only under the trust rule
    opts = WorkerOptions(run_dir=run.path, engines=("fn:tests.support.workers:SumBackend",), once=True)
    with pytest.raises(ValueError, match=r"env entries \['arith'\]: they need an engine"):
        build_evaluator(opts, run.manifest(), DatasetCache(run, run.manifest()))


def test_worker_start_refuses_options_the_environment_does_not_take_and_rows_it_cannot_read(tmp_path: Path) -> None:
    from ckpteval.jobs.eval.kinds.env.runner import check_env_entry

    bad = env_run(tmp_path / "a", [ROWS[0]], env="tests.support.envs:FlakyToolEnv", env_options={"flaky": 1})
    with pytest.raises(ValueError, match=r"dataset 'arith': environment .*unexpected keyword argument 'flaky'"):
        check_env_entry(DatasetCache(bad, bad.manifest()), bad.manifest().entry("arith"))  # type: ignore[arg-type]
    rows = env_run(tmp_path / "b", [{"question": "2+2"}])
    with pytest.raises(ValueError, match=r"data/arith.jsonl: row 0: an arithmetic row needs a string 'expression'"):
        check_env_entry(DatasetCache(rows, rows.manifest()), rows.manifest().entry("arith"))  # type: ignore[arg-type]


def test_chat_episodes_render_with_the_snapshots_template_and_the_tools_schemas(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from ckpteval.jobs.eval.kinds.env.examples import CALCULATOR
    from ckpteval.jobs.eval.kinds.env.runner import Episode, Renderer
    from ckpteval.jobs.reference.model import save_tokenizer

    snapshot = tmp_path / "snap"
    save_tokenizer(snapshot, chat=True)
    spec = EnvEntry(name="arith", path="a.jsonl", n_prompts=1, env="arithmetic", prompt_format="chat")
    ep = Episode(0, 0, ROWS[0], messages=[{"role": "user", "content": "What is 2+3?"},
                                          {"role": "assistant", "content": "<tool_call>...</tool_call>"},
                                          {"role": "tool", "content": "5"}], tools=[CALCULATOR])
    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    want = tokenizer.apply_chat_template(ep.messages, tools=[CALCULATOR.schema()], tokenize=False,
                                         add_generation_prompt=True)
    assert Renderer(spec, str(snapshot))(ep) == want and "What is 2+3?" in want
    raw = Renderer(EnvEntry(name="arith", path="a.jsonl", n_prompts=1, env="arithmetic"), None)(ep)
    assert raw.endswith("user: What is 2+3?\nassistant: <tool_call>...</tool_call>\ntool: 5\nassistant:")
    assert '"name": "calculator"' in raw


@needs_bwrap
def test_a_tokenizer_with_its_own_response_template_parses_its_tool_calls(tmp_path: Path) -> None:
    """A chat entry on a snapshot whose tokenizer defines ``response_template`` (calls as ``[CALL]json[/CALL]``):
    the calls are parsed the model's way, the tool runs, its result is rendered back by the template."""
    from ckpteval.jobs.reference.model import build_tokenizer

    def with_template(d: Path) -> None:
        write_tiny_shards(d)
        tok = build_tokenizer(64, chat=True)
        tok.response_template = {"version": 1, "start_anchor": "\n ", "fields": {
            "content": {}, "tool_calls": {"open": "[CALL]", "close": "[/CALL]", "content": "json", "repeats": True}}}
        tok.save_pretrained(d)

    run = RunDir.create(tmp_path / "run")
    write_jsonl(run.data / "arith.jsonl", ROWS[:1])
    spec = EnvEntry(name="arith", path="data/arith.jsonl", n_prompts=1, env="arithmetic", prompt_format="chat",
                   max_turns=3, max_new_tokens=32)
    run = RunDir.create(run.path, RunManifest(run_id="test-env", eval=EvalSpec(entries=(spec,)),
                                              snapshot_roots=(str(run.snapshots),), lease=LeaseSettings(30.0, 5.0)))
    publish_as_trainer(run.snapshots, 1, with_template)
    expression, answer = ROWS[0]["expression"], str(ROWS[0]["answer"])

    def own_format(text: str, _engine: ScriptedEngine) -> str:
        if "[CALL]" in text:
            return f"ANSWER: {answer}"
        return f'[CALL]{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}[/CALL]'

    server = ScriptedEngine(own_format)
    with server as url:
        ev = evaluate(run, url)
    texts = server.texts
    (episode,) = ev.scored["episodes"]
    assert ev.scores == [1.0] and episode["turns"] == 2 and ev.scored["scorer"]["tool_format"] == "tokenizer"
    assert answer not in texts[0] and f"\n {answer}\n" in texts[1]  # the sandboxed tool's result, as a tool turn


@needs_bwrap
def test_arguments_the_tool_does_not_take_are_the_models_malformed_call(tmp_path: Path) -> None:
    def bad_arguments(text: str, _engine: ScriptedEngine) -> str:
        return '<tool_call>{"name": "calculator", "arguments": {"expr": "1+1"}}</tool_call>'

    run = env_run(tmp_path, [ROWS[0]])
    with ScriptedEngine(bad_arguments) as url:
        ev = evaluate(run, url)
    (episode,) = ev.scored["episodes"]
    assert ev.scores == [0.0] and (episode["ended"], episode["blame"], episode["turns"]) == ("malformed_tool_call", "model", 1)
    assert "does not take these arguments" in episode["cause"] and "expr" in episode["cause"]


def test_pass_at_k_counts_an_episode_passed_from_its_entrys_pass_threshold() -> None:
    from ckpteval.coord.results.files import ok_result
    from ckpteval.coord.results.points import dataset_score

    rewards = [1.0, 0.5, 0.25, 0.0]  # e.g. guess with efficiency: 1/guesses
    result = ok_result(WorkUnit(1, "g", 0), rewards, ["k@1"] * 4)
    for threshold, want in ((1.0, 0.25), (0.5, 0.5), (0.25, 0.75)):
        spec = EnvEntry(name="g", path="g.jsonl", n_prompts=1, env="guess", n_samples=4, pass_k=(1,),
                       pass_threshold=threshold)
        score = dataset_score(spec, "k", 1, [result])
        assert (score.score, score.derived["pass@1"]) == (0.4375, want)


# -- reasoning models: every turn's thoughts are stripped before the environment reads it ----------------------
THINK = {"end": "</think>", "start": "<think>"}


def thinking(text: str, _engine: ScriptedEngine) -> str | tuple[str, str]:
    """A reasoning model per row (ROWS[0..3]): a wrong answer in its thoughts and the right one after; the
    right one in its thoughts and a wrong one after; cut at the length limit thinking the right one; a tool
    call inside its thoughts and no answer after it, then (reminded) the right answer."""
    m = EXPR.search(text)
    row = next(i for i, r in enumerate(ROWS) if m and r["expression"] == m.group(1))
    right = ROWS[row]["answer"]
    if row == 0:
        return f"<think>is it ANSWER: 0?</think> ANSWER: {right}"
    if row == 1:
        return f"<think>ANSWER: {right}</think> ANSWER: 0"
    if row == 2:
        return (f"<think>ANSWER: {right} " * 3, "length")
    if "Reply ANSWER" in text.split("\n")[-2]:
        return f"<think>ok</think>ANSWER: {right}"
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{ROWS[row]["expression"]}"}}}}</tool_call>'
    return f"<think>I could {call}</think>hmm"


def test_each_turns_reasoning_is_stripped_before_the_environment_and_a_cut_turn_is_no_answer(tmp_path: Path) -> None:
    """``reasoning`` on an env entry, through the real HTTP engine and the real arithmetic environment: the
    environment reads each turn's answer only (a number in the thoughts never counts, a tool call in the
    thoughts never runs), a turn whose reasoning never ends ends its episode ``no_answer`` unseen, and the
    point reports truncated / no_answer / completion_tokens per episode. The same replies without the
    setting score the thoughts (the control)."""
    from ckpteval.coord.results.files import ResultIndex
    from ckpteval.jobs.eval.kinds.evaluate import unit_result

    run = env_run(tmp_path / "think", ROWS, reasoning=THINK)
    server = ScriptedEngine(thinking)
    with server as url:
        ev = evaluate(run, url)
    eps = ev.scored["episodes"]
    assert ev.scores == [1.0, 0.0, 0.0, 1.0]
    assert [e["ended"] for e in eps] == ["done", "done", "no_answer", "done"]
    assert [e["answer"] for e in eps] == [str(ROWS[0]["answer"]), "0", None, str(ROWS[3]["answer"])]
    assert [e["turns"] for e in eps] == [1, 1, 1, 2] and {e["blame"] for e in eps} == {"model"}
    assert "reasoning never ended" in eps[2]["cause"]
    assert not any("\ntool: " in t for t in server.texts)  # the call in the thoughts never ran
    reminded = next(t for t in server.texts if "Reply ANSWER" in t)
    assert reminded.endswith("assistant: hmm\nuser: Reply ANSWER: <integer>, or call the calculator.\nassistant:")
    assert ev.scored["scorer"]["reasoning"] == {"end": "</think>", "start": "<think>", "always": False}
    assert ResultIndex(run.results).publish(unit_result(WorkUnit(1, "arith", 0), ev))
    metrics = point_metrics(derive_point(run.manifest(), 1, results(run)))
    assert metrics["eval/arith/truncated"] == 0.25 and metrics["eval/arith/no_answer"] == 0.25
    assert metrics["eval/arith/completion_tokens"] == sum(e["tokens"] for e in eps) / 4
    control = env_run(tmp_path / "whole", ROWS[:3])
    with ScriptedEngine(thinking) as url:
        assert evaluate(control, url).scores == [0.0, 1.0, 1.0]  # the environment read the thoughts
