"""ckpteval's verifiers harness (id ``ckpteval.jobs.eval.kinds.env.verifiers_loop``): an in-process chat loop, for
:mod:`ckpteval.jobs.eval.kinds.env.verifiers_env`. Imports verifiers: loaded only by verifiers' harness resolver.

Promises: the task's prompt (its system prompt as a system message) is sent to the rollout's interception
``endpoint`` (``/chat/completions``, non-streaming, the rollout's secret as the bearer token); each
reply is appended; a reply with tool calls gets a ``tool`` message per call saying this harness runs no
tools, and the loop goes on; a reply without tool calls ends the program (exit 0). A refused turn ends
it: verifiers' stop (a ``@vf.stop`` condition, which verifiers then reports as the stop) or any other
error status (exit 1 with the server's message, which verifiers reports as a ``HarnessError``: infra).

Limits: no MCP tools, no streaming, no compaction (verifiers' own ``null`` harness does these, as a
program whose packages ``uv`` installs from the network at run time).
"""

from __future__ import annotations

from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult

NO_TOOLS = "error: no tools in this harness (ckpteval's verifiers loop is chat-only)"


class LoopConfig(vf.HarnessConfig):
    """No settings of its own."""


class LoopHarness(vf.Harness[LoopConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str, mcp_urls: dict[str, str],
                     data: Any, tool_interception_url: str | None = None) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        messages += [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [
            m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in prompt or []]
        async with httpx.AsyncClient(timeout=None) as client:
            while True:
                response = await client.post(f"{endpoint.rstrip('/')}/chat/completions",
                                             headers={"Authorization": f"Bearer {secret}"},
                                             json={"model": ctx.model, "messages": messages})
                if response.status_code != 200:
                    return ProgramResult(1, "", f"HTTP {response.status_code}: {response.text[:1000]}")
                message = response.json()["choices"][0]["message"]
                messages.append({k: v for k, v in message.items() if v is not None})
                calls = message.get("tool_calls") or []
                if not calls:
                    return ProgramResult(0, "", "")
                messages += [{"role": "tool", "tool_call_id": c.get("id"), "content": NO_TOOLS} for c in calls]


__all__ = ["LoopHarness"]
