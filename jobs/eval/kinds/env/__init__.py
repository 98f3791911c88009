"""The environment registry (:data:`ENVIRONMENTS`) and contract: multi-turn, tool-using episodes as an eval set.

An ``env`` entry (:class:`ckpteval.coord.entries.env.EnvEntry`) names an environment: a name of :data:`ENVIRONMENTS`, or
``module:Class`` (imported only under the run-code trust rule, :mod:`ckpteval.jobs.eval.proof.trust`). The contract
(``start``/``step``, or ``DRIVES_MODEL`` and ``play``), tool calls and how an episode ends and who is to blame:
docs/USER_GUIDE.md "Environments"; the episode loop is :mod:`ckpteval.jobs.eval.kinds.env.runner`'s. Adding one: an
import-light class and one line in :data:`ENVIRONMENTS`; :func:`check_env` is the run.json parser's check.

Limits: an environment object runs in the worker's process (trusted code, as a scorer is); only tools run
sandboxed; episodes of a unit run in lockstep, so a unit takes as long as its longest episode.
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

__all__ = ["ENVIRONMENTS", "Environment", "Tool", "Done", "ENDINGS_INFRA", "env_class", "check_env"]
