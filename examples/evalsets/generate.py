"""Generate the example eval sets shipped in this directory (nothing is downloaded).

    python examples/evalsets/generate.py          # rewrites the .jsonl files next to this script

Deterministic (fixed seeds): running it again reproduces the committed files byte for byte
(``tests/test_examples.py`` checks that). Three formats, the ones RL / reasoning evals use:

* ``gsm8k_style.jsonl`` — GSM8K's format: ``{"prompt": question, "answer": "<reasoning>\\n#### <n>"}``;
  score it with ``scorer: "math"`` (the number after ``####``).
* ``latex_answers.jsonl`` — MATH-style exact answers in LaTeX (``\\frac{3}{4}``, ``2\\sqrt{3}``,
  ``9\\pi``, ``0.5`` vs ``\\frac{1}{2}``), for a LaTeX-aware grader such as math-verify
  (``scorer: "math"``).
* ``chat.jsonl`` — chat rows ``{"messages": [{"role", "content"}, ...], "answer"}`` for
  ``prompt_format: "chat"`` (rendered with the snapshot's own chat template).
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

HERE = Path(__file__).resolve().parent
N = 32
NAMES = ("Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana")


def gsm8k_style(rng: random.Random) -> list[dict[str, str]]:
    rows = []
    for i in range(N):
        name = rng.choice(NAMES)
        a, b, c = rng.randrange(10, 90), rng.randrange(2, 12), rng.randrange(1, 9)
        kind = i % 3
        if kind == 0:
            q = f"{name} has {a} marbles, buys {b} more, then gives {c} to a friend. How many marbles does {name} have now?"
            r = a + b - c
            why = f"After buying, {name} has {a} + {b} = {a + b} marbles. After giving {c} away: {a + b} - {c} = {r}."
        elif kind == 1:
            q = f"A crate holds {b} boxes and each box holds {a} pencils. How many pencils are in {c} crates?"
            r = a * b * c
            why = f"One crate holds {b} * {a} = {a * b} pencils, so {c} crates hold {a * b} * {c} = {r}."
        else:
            q = f"{name} earns ${a} per hour, works {b} hours, and spends ${c} on lunch. How many dollars are left?"
            r = a * b - c
            why = f"{name} earns {a} * {b} = {a * b} dollars and has {a * b} - {c} = {r} left."
        rows.append({"prompt": f"Question: {q}\nAnswer:", "answer": f"{why}\n#### {r}"})
    return rows


def _latex_fraction(f: Fraction) -> str:
    return str(f.numerator) if f.denominator == 1 else f"\\frac{{{f.numerator}}}{{{f.denominator}}}"


def latex_answers(rng: random.Random) -> list[dict[str, str]]:
    rows = []
    for i in range(N):
        kind = i % 4
        if kind == 0:
            p, q = rng.randrange(1, 12), rng.randrange(2, 13)
            k = rng.randrange(2, 5)
            prompt, answer = f"Write \\frac{{{p * k}}}{{{q * k}}} in lowest terms.", _latex_fraction(Fraction(p, q))
        elif kind == 1:
            n, m = rng.randrange(2, 7), rng.choice((2, 3, 5, 6, 7))
            prompt, answer = f"Simplify \\sqrt{{{n * n * m}}}.", f"{n}\\sqrt{{{m}}}"
        elif kind == 2:
            r = rng.randrange(2, 10)
            prompt, answer = f"What is the area of a circle of radius {r}? Leave the answer in terms of \\pi.", f"{r * r}\\pi"
        else:
            a, b = rng.randrange(1, 10), rng.choice((2, 4, 5, 8, 10))
            prompt, answer = f"Compute {a} \\div {b} as a fraction in lowest terms.", _latex_fraction(Fraction(a, b))
        rows.append({"prompt": f"Problem: {prompt}\nPut the final answer in \\boxed{{}}.\nSolution:", "answer": answer})
    return rows


def chat(rng: random.Random) -> list[dict[str, object]]:
    rows = []
    for i in range(N):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        op, value = (("+", a + b), ("-", a - b), ("*", a * b))[i % 3]
        messages: list[dict[str, str]] = [{"role": "user", "content": f"What is {a} {op} {b}? Reply with the number only."}]
        if i % 4 == 3:  # a few multi-turn rows: the template must carry the history
            messages = [
                {"role": "user", "content": "Let's do some arithmetic."},
                {"role": "assistant", "content": "Sure, ask away."},
                *messages,
            ]
        rows.append({"messages": messages, "answer": str(value)})
    return rows


def write(name: str, rows: list[dict[str, object]]) -> Path:
    path = HERE / name
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    return path


def main() -> None:
    for name, make, seed in (
        ("gsm8k_style.jsonl", gsm8k_style, 8),
        ("latex_answers.jsonl", latex_answers, 11),
        ("chat.jsonl", chat, 13),
    ):
        print(write(name, make(random.Random(seed))))


if __name__ == "__main__":
    main()
