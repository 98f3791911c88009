"""A small verifiers taskset for tests (id ``tests.support.vf_arith``; nothing downloaded): the arithmetic
rows of :func:`ckpteval.jobs.eval.kinds.env.examples.arithmetic_rows`, one turn (a ``@vf.stop`` after the first
reply), reward 1 when the reply's ``ANSWER: <n>`` is the value. A task whose expression is ``"raise"``
has a reward function that raises (a verifier's crash: infra). Imports verifiers (the optional extra)."""

from __future__ import annotations

import re

import verifiers.v1 as vf

from ckpteval.jobs.eval.kinds.env.examples import arithmetic_rows

ANSWER_RE = re.compile(r"ANSWER:\s*(-?\d+)")
ROWS = [*arithmetic_rows(3, seed=7), {"expression": "raise", "answer": 0}]


class ArithData(vf.TaskData):
    answer: int


class ArithTask(vf.Task[ArithData]):
    @vf.stop
    async def answered(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if "What is raise?" in str(self.data.prompt):
            raise RuntimeError("the verifier's backend is down")
        m = ANSWER_RE.search(trace.last_reply or "")
        return 1.0 if m is not None and int(m.group(1)) == self.data.answer else 0.0


class ArithTaskset(vf.Taskset[ArithTask, vf.TasksetConfig]):
    def load(self) -> list[ArithTask]:
        return [ArithTask(ArithData(idx=i, prompt=f"What is {r['expression']}? Reply ANSWER: <integer>.",
                                    answer=r["answer"]), self.config.task) for i, r in enumerate(ROWS)]


__all__ = ["ArithTaskset"]
