"""The ``env`` dataset kind: a unit's episodes on the pinned engine, pinned turn by turn, with failures attributed
to the model or to the infrastructure (the contract is :mod:`ckpteval.jobs.eval.kinds.env`').

Guarantee: a result is written only if every turn and the engine after the unit carry the pinned version; an
episode that ended ``infra`` is never scored. See docs/USER_GUIDE.md "Environments".
"""

from __future__ import annotations

import inspect
import json
import time
from dataclasses import dataclass, field
from typing import Any

from ckpteval.coord.entries.env import EnvEntry
from ckpteval.coord.work.units import WorkUnit, shard_range, unit_samples
from ckpteval.jobs.eval.engines.base import Engine
from ckpteval.jobs.eval.kinds.env import ENDINGS_INFRA, Done, Tool, env_class
from ckpteval.jobs.eval.kinds.env.tools import (
    FORMAT,
    Call,
    MalformedCall,
    ToolFailed,
    parse_tool_calls,
    parse_with_template,
    run_calls,
)
from ckpteval.jobs.eval.kinds.env.turns import ENDED_NO_ANSWER, Turns
from ckpteval.jobs.eval.kinds.evaluate import Evaluation
from ckpteval.jobs.eval.kinds.generate.answering import Reasoning, chat_identity, resolve_reasoning
from ckpteval.jobs.eval.kinds.generate.prompts import render_chat, snapshot_tokenizer
from ckpteval.jobs.eval.kinds.generate.reasoning import Split, split_reasoning
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache, sample_seed, sampling_params
from ckpteval.jobs.eval.proof.pinning import check_pinned
from ckpteval.jobs.eval.sandbox.core import Sandbox, shared_sandbox
from ckpteval.jobs.eval.scorers import Scored, ScorerInfraError, UnitTally, check_scored, last_line


@dataclass
class Episode:
    """One episode's state and record (``index``: the row's index in the dataset; ``sample``: its number)."""

    index: int
    sample: int
    row: dict[str, Any]
    env: Any = None
    messages: list[dict[str, str]] = field(default_factory=list)
    tools: list[Tool] = field(default_factory=list)
    log: Turns = field(default_factory=Turns)
    ended: str | None = None
    reward: float = 0.0
    answer: str | None = None
    cause: str = ""
    retries: int = 0

    @property
    def versions(self) -> list[str | None]:
        return self.log.versions

    @property
    def turns(self) -> int:
        return len(self.log.versions)

    @property
    def tokens(self) -> int:
        return self.log.tokens

    @property
    def blame(self) -> str:
        return "infra" if self.ended in ENDINGS_INFRA else "model"

    def end(self, ended: str, cause: str = "", reward: float = 0.0, answer: str | None = None) -> None:
        self.ended, self.cause, self.reward, self.answer = ended, cause, reward, answer

    def rerun(self) -> Episode:
        """A fresh episode of the same row and number, one more infra re-run counted."""
        return Episode(self.index, self.sample, self.row, retries=self.retries + 1)

    def record(self) -> dict[str, Any]:
        return {"row": self.index, "sample": self.sample, "reward": self.reward, "turns": self.turns,
                "tokens": self.tokens, "versions": list(self.versions), "ended": self.ended, "blame": self.blame,
                "answer": self.answer, "infra_retries": self.retries, **({"cause": self.cause} if self.cause else {})}


def render_transcript(messages: list[dict[str, str]], tools: list[Tool]) -> str:
    """The ``raw`` rendering of a conversation (see the module docstring)."""
    head = ""
    if tools:
        head = ('Tools (call one with <tool_call>{"name": ..., "arguments": {...}}</tool_call>):\n'
                + "".join(json.dumps(t.schema()["function"], sort_keys=True) + "\n" for t in tools) + "\n")
    return head + "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


class Renderer:
    """An entry's conversations as prompt text, for one snapshot."""

    def __init__(self, spec: EnvEntry, snapshot: str | None) -> None:
        self.spec, self.snapshot = spec, snapshot
        self.tokenizer = snapshot_tokenizer(snapshot) if spec.prompt_format == "chat" and snapshot else None
        if spec.prompt_format == "chat" and self.tokenizer is None:
            raise ValueError(f"dataset {spec.name!r} is prompt_format 'chat': rendering needs the snapshot's tokenizer")
        self.reasoning = resolve_reasoning(spec, snapshot)

    def reply(self, text: str, prompt: str) -> Split:
        """A turn's ``text`` (generated after ``prompt``) split by the entry's reasoning setting."""
        return split_reasoning(text, self.reasoning.setting, prompt)

    def __call__(self, ep: Episode) -> str:
        return self.render(ep.messages, ep.tools)

    def render(self, messages: list[dict[str, str]], tools: list[Tool]) -> str:
        """A conversation and its tools as the prompt of the next assistant turn."""
        if self.tokenizer is None:
            return render_transcript(messages, tools)
        return render_chat(self.tokenizer, messages, str(self.snapshot), [t.schema() for t in tools] or None,
                           self.spec.chat_template_kwargs)

    @property
    def tool_format(self) -> str:
        """``tokenizer`` when the snapshot's tokenizer parses its own replies (``response_template``), else
        the default ``hermes`` (:mod:`ckpteval.jobs.eval.kinds.env.tools`)."""
        return "tokenizer" if getattr(self.tokenizer, "response_template", None) else FORMAT

    def calls(self, reply: str, prompt: str, tools: list[Tool]) -> list[Call]:
        """The tool calls of ``reply`` in the model's format; :class:`MalformedCall` for a bad one."""
        if self.tool_format == FORMAT:
            return parse_tool_calls(reply, tools)
        return parse_with_template(self.tokenizer, reply, prompt, tools)

    def text_beside_calls(self, reply: str, prompt: str) -> str:
        """The ``content`` of a reply that made tool calls, without their markup, as sglang 0.5.23 returns it beside
        ``tool_calls`` (``srt/function_call/qwen25_detector.py`` ``detect_and_parse``: the text before the first
        call, stripped); the tokenizer's own ``response_template`` says it where the snapshot has one."""
        if self.tool_format == FORMAT:
            return reply.partition("<tool_call>")[0].strip()
        try:
            parsed = self.tokenizer.parse_response(reply, prefix=prompt)
        except (ValueError, TypeError, KeyError):
            return reply
        content = parsed.get("content") if isinstance(parsed, dict) else None
        return content.strip() if isinstance(content, str) else ""


def assistant_message(split: Split) -> dict[str, str]:
    """The conversation's record of an answered turn: the answer as ``content``, the thoughts (when any) as
    ``reasoning_content``."""
    return {"role": "assistant", "content": split.answer or "",
            **({"reasoning_content": split.reasoning} if split.reasoning else {})}


def _check_messages(messages: Any, what: str) -> list[dict[str, str]]:
    if not (isinstance(messages, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise TypeError(f"{what} must return a list of {{'role': str, 'content': str}} messages")
    return [dict(m) for m in messages]


def start(ep: Episode, cls: type, spec: EnvEntry) -> None:
    """A fresh environment for the episode and its first messages; its failure ends the episode ``env_error``."""
    try:
        ep.env = cls(**spec.env_options)
        messages, tools = ep.env.start(dict(ep.row))
        ep.messages = _check_messages(messages, "start()")
        if not all(isinstance(t, Tool) for t in tools):
            raise TypeError("start() must return a list of Tool as its tools")
        ep.tools = list(tools)
    except Exception as e:  # noqa: BLE001  # user code: the environment's failure is the episode's infra
        ep.end("env_error", f"start() raised {last_line(e)}")
        return
    if spec.system_prompt is not None and not (ep.messages and ep.messages[0]["role"] == "system"):
        ep.messages.insert(0, {"role": "system", "content": spec.system_prompt})


def step(ep: Episode, reply: str) -> None:
    """The environment's answer to a reply without tool calls: more messages, or the end of the episode."""
    try:
        out = ep.env.step(reply)
        if isinstance(out, Done):
            ep.end("done", reward=float(out.reward), answer=None if out.answer is None else str(out.answer))
        else:
            ep.messages += _check_messages(out, "step()")
    except Exception as e:  # noqa: BLE001  # user code: the environment's failure is the episode's infra
        ep.end("env_error", f"step() raised {last_line(e)}")


def run_tools(pending: list[tuple[Episode, list[Call]]], sandbox: Sandbox, timeout_s: float) -> None:
    """Every pending call, in the sandbox; each episode gets its results as tool messages, or ends."""
    outcomes = run_calls(sandbox, [c for _, calls in pending for c in calls], timeout_s)
    at = 0
    for ep, calls in pending:
        mine, at = outcomes[at : at + len(calls)], at + len(calls)
        for call, out in zip(calls, mine, strict=True):
            if isinstance(out, MalformedCall):
                ep.end("malformed_tool_call", str(out))
            elif isinstance(out, ToolFailed):
                ep.end(out.ending, str(out))
            else:
                ep.messages.append({"role": "tool", "name": call.tool.name, "content": out})
                continue
            break


def play(engine: Engine, spec: EnvEntry, episodes: list[Episode], render: Renderer, sandbox: Sandbox) -> float:
    """Run ``episodes`` (already started) to their end; returns the seconds spent generating."""
    params, generate_s = sampling_params(spec), 0.0
    for turn in range(spec.max_turns):
        live = [ep for ep in episodes if ep.ended is None]
        if not live:
            break
        prompts = [render(ep) for ep in live]
        t0 = time.perf_counter()
        if spec.temperature == 0:
            generations = engine.generate(prompts, params)
        else:
            generations = engine.generate(prompts, params, seeds=[sample_seed(spec.seed, e.index, e.sample, turn)
                                                                   for e in live])
        generate_s += time.perf_counter() - t0
        if len(generations) != len(live):
            raise RuntimeError(f"engine returned {len(generations)} generations for {len(live)} prompts")
        pending = []
        for ep, g, prompt in zip(live, generations, prompts, strict=True):
            split = render.reply(g.text, prompt)
            ep.log.add(g, split, render.reasoning)
            if split.answer is None:
                ep.end(ENDED_NO_ANSWER, f"turn {turn + 1}: its reasoning never ended (finish {g.finish_reason})")
                continue
            ep.messages.append(assistant_message(split))
            try:
                calls = render.calls(split.answer, prompt, ep.tools)
            except MalformedCall as e:
                ep.end("malformed_tool_call", str(e))
                continue
            if calls:
                pending.append((ep, calls))
            else:
                step(ep, split.answer)
        if pending and turn < spec.max_turns - 1:  # on the last turn no reply could read the results
            run_tools(pending, sandbox, spec.tool_timeout_s)
    for ep in episodes:
        if ep.ended is None:
            ep.end("out_of_turns", f"not done after {spec.max_turns} turns")
    return generate_s


def play_driven(engine: Engine, want: str, spec: EnvEntry, episodes: list[Episode], render: Renderer,
                cls: type) -> float:
    """Run ``episodes`` of an environment that drives the model itself (``DRIVES_MODEL``: its
    ``play(episodes, endpoint, spec)`` ends each episode) against the pinned engine's loopback endpoint
    (:mod:`ckpteval.jobs.eval.kinds.env.endpoint`); every turn's version is the endpoint's record. Returns the seconds spent."""
    from ckpteval.jobs.eval.kinds.env.endpoint import Endpoint

    t0 = time.perf_counter()
    with Endpoint(engine, want, spec, render) as endpoint:
        try:
            cls(**spec.env_options).play(episodes, endpoint, spec)
        except Exception as e:  # noqa: BLE001  # user code: the environment's failure is the episodes' infra
            for ep in episodes:
                if ep.ended is None:
                    ep.end("env_error", f"play() raised {last_line(e)}")
    for ep in episodes:
        ep.log = endpoint.turns(ep.index, ep.sample)
        if ep.ended is None:
            ep.end("env_error", "play() did not end the episode")
        if ep.log.unanswered and ep.blame == "model":  # as on the lockstep path: that turn ended the episode
            ep.end(ENDED_NO_ANSWER, f"{ep.log.unanswered} turn(s) whose reasoning never ended (was: {ep.ended})")
    endpoint.raise_engine_error()
    return time.perf_counter() - t0


def env_sandbox(cache: DatasetCache) -> Sandbox:
    """The worker's sandbox pool (the code scorer's settings: ``--sandbox-concurrency``,
    ``--unsafe-code-rlimits-only``)."""
    mode = "rlimits-only" if cache.ctx.option("unsafe_code_rlimits_only", False) else "bwrap"
    return shared_sandbox(mode, cache.ctx.option("sandbox_concurrency", 0) or None)


def identity(spec: EnvEntry, sandbox: Sandbox, tool_format: str, reasoning: Reasoning) -> dict[str, Any]:
    """What scored the unit (the result's ``scorer``): units disagreeing on it are never pooled."""
    return {"env": spec.env, "env_options": dict(spec.env_options), "max_turns": spec.max_turns,
            "tool_format": tool_format, "prompt_format": spec.prompt_format, "sandbox": sandbox.mode,
            **chat_identity(spec, reasoning)}


def run_unit(engine: Engine, cache: DatasetCache, spec: EnvEntry, unit: WorkUnit, snapshot: str | None,
             want: str) -> tuple[list[Episode], float, Renderer]:
    """The unit's episodes, infra ones re-run within the budget, pinned (every turn) before returning; the
    seconds spent generating; the renderer used (its tool-call format and reasoning setting)."""
    rows = cache.rows(spec)
    cls, sandbox = env_class(spec.env), env_sandbox(cache)
    render = Renderer(spec, snapshot)
    episodes = [Episode(i, j, rows[i]) for i in shard_range(cache.manifest, unit) for j in unit_samples(cache.manifest, unit)]
    todo, seen, generate_s = list(range(len(episodes))), [], 0.0
    for attempt in range(spec.infra_retries + 1):
        batch = [episodes[k] for k in todo]
        if getattr(cls, "DRIVES_MODEL", False):
            generate_s += play_driven(engine, want, spec, batch, render, cls)
        else:
            for ep in batch:
                start(ep, cls, spec)
            generate_s += play(engine, spec, batch, render, sandbox)
        seen += [v for ep in batch for v in ep.versions]
        todo = [k for k in todo if episodes[k].blame == "infra"]
        if not todo or attempt == spec.infra_retries:
            break
        for k in todo:
            episodes[k] = episodes[k].rerun()
    check_pinned(engine, want, seen)
    if todo:
        ep = episodes[todo[0]]
        raise ScorerInfraError("env_failed", f"{len(todo)} episode(s) still failed by the infrastructure after "
                               f"{spec.infra_retries} re-run(s); row {ep.index} episode {ep.sample}: {ep.ended}: {ep.cause}")
    return episodes, generate_s, render


def evaluate_env(engine: Engine, cache: DatasetCache, spec: EnvEntry, unit: WorkUnit, snapshot: str,
                 want: str) -> Evaluation:
    """The ``env`` kind (:mod:`ckpteval.jobs.eval.kinds.evaluate`): the unit's episodes, their rewards as its scores."""
    episodes, generate_s, render = run_unit(engine, cache, spec, unit, snapshot, want)
    scored = [Scored(ep.reward, ep.answer, counters={"infra_retries": ep.retries},
                     extras={"reward": ep.reward, "turns": float(ep.turns), **ep.log.extras()}) for ep in episodes]
    check_scored(scored, f"env {spec.name}")  # a reward of nan/inf/1e308 is the env's crash, never a point
    scorer = identity(spec, env_sandbox(cache), render.tool_format, render.reasoning)
    fields = {**UnitTally.of(scored).as_result_fields(), "scorer": scorer,
              "episodes": [ep.record() for ep in episodes]}
    return Evaluation([s.score for s in scored], [ep.versions[-1] for ep in episodes],
                      answers=[s.answer for s in scored], scored=fields, generate_s=generate_s)


def check_env_entry(cache: DatasetCache, spec: EnvEntry) -> None:
    """At worker start: the environment imports, takes ``env_options``, and every row passes its optional
    ``check_row``."""
    try:
        cls = env_class(spec.env)
        inspect.signature(cls).bind(**spec.env_options)
    except (ValueError, TypeError) as e:
        raise ValueError(f"dataset {spec.name!r}: environment {spec.env!r}: {e}") from None
    own_check = getattr(cls, "check_row", None)
    for i, row in enumerate(cache.rows(spec)):
        if own_check is not None:
            own_check(row, f"{spec.path}: row {i}")
