"""Tool calls: parsed from a model reply, run in the sandbox, and told apart as the model's or infra's fault.

Format: the model's own where its tokenizer defines one — a ``chat`` entry whose snapshot tokenizer has a
``response_template`` (transformers' response parsing) is parsed with ``tokenizer.parse_response``, and
its ``tool_calls`` are the calls (:func:`parse_with_template`); else the documented default, the
Hermes/Qwen format (:func:`parse_tool_calls`): each call is
``<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>`` anywhere in the reply; several calls
run in order. A reply without a call calls no tool. The call is the model's fault
(:class:`MalformedCall`) when its body is not a JSON object with a string ``name`` and an object
``arguments`` (a JSON string of one is accepted), names no tool of the episode, has arguments the tool's
function does not take, or the tokenizer's parser rejects the reply.

Running (:func:`run_calls`): each call is one program in :mod:`ckpteval.jobs.eval.sandbox.core` (never in the worker's
process): the tool's source, then a call of its function with the arguments read from stdin; it prints
the return value (a string as it is, anything else as JSON). A program that exits 0 gives the tool message's content.
The model chose the arguments, so a tool that raises, is killed, runs out of memory or passes its deadline
answers ``error: ...`` as its tool message and the episode goes on (never a skip the policy could choose,
#37); only a tool that exits :data:`TOOL_UNAVAILABLE` (98: its backend is down, it says so itself) and a
sandbox that cannot start are :class:`ToolFailed` — infrastructure, never the model's.

Limits: the arguments check is Python's signature binding (types are not checked against the schema);
an argument-binding failure is reported with a reserved exit status (:data:`BAD_ARGUMENTS`), which a
tool's own ``sys.exit(97)`` would imitate; a tool that runs the model's code must keep that code from exiting
98 itself (it would make the call infrastructure's).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ckpteval.jobs.eval.kinds.env import Tool
from ckpteval.jobs.eval.sandbox.core import Limits, Sandbox, SandboxUnavailable

CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
FORMAT = "hermes"  # recorded in every result's identity
BAD_ARGUMENTS = 97
TOOL_UNAVAILABLE = 98  # a tool's own exit status for "my backend is down": infrastructure, never the model's

RUNNER = """
import inspect as _inspect, json as _json, sys as _sys
_args = _json.loads(_sys.stdin.read())
_fn = {name}
try:
    _inspect.signature(_fn).bind(**_args)
except TypeError as _e:
    print(_e, file=_sys.stderr)
    raise SystemExit({bad})
_result = _fn(**_args)
print(_result if isinstance(_result, str) else _json.dumps(_result))
"""


@dataclass(frozen=True)
class Call:
    tool: Tool
    arguments: dict[str, Any]


class MalformedCall(ValueError):
    """The model's tool call cannot be run (the model's failure)."""


class ToolFailed(RuntimeError):
    """A tool could not give a result (infra): ``ending`` is ``tool_error``, ``tool_timeout`` or ``sandbox_failed``."""

    def __init__(self, ending: str, message: str) -> None:
        super().__init__(message)
        self.ending = ending


def call_of(obj: Any, tools: list[Tool]) -> Call:
    """One parsed call (``{"name", "arguments"}``, or OpenAI's ``{"type": "function", "function": {...}}``)
    checked against the episode's tools; :class:`MalformedCall` if it is not a call of one of them."""
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    arguments = obj.get("arguments", {}) if isinstance(obj, dict) else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise MalformedCall(f"tool call arguments are not JSON ({e})") from None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(arguments, dict)):
        raise MalformedCall('tool call must be {"name": str, "arguments": object}')
    by_name = {t.name: t for t in tools}
    if obj["name"] not in by_name:
        raise MalformedCall(f"no tool named {obj['name']!r} (tools: {', '.join(by_name) or 'none'})")
    return Call(by_name[obj["name"]], dict(arguments))


def parse_tool_calls(reply: str, tools: list[Tool]) -> list[Call]:
    """The default format's calls of ``reply`` in order (empty: none); :class:`MalformedCall` for the first bad one."""
    calls = []
    for body in CALL_RE.findall(reply):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            raise MalformedCall(f"tool call is not JSON ({e})") from None
        calls.append(call_of(obj, tools))
    if not calls and "<tool_call>" in reply:
        raise MalformedCall("<tool_call> without its closing </tool_call>")
    return calls


def parse_with_template(tokenizer: Any, reply: str, prompt: str, tools: list[Tool]) -> list[Call]:
    """The calls of ``reply`` as the tokenizer's own ``response_template`` parses them (``prompt``: the
    text the reply continues)."""
    try:
        parsed = tokenizer.parse_response(reply, prefix=prompt, tools=[t.schema() for t in tools] or None)
    except (ValueError, TypeError, KeyError) as e:
        raise MalformedCall(f"the tokenizer's response template cannot parse the reply ({e})".splitlines()[0]) from None
    raw = parsed.get("tool_calls") if isinstance(parsed, dict) else None
    return [call_of(obj, tools) for obj in (raw if isinstance(raw, list) else [raw] if raw else [])]


def program(tool: Tool) -> str:
    return f"{tool.source}\n{RUNNER.format(name=tool.name, bad=BAD_ARGUMENTS)}"


def run_calls(sandbox: Sandbox, calls: list[Call], timeout_s: float) -> list[str | MalformedCall | ToolFailed]:
    """Each call's result text, or why it gave none (see the module docstring), in order."""
    limits = Limits(wall_s=timeout_s, cpu_s=max(1, int(timeout_s)))
    jobs = [(program(c.tool), json.dumps(c.arguments).encode()) for c in calls]
    try:
        outcomes = sandbox.run_many(jobs, limits)
    except SandboxUnavailable as e:
        return [ToolFailed("sandbox_failed", f"the sandbox could not run a tool: {e}") for _ in calls]
    out: list[str | MalformedCall | ToolFailed] = []
    for call, o in zip(calls, outcomes, strict=True):
        err = o.stderr.decode(errors="replace").strip().splitlines()
        why = err[-1] if err else o.detail
        if o.status == "passed":
            out.append(o.stdout.decode(errors="replace").strip())
        elif o.status == "failed" and o.exit_code == BAD_ARGUMENTS:
            out.append(MalformedCall(f"tool {call.tool.name!r} does not take these arguments ({why})"))
        elif o.status == "failed" and o.exit_code == TOOL_UNAVAILABLE:
            out.append(ToolFailed("tool_error", f"tool {call.tool.name!r} is unavailable: {why}"))
        elif o.status == "timeout":  # on the model's arguments: the model's, told as the tool's answer
            out.append(f"error: tool {call.tool.name!r} passed its {timeout_s:g}s deadline")
        else:
            out.append(f"error: tool {call.tool.name!r} ended {o.status}: {why}")
    return out
