"""The ``verifiers`` environment (registered as ``verifiers``): a prime-rl ``verifiers`` taskset's
episodes on the pinned engine, as an ``env`` entry. Optional extra: ``pip install 'ckpteval[envs]'``
(verifiers 0.4: the ``verifiers.v1`` stack).

``env_options``: ``taskset`` (a verifiers taskset id: an importable module exporting its ``vf.Taskset``
subclass in ``__all__``, as verifiers resolves it; a dotted module path is aliased, :func:`plugin_id`), ``taskset_options`` (its ``TasksetConfig`` fields),
``harness`` (a verifiers harness id; default :data:`LOOP_HARNESS`, the in-process chat loop of
:mod:`ckpteval.jobs.eval.kinds.env.verifiers_loop`), ``timeout_s`` (one episode's deadline, verifiers'
``timeout.episode``). Rows: ``{"task": i}``, the index of a task of the taskset (``n_samples`` episodes each).

Each episode runs through verifiers' own machinery — ``SingleAgentEnv.run_episode`` (its interception
server, its task's stop conditions and rewards, a ``subprocess`` runtime) — with the model client's
``base_url`` the episode's address on the pinned engine's endpoint (:mod:`ckpteval.jobs.eval.kinds.env.endpoint`), so
every turn is generated, stamped and recorded there; ``max_turns`` is the agent's ``max_turns``.

Attribution: an episode verifiers ends ``ok`` is the model's — ``done`` with the trace's reward (the sum
of its weighted rewards), or ``out_of_turns`` (reward 0) when it stopped on ``max_turns``; one with
errors (a task, toolset, sandbox, harness, interception or provider failure, or its deadline) is infra —
``tool_error`` (``ToolsetError``), ``sandbox_failed`` (``SandboxError``), else ``env_error`` — with
verifiers' error as the cause: never scored, re-run within ``infra_retries``. A turn the endpoint refused
(another version) fails its episode and, whatever verifiers made of it, the unit's pin check.

Limits: the default harness is chat-only (a reply with tool calls gets each call answered ``error: no
tools in this harness``; a taskset's MCP toolsets need verifiers' own harnesses, which bootstrap ``uv``
and their programs' packages from the network at run time, so they cannot run offline); the runtime is
``subprocess`` (verifiers' working dirs under ``~/.cache/verifiers``); episodes of a unit run
concurrently but the endpoint generates one turn at a time.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import sys
from typing import Any

from ckpteval.coord.entries.env import EnvEntry

LOOP_HARNESS = "ckpteval.jobs.eval.kinds.env.verifiers_loop"
INSTALL = "pip install 'ckpteval[envs]'"
INFRA_ENDINGS = {"ToolsetError": "tool_error", "SandboxError": "sandbox_failed"}


def check_installed() -> None:
    if importlib.util.find_spec("verifiers") is None or importlib.util.find_spec("verifiers.v1") is None:
        raise ValueError(f"environment 'verifiers' needs verifiers 0.4 (the optional extra: {INSTALL})")


def plugin_id(module: str) -> str:
    """A verifiers plugin id for ``module``: verifiers resolves ids as top-level modules (its loader's
    ``find_spec`` of ``verifiers.v1.<group>.<id>`` fails on a dotted id), so a dotted module is imported
    here and aliased top-level as ``ckpteval_vf_<module with _ for .>``."""
    if "." not in module:
        return module
    alias = "ckpteval_vf_" + module.replace(".", "_").lower()
    sys.modules.setdefault(alias, importlib.import_module(module))
    return alias


def taskset_prompts(taskset: str, options: dict[str, Any] | None = None) -> list[Any]:
    """Every task's prompt of a verifiers taskset, in task order (what a row ``{"task": i}`` asks; the
    contamination gate's text of such rows and of a prime-rl run's environments)."""
    check_installed()
    import verifiers.v1 as vf

    config = vf.TasksetConfig.model_validate({**(options or {}), "id": plugin_id(taskset)})
    return [task.data.prompt for task in vf.load_taskset(config)]


class VerifiersEnv:
    """A verifiers taskset as an environment that drives the model itself (see the module docstring)."""

    DRIVES_MODEL = True

    def __init__(self, taskset: str, taskset_options: dict[str, Any] | None = None, harness: str = LOOP_HARNESS,
                 timeout_s: float = 600.0) -> None:
        if not (isinstance(taskset, str) and taskset):
            raise ValueError("env_options.taskset must name a verifiers taskset (an importable module)")
        self.taskset, self.taskset_options = taskset, dict(taskset_options or {})
        self.harness, self.timeout_s = harness, float(timeout_s)

    @classmethod
    def check_row(cls, row: dict[str, Any], where: str) -> None:
        check_installed()
        if not (isinstance(row.get("task"), int) and row["task"] >= 0):
            raise ValueError(f"{where}: a verifiers row needs 'task', the index (>= 0) of a task of the taskset")

    def play(self, episodes: list[Any], endpoint: Any, spec: EnvEntry) -> None:
        """Every episode through verifiers, concurrently; each ended with its attribution."""
        asyncio.run(self._play(episodes, endpoint, spec))

    def _env(self, spec: EnvEntry) -> Any:
        import verifiers.v1 as vf
        from verifiers.v1.utils.loaders import environment_class

        taskset = plugin_id(self.taskset)
        config = vf.SingleAgentEnvConfig.model_validate({
            "taskset": {**self.taskset_options, "id": taskset},
            "timeout": {"episode": self.timeout_s},
            "agent": {"harness": {"id": plugin_id(self.harness)}, "runtime": {"type": "subprocess"},
                      "max_turns": spec.max_turns},
        })
        return environment_class(taskset)(config)

    async def _play(self, episodes: list[Any], endpoint: Any, spec: EnvEntry) -> None:
        import verifiers.v1 as vf

        env = self._env(spec)
        tasks = list(env.taskset)
        for ep in episodes:
            if ep.row["task"] >= len(tasks):
                raise ValueError(f"row {ep.index}: task {ep.row['task']} out of range (the taskset has {len(tasks)})")

        async def one(ep: Any) -> None:
            client = vf.EvalClientConfig(base_url=endpoint.base_url(ep.index, ep.sample), api_key_var="CKPTEVAL_UNUSED_KEY")
            episode = await env.run_episode(tasks[ep.row["task"]], vf.ModelContext(model=str(endpoint.want), client=client))
            attribute(ep, episode)

        async with env.serving():
            await asyncio.gather(*(one(ep) for ep in episodes))


def attribute(ep: Any, episode: Any) -> None:
    """End ``ep`` as verifiers' ``episode`` ended (see the module docstring)."""
    trace = episode.traces[0] if episode.traces else None
    errors = [*episode.errors, *(trace.errors if trace is not None else [])]
    if not episode.ok or errors or trace is None:
        first = errors[0] if errors else None
        why = f"{first.type}: {first.message}" if first is not None else "verifiers ended the episode not ok, without an error"
        ep.end(INFRA_ENDINGS.get(first.type if first is not None else "", "env_error"), why.strip().splitlines()[0][:500])
    elif trace.stop_condition == "max_turns":
        ep.end("out_of_turns", f"verifiers stopped it on max_turns ({trace.num_turns} turns)")
    else:
        ep.end("done", f"stop: {trace.stop_condition}" if trace.stop_condition else "", reward=float(trace.reward),
               answer=trace.last_reply)
