"""Two example environments (registered as ``arithmetic`` and ``guess``) and the generators of their rows.

``arithmetic``: rows ``{"expression": "37 * 41 + 5", "answer": 1522}``. The model is asked the value and
may call the ``calculator`` tool (run in the sandbox; a bad expression is returned to the model as
``error: ...``, it is not the tool's crash). A reply ``ANSWER: <integer>`` ends the episode: reward 1 when
it is the value, else 0. Any other reply without a tool call gets a reminder of the format.

``guess``: rows ``{"target": 37, "low": 1, "high": 100}``. The model guesses with ``GUESS: <integer>``
and is told ``higher`` or ``lower``; the verifier ends the episode with reward 1 when it names the
target. With ``efficiency: true`` (``env_options``) the reward is ``1 / guesses`` instead.

Both are deterministic; :func:`arithmetic_rows` and :func:`guess_rows` generate their example sets
(``examples/envs/generate.py``).
"""

from __future__ import annotations

import random
import re
from typing import Any

from ckpteval.jobs.eval.kinds.env import Done, Tool

ANSWER_RE = re.compile(r"ANSWER:\s*(-?\d+)")
GUESS_RE = re.compile(r"GUESS:\s*(-?\d+)")

CALCULATOR = Tool(
    name="calculator",
    description="Evaluate an arithmetic expression of integers with + - * / // % ** and parentheses.",
    parameters={"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    source='''
import ast, operator
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg}

def _value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        if isinstance(node.op, ast.Pow) and abs(_value(node.right)) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    raise ValueError("only integers, + - * / // % ** and parentheses")

def calculator(expression):
    try:
        return str(_value(ast.parse(str(expression), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return "error: " + str(e)
''',
)


class ArithmeticEnv:
    """Multi-turn arithmetic with a calculator tool (see the module docstring)."""

    def __init__(self) -> None:
        self.answer = ""

    @classmethod
    def check_row(cls, row: dict[str, Any], where: str) -> None:
        if not isinstance(row.get("expression"), str) or not isinstance(row.get("answer"), int):
            raise ValueError(f"{where}: an arithmetic row needs a string 'expression' and an integer 'answer'")

    def start(self, row: dict[str, Any]) -> tuple[list[dict[str, str]], list[Tool]]:
        self.answer = str(row["answer"])
        ask = (f"What is {row['expression']}? You may use the calculator tool. "
               "When you know it, reply ANSWER: <integer>.")
        return [{"role": "user", "content": ask}], [CALCULATOR]

    def step(self, reply: str) -> list[dict[str, str]] | Done:
        m = ANSWER_RE.search(reply)
        if m is None:
            return [{"role": "user", "content": "Reply ANSWER: <integer>, or call the calculator."}]
        return Done(1.0 if m.group(1) == self.answer else 0.0, m.group(1))


class GuessEnv:
    """Guess-the-number with higher/lower feedback and a final verifier (see the module docstring)."""

    def __init__(self, efficiency: bool = False) -> None:
        self.efficiency, self.target, self.guesses = efficiency, 0, 0

    @classmethod
    def check_row(cls, row: dict[str, Any], where: str) -> None:
        if not all(isinstance(row.get(k), int) for k in ("target", "low", "high")) or \
                not row["low"] <= row["target"] <= row["high"]:
            raise ValueError(f"{where}: a guess row needs integers low <= target <= high")
        if not isinstance(row.get("ask", ""), str):
            raise ValueError(f"{where}: a guess row's 'ask' (the opening message, optional) must be a string")

    def start(self, row: dict[str, Any]) -> tuple[list[dict[str, str]], list[Tool]]:
        self.target = int(row["target"])
        ask = row.get("ask") or (f"I picked an integer from {row['low']} to {row['high']}. Guess it: reply GUESS: "
                                 "<integer>. I will say higher or lower.")
        return [{"role": "user", "content": ask}], []

    def step(self, reply: str) -> list[dict[str, str]] | Done:
        m = GUESS_RE.search(reply)
        if m is None:
            return [{"role": "user", "content": "Reply GUESS: <integer>."}]
        self.guesses += 1
        guess = int(m.group(1))
        if guess == self.target:
            return Done(1.0 / self.guesses if self.efficiency else 1.0, str(guess))
        return [{"role": "user", "content": "higher" if guess < self.target else "lower"}]


def arithmetic_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` arithmetic rows ``a * b + c`` / ``a * (b - c)`` (deterministic in ``seed``)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, c = rng.randrange(12, 99), rng.randrange(12, 99), rng.randrange(2, 50)
        expression = f"{a} * {b} + {c}" if i % 2 == 0 else f"{a} * ({b} - {c})"
        rows.append({"expression": expression, "answer": a * b + c if i % 2 == 0 else a * (b - c)})
    return rows


def guess_rows(n: int, seed: int, high: int = 100) -> list[dict[str, Any]]:
    """``n`` guess-the-number rows from 1 to ``high`` (deterministic in ``seed``)."""
    rng = random.Random(seed)
    return [{"target": rng.randint(1, high), "low": 1, "high": high} for _ in range(n)]
