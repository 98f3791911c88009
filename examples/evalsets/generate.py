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
* ``code.jsonl`` — 20 small programming problems for ``scorer: "code"`` in both test formats: ten
  assert-style (``tests``: MBPP's list of asserts, or HumanEval's ``check(candidate)`` string with an
  ``entry_point``) and ten stdin/stdout (``inputs``/``outputs``, LiveCodeBench/APPS). Each row also
  carries a reference ``solution`` (HumanEval's ``canonical_solution``; the tests score it 1).
* ``code_tiny.jsonl`` — 16 stdin/stdout rows with prompts short enough for the demo model ("12+30=");
  it cannot write code, so all fail: for exercising the sandbox at the demo's scale (``bench_stall.py
  --eval-config examples/evalsets/code_tiny.eval.json``).
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


# (name, prompt, reference solution, tests): assert-style problems. A tests *string* defining check() is
# HumanEval's format (entry_point = the function name); a list is MBPP's.
ASSERT_PROBLEMS: tuple[tuple[str, str, str, str | list[str]], ...] = (
    ("add", "Write a function add(a, b) that returns the sum of a and b.",
     "def add(a, b):\n    return a + b\n",
     ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]),
    ("is_palindrome", "Write a function is_palindrome(s) that tells whether the string s reads the same backwards.",
     "def is_palindrome(s):\n    return s == s[::-1]\n",
     ["assert is_palindrome('racecar')", "assert not is_palindrome('abc')", "assert is_palindrome('')"]),
    ("fizzbuzz", "Write a function fizzbuzz(n) returning 'Fizz' for multiples of 3, 'Buzz' for multiples of 5, "
     "'FizzBuzz' for both, else str(n).",
     "def fizzbuzz(n):\n    if n % 15 == 0:\n        return 'FizzBuzz'\n    if n % 3 == 0:\n        return 'Fizz'\n"
     "    if n % 5 == 0:\n        return 'Buzz'\n    return str(n)\n",
     ["assert fizzbuzz(3) == 'Fizz'", "assert fizzbuzz(10) == 'Buzz'", "assert fizzbuzz(30) == 'FizzBuzz'",
      "assert fizzbuzz(7) == '7'"]),
    ("count_vowels", "Write a function count_vowels(s) that counts the vowels (aeiou, any case) in s.",
     "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
     ["assert count_vowels('hello') == 2", "assert count_vowels('xyz') == 0", "assert count_vowels('AEIOU') == 5"]),
    ("second_largest", "Write a function second_largest(xs) returning the second largest distinct value of xs.",
     "def second_largest(xs):\n    return sorted(set(xs))[-2]\n",
     ["assert second_largest([1, 2, 3]) == 2", "assert second_largest([5, 5, 4]) == 4",
      "assert second_largest([-1, -2]) == -2"]),
    ("gcd", "Complete the function.\n\ndef gcd(a: int, b: int) -> int:\n    \"\"\"The greatest common divisor of a and b.\"\"\"\n",
     "def gcd(a: int, b: int) -> int:\n    while b:\n        a, b = b, a % b\n    return abs(a)\n",
     "def check(candidate):\n    assert candidate(12, 18) == 6\n    assert candidate(7, 5) == 1\n    assert candidate(0, 9) == 9\n"),
    ("flatten", "Complete the function.\n\ndef flatten(xss: list) -> list:\n    \"\"\"Concatenate a list of lists.\"\"\"\n",
     "def flatten(xss: list) -> list:\n    return [x for xs in xss for x in xs]\n",
     "def check(candidate):\n    assert candidate([[1], [2, 3]]) == [1, 2, 3]\n    assert candidate([]) == []\n"),
    ("run_length", "Complete the function.\n\ndef run_length(s: str) -> str:\n    \"\"\"'aaab' -> 'a3b1'.\"\"\"\n",
     "def run_length(s: str) -> str:\n    out, i = [], 0\n    while i < len(s):\n        j = i\n"
     "        while j < len(s) and s[j] == s[i]:\n            j += 1\n        out.append(f'{s[i]}{j - i}')\n"
     "        i = j\n    return ''.join(out)\n",
     "def check(candidate):\n    assert candidate('aaab') == 'a3b1'\n    assert candidate('') == ''\n"
     "    assert candidate('abc') == 'a1b1c1'\n"),
    ("primes_below", "Write a function primes_below(n) that lists the primes smaller than n in increasing order.",
     "def primes_below(n):\n    return [p for p in range(2, n) if all(p % d for d in range(2, int(p ** 0.5) + 1))]\n",
     ["assert primes_below(10) == [2, 3, 5, 7]", "assert primes_below(2) == []", "assert primes_below(20)[-1] == 19"]),
    ("word_freq", "Write a function word_freq(text) returning a dict of how often each whitespace-separated word occurs.",
     "def word_freq(text):\n    out = {}\n    for w in text.split():\n        out[w] = out.get(w, 0) + 1\n    return out\n",
     ["assert word_freq('a b a') == {'a': 2, 'b': 1}", "assert word_freq('') == {}"]),
)

# (name, statement, reference solution, [(stdin, expected stdout), ...]): stdin/stdout problems.
STDIO_PROBLEMS: tuple[tuple[str, str, str, list[tuple[str, str]]], ...] = (
    ("sum_two", "Read two integers on one line and print their sum.",
     "a, b = map(int, input().split())\nprint(a + b)\n", [("1 2\n", "3\n"), ("-5 5\n", "0\n"), ("100 23\n", "123\n")]),
    ("reverse_line", "Read a line and print it reversed.",
     "print(input()[::-1])\n", [("abc\n", "cba\n"), ("racecar\n", "racecar\n")]),
    ("max_of_list", "The first line holds n, the second n integers. Print the largest.",
     "input()\nprint(max(map(int, input().split())))\n", [("3\n1 9 4\n", "9\n"), ("1\n-7\n", "-7\n")]),
    ("count_lines", "Print how many lines the input has.",
     "import sys\nprint(len(sys.stdin.read().splitlines()))\n", [("a\nb\nc\n", "3\n"), ("x\n", "1\n")]),
    ("factorial", "Read n (0 <= n <= 20) and print n!.",
     "import math\nprint(math.factorial(int(input())))\n", [("5\n", "120\n"), ("0\n", "1\n"), ("20\n", "2432902008176640000\n")]),
    ("even_odd", "Read an integer and print EVEN or ODD.",
     "print('EVEN' if int(input()) % 2 == 0 else 'ODD')\n", [("4\n", "EVEN\n"), ("7\n", "ODD\n"), ("-3\n", "ODD\n")]),
    ("sort_words", "Read a line of words and print them sorted, space-separated.",
     "print(' '.join(sorted(input().split())))\n", [("pear apple fig\n", "apple fig pear\n"), ("b a\n", "a b\n")]),
    ("triangle", "Read n and print a right triangle of n rows of '*' (row i has i stars).",
     "n = int(input())\nfor i in range(1, n + 1):\n    print('*' * i)\n", [("3\n", "*\n**\n***\n"), ("1\n", "*\n")]),
    ("digit_sum", "Read a non-negative integer and print the sum of its digits.",
     "print(sum(map(int, input().strip())))\n", [("1234\n", "10\n"), ("0\n", "0\n"), ("99999\n", "45\n")]),
    ("fib", "Read n (1 <= n <= 50) and print the first n Fibonacci numbers (1 1 2 ...) on one line.",
     "n = int(input())\na, b, out = 1, 1, []\nfor _ in range(n):\n    out.append(a)\n    a, b = b, a + b\nprint(*out)\n",
     [("5\n", "1 1 2 3 5\n"), ("1\n", "1\n")]),
)


def code() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for name, prompt, solution, tests in ASSERT_PROBLEMS:
        row: dict[str, object] = {"name": name, "prompt": f"{prompt}\nAnswer with a ```python block.\n",
                                  "solution": solution, "tests": tests}
        if isinstance(tests, str):
            row["entry_point"] = name
        rows.append(row)
    for name, prompt, solution, cases in STDIO_PROBLEMS:
        rows.append({"name": name, "prompt": f"{prompt}\nAnswer with a ```python block reading stdin.\n",
                     "solution": solution, "inputs": [i for i, _ in cases], "outputs": [o for _, o in cases]})
    return rows


def code_tiny(rng: random.Random) -> list[dict[str, object]]:
    """Short stdin/stdout rows whose prompts fit the demo model's 64-token context ("12+30=": print the sum
    of the two numbers on stdin). The adder cannot write code, so every sample fails: for exercising
    the sandbox path at the demo's scale (benchmarks, the guide), not for measuring a model."""
    rows: list[dict[str, object]] = []
    for _ in range(16):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        rows.append({"prompt": f"{a}+{b}=", "inputs": [f"{a} {b}\n"], "outputs": [f"{a + b}\n"],
                     "solution": "a, b = map(int, input().split())\nprint(a + b)\n"})
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
    print(write("code.jsonl", code()))
    print(write("code_tiny.jsonl", code_tiny(random.Random(17))))


if __name__ == "__main__":
    main()
