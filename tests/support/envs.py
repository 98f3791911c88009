"""Environments for tests (imported by workers as ``tests.support.envs:<Class>``): the registered
arithmetic task with a tool that crashes for the first ``FLAKY_STARTS`` episodes a process starts, or
one that hangs forever, and an environment whose ``step`` raises."""

from __future__ import annotations

import os
from typing import Any

from ckpteval.jobs.eval.kinds.env import Done, Tool
from ckpteval.jobs.eval.kinds.env.examples import CALCULATOR, ArithmeticEnv

CRASHING = Tool(CALCULATOR.name, CALCULATOR.description, CALCULATOR.parameters,
                "import sys\ndef calculator(expression):\n    print('calculator backend is down', file=sys.stderr)\n"
                "    sys.exit(98)\n")  # TOOL_UNAVAILABLE: the tool says its backend is down
HANGING = Tool(CALCULATOR.name, CALCULATOR.description, CALCULATOR.parameters,
               "import time\ndef calculator(expression):\n    time.sleep(3600)\n")


class FlakyToolEnv(ArithmeticEnv):
    """The arithmetic task whose calculator crashes in the first ``flaky_starts`` episodes this process
    starts (a tool outage), then works."""

    starts = 0

    def __init__(self, flaky_starts: int = 1) -> None:
        super().__init__()
        self.flaky_starts = flaky_starts

    def start(self, row: dict[str, Any]) -> tuple[list[dict[str, str]], list[Tool]]:
        messages, _ = super().start(row)
        type(self).starts += 1
        return messages, [CRASHING if type(self).starts <= self.flaky_starts else CALCULATOR]


class HangingToolEnv(ArithmeticEnv):
    """The arithmetic task whose calculator never returns."""

    def start(self, row: dict[str, Any]) -> tuple[list[dict[str, str]], list[Tool]]:
        messages, _ = super().start(row)
        return messages, [HANGING]


class BrokenStepEnv(ArithmeticEnv):
    """The arithmetic task whose verifier raises."""

    def step(self, reply: str) -> list[dict[str, str]] | Done:
        raise ConnectionError(f"verifier service unreachable (pid {os.getpid()})")
