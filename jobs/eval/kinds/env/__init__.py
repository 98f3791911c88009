"""The environment registry and contract: multi-turn, tool-using episodes as an eval set (``kind: "env"``).

An ``env`` entry of run.json's ``eval.datasets`` (:class:`ckpteval.coord.entries.env.EnvEntry`) names an environment
(``env``): a name of :data:`ENVIRONMENTS`, or ``module:Class`` (imported only under the run-code trust
rule, :mod:`ckpteval.jobs.eval.proof.trust`). Its rows are a JSONL file of objects (any fields: the environment reads
them); ``n_samples`` episodes run per row, each of at most ``max_turns`` model turns. The episode loop is
:mod:`ckpteval.jobs.eval.kinds.env.runner`'s; tools run in the sandbox (:mod:`ckpteval.jobs.eval.kinds.env.tools`).

The contract (a new instance per episode, ``Class(**env_options)``)::

    class MyEnv:
        def start(self, row: dict) -> tuple[list[dict], list[Tool]]:
            # the first messages ({"role", "content"}) and the tools the model may call
        def step(self, reply: str) -> list[dict] | Done:
            # the model's reply (one without tool calls): the next messages, or Done(reward, answer)
        # optional: @classmethod check_row(cls, row, where) -> None  (ValueError naming `where`)

Or, for an environment that runs its own loop and calls the model itself (``verifiers``): a class
attribute ``DRIVES_MODEL = True`` and ``play(self, episodes, endpoint, spec)``, which plays every
:class:`~ckpteval.jobs.eval.kinds.env.runner.Episode` against its OpenAI ``base_url`` ``endpoint.base_url(ep.index,
ep.sample)`` (:mod:`ckpteval.jobs.eval.kinds.env.endpoint`: the pinned engine, each turn version-stamped) and ends each
with ``ep.end(ending, cause, reward, answer)`` — the endings and blame below.

A reply that calls tools (in the model's format where its tokenizer defines one, else
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the Hermes/Qwen format; see
:mod:`ckpteval.jobs.eval.kinds.env.tools`) is not shown to ``step``: the runner runs each
call's :class:`Tool` in the sandbox and appends its result as a ``{"role": "tool"}`` message.

How an episode ends (recorded per episode, ``ended``) and who is to blame (``blame``):

- ``model``: ``done`` (``step`` returned :class:`Done`; its reward, wrong answers included),
  ``malformed_tool_call`` (not JSON, an unknown tool, arguments the tool's function does not take),
  ``out_of_turns``, ``no_answer`` (a turn whose reasoning never ended, with the entry's ``reasoning`` setting:
  :mod:`ckpteval.jobs.eval.kinds.env.runner`) — reward 0 unless ``done``;
- ``infra``: ``env_error`` (``start``/``step`` raised), ``tool_error`` (a tool raised, exited non-zero or
  was killed), ``tool_timeout`` (past ``tool_timeout_s``), ``sandbox_failed`` — never scored: the episode
  is re-run up to ``infra_retries`` times, then its unit is skipped ``env_failed`` with the cause.

Adding an environment: write the class (import-light module: the run.json parser imports this package,
not the environment), add one line to :data:`ENVIRONMENTS`. :func:`check_env` is the parser's check
(installed by :func:`ckpteval.jobs.eval.kinds.evaluate.install_checks`).

Limits: an environment object runs in the worker's process (its ``start``/``step`` are trusted code, as a
scorer is); only tools run sandboxed, as Python with the standard library only; episodes of a unit run
in lockstep (one batched generate per turn), so a unit takes as long as its longest episode.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckpteval.coord.registry import Registry
from ckpteval.coord.run.manifest import FieldError, Fields

ENVIRONMENTS: Registry[str] = Registry(
    "an environment",
    ("arithmetic", "ckpteval.jobs.eval.kinds.env.examples:ArithmeticEnv"),
    ("guess", "ckpteval.jobs.eval.kinds.env.examples:GuessEnv"),
    ("verifiers", "ckpteval.jobs.eval.kinds.env.verifiers_env:VerifiersEnv"),  # optional extra: pip install 'ckpteval[envs]'
    unknown="{name!r} is not an environment ({hint}known: {known}, or module:Class)", key="env",
)
ENDINGS_INFRA = ("env_error", "tool_error", "tool_timeout", "sandbox_failed")  # any other ending is the model's


@dataclass(frozen=True)
class Tool:
    """A tool the model may call: ``source`` is Python (standard library only) defining a function named
    ``name``, called in the sandbox with the call's ``arguments`` as keyword arguments; its return value
    (JSON-encodable) is the tool message's content. Errors the model caused (a bad expression) should be
    returned as a value: an exception that escapes the function is the tool's crash (infra)."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    source: str

    def schema(self) -> dict[str, Any]:
        """The OpenAI/HF ``tools=`` entry of this tool (what chat templates render)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class Done:
    """The end of an episode: its reward and, optionally, the answer the environment extracted."""

    reward: float
    answer: str | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    def start(self, row: dict[str, Any]) -> tuple[list[dict[str, str]], list[Tool]]: ...

    def step(self, reply: str) -> list[dict[str, str]] | Done: ...


def env_class(name: str) -> type:
    """The class of environment ``name`` (registered, or ``module:Class`` imported now: call after the
    trust check). :class:`FieldError` (key ``env``) if it cannot be found."""
    module_name, _, attr = name.partition(":")
    return ENVIRONMENTS.load(name, None if name in ENVIRONMENTS or not (module_name and attr) else name)  # type: ignore[no-any-return]


def check_env(name: str, options: Fields) -> None:
    """The run.json parser's check (:func:`ckpteval.coord.run.manifest.install_checks`): a registered name whose
    constructor takes ``env_options``, or a ``module:Class`` form (not imported here: run.json's code is
    imported only after the trust check)."""
    if name in ENVIRONMENTS:
        try:
            inspect.signature(env_class(name)).bind(**options.obj)
        except TypeError as e:
            raise FieldError("env_options", f"does not fit environment {name!r}: {e}") from None
        return
    module_name, _, attr = name.partition(":")
    if not (module_name and attr.isidentifier()):
        env_class(name)  # raises the FieldError with the closest name

