"""Scorer ``code``: run the completion's program against the row's tests in the sandbox.

Guarantee (bwrap mode): nothing the solution can read or run lets it report a pass it did not earn (the tests
run in a separate process: :mod:`~ckpteval.jobs.eval.scorers.code.harness`; stdin/stdout outputs are compared
here). A sandbox that cannot run is a skip, never a 0. See docs/USER_GUIDE.md "Code (sandboxed execution)".
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.run.manifest import FieldError, Fields, parse_dataclass
from ckpteval.jobs.eval.sandbox.core import Limits, Outcome, SandboxUnavailable, probe_bwrap, shared_sandbox
from ckpteval.jobs.eval.scorers import BaseScorer, Sample, Scored, ScorerContext, ScorerInfraError

HARNESS_VERSION = "2"
FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
PYTHON_TAGS = ("python", "py", "python3")
MODEL_ERRORS = ("oom", "crashed")

HARNESS_SOURCE = (Path(__file__).with_name("harness.py")).read_text(encoding="utf-8")
JUDGE = "split-process"  # how assert-style samples are judged (the identity records it): code_harness.py
STDLIB = frozenset(sys.stdlib_module_names)
BUILTINS = frozenset(dir(builtins))


@dataclass(frozen=True)
class CodeOptions:
    """The ``code`` scorer's settings (a dataset's ``scorer_options``)."""

    timeout_s: float = 10.0
    """Wall-clock deadline of one program (one per case for stdin/stdout rows); also its CPU limit."""
    memory_mb: int = 1024
    """Address-space limit of each process of a program, MiB."""
    prepend_prompt: bool = False
    """Put the row's prompt text before the extracted code (HumanEval-style continuations)."""
    prepend_field: str | None = None
    """Put this field of the row before the extracted code: HumanEval's ``prompt`` (its imports and signature)
    in a chat form, where the text sent to the engine is the rendered chat, not the row's prompt."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise FieldError("timeout_s", f"must be a positive number of seconds, got {self.timeout_s}")
        if self.memory_mb < 64:
            raise FieldError("memory_mb", f"must be >= 64 (the interpreter needs it), got {self.memory_mb}")


def extract_code(completion: str) -> str:
    """The program in a completion (see the module docstring for the rule)."""
    blocks = FENCE_RE.findall(completion)
    python = [body for tag, body in blocks if tag.lower() in PYTHON_TAGS]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return completion


def row_tests(row: dict[str, Any], where: str) -> list[str] | tuple[list[str], list[str]]:
    """An assert-style row's tests (a list of sources), or a stdin/stdout row's ``(inputs, outputs)``."""
    if "tests" in row:
        tests, entry = row["tests"], row.get("entry_point")
        if isinstance(tests, str):
            if entry is not None and not (isinstance(entry, str) and entry.isidentifier()):
                raise ValueError(f"{where}: 'entry_point' must be a Python identifier, got {entry!r}")
            return [f"{tests}\ncheck({entry})\n" if entry and re.search(r"^def check\(", tests, re.M) else tests]
        if isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests):
            return list(tests)
        raise ValueError(f"{where}: 'tests' must be a string or a non-empty list of strings")
    inputs, outputs = row.get("inputs"), row.get("outputs")
    if (isinstance(inputs, list) and isinstance(outputs, list) and inputs and len(inputs) == len(outputs)
            and all(isinstance(x, str) for x in inputs + outputs)):
        return inputs, outputs
    raise ValueError(f"{where}: a code row needs 'tests' (asserts) or equal-length non-empty string lists "
                     "'inputs' and 'outputs'")


def same_output(got: bytes, want: str) -> bool:
    """stdout equals the expected output, line by line, surrounding whitespace and trailing blank lines aside."""
    return [line.strip() for line in got.decode(errors="replace").strip().splitlines()] == \
        [line.strip() for line in want.strip().splitlines()]


def harness_program(code: str) -> str:
    """The program the sandbox runs for an assert-style sample: the harness, then the solution as a literal."""
    return f"{HARNESS_SOURCE}\n_harness({code!r})\n"


def harness_stdin(tests: list[str], entry_point: str | None = None) -> bytes:
    """What the harness's test process reads after the solution process is forked: the tests, the names
    they call into the solution (free names that are neither builtins nor standard-library modules), and
    the standard-library modules they use without importing them; the ``entry_point`` is always the
    solution's, even when a module has its name."""
    free: set[str] = set()
    for test in tests:
        free |= free_names(test)
    modules = sorted(n for n in free if n in STDLIB and n != entry_point)
    proxies = sorted(n for n in free if n not in modules)
    return json.dumps({"tests": tests, "proxies": proxies, "modules": modules}).encode()


def free_names(source: str) -> set[str]:
    """Names a test reads but never binds, builtins aside (a test that does not parse has none: it fails)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    loads, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loads if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loads - bound - BUILTINS


@dataclass
class Report:
    """What an assert-style harness's test process reported (trusted: the solution cannot write it)."""

    passed: set[int]
    done: bool = False
    load_error: bool = False
    oom: bool = False
    solution_signal: int | None = None
    setup_error: str | None = None


def harness_report(stdout: bytes) -> Report:
    """Parse the test process's report lines (see :mod:`~ckpteval.jobs.eval.scorers.code.harness`)."""
    report = Report(set())
    for line in stdout.decode(errors="replace").splitlines():
        word, _, rest = line.partition(" ")
        if word == "pass" and rest.isdecimal():
            report.passed.add(int(rest))
        elif word == "solution" and rest.startswith("signal ") and rest[7:].isdecimal():
            report.solution_signal = int(rest[7:])
        elif word == "setup-error":
            report.setup_error = rest
        elif word in ("done", "load-error", "oom"):
            setattr(report, word.replace("-", "_"), True)
    return report


class CodeScorer(BaseScorer):
    """Runs each completion's program against its row's tests in :mod:`ckpteval.jobs.eval.sandbox.core` (module doc)."""

    needs_answer = False

    @classmethod
    def parse_options(cls, f: Fields) -> CodeOptions:
        return parse_dataclass(f, CodeOptions, what="scorer 'code'")

    @classmethod
    def check_row(cls, row: dict[str, Any], where: str) -> None:
        """When rows load: one of the two test formats, well formed (ValueError naming ``where``)."""
        row_tests(row, where)

    def __init__(self, spec: GenerateEntry, ctx: ScorerContext) -> None:
        super().__init__(spec, ctx)
        self.mode = "rlimits-only" if ctx.option("unsafe_code_rlimits_only", False) else "bwrap"
        if self.mode == "bwrap" and (why := _probe(probe_bwrap)) is not None:
            raise ValueError(f"dataset {spec.name!r} (scorer 'code'): {why}; this worker refuses code sets "
                             "(--unsafe-code-rlimits-only runs them with rlimits only, without isolation)")
        self.sandbox = shared_sandbox(self.mode, int(ctx.option("sandbox_concurrency", 0) or 0) or None)
        opts: CodeOptions = self.options
        self.limits = Limits(wall_s=opts.timeout_s, cpu_s=max(1, math.ceil(opts.timeout_s)),
                             memory_mb=opts.memory_mb)

    def no_answer(self, sample: Sample, scored: Scored) -> bool:
        """No program in the completion (the answer counted as ``no_answer``)."""
        return not extract_code(sample.completion).strip()

    def identity(self) -> dict[str, Any]:
        opts: CodeOptions = self.options
        return {"name": "code", "sandbox": self.mode, "timeout_s": opts.timeout_s, "memory_mb": opts.memory_mb,
                "prepend_prompt": opts.prepend_prompt, "harness": HARNESS_VERSION, "judge": JUDGE,
                **({"prepend_field": opts.prepend_field} if opts.prepend_field else {}),
                **self.sandbox.bounds(self.limits)}

    def score(self, samples: list[Sample]) -> list[Scored]:
        jobs: list[tuple[str, bytes]] = []
        plans = [self._plan(s, i, jobs) for i, s in enumerate(samples)]
        try:
            outcomes = self.sandbox.run_many(jobs, self.limits)
        except SandboxUnavailable as e:
            raise ScorerInfraError("sandbox_failed", f"the code sandbox could not run a program: {e}") from None
        return [verdict(outcomes[lo:hi], plan) for (lo, hi), plan in zip(_spans(plans), plans, strict=True)]

    def _plan(self, sample: Sample, index: int, jobs: list[tuple[str, bytes]]) -> Plan:
        code = extract_code(sample.completion)
        if self.options.prepend_prompt:
            code = sample.prompt + code
        if self.options.prepend_field:
            code = f"{sample.row.get(self.options.prepend_field) or ''}\n{code}"
        tests = row_tests(sample.row, f"dataset {self.spec.name!r} sample {index}")
        if isinstance(tests, tuple):
            jobs.extend((code, i.encode()) for i in tests[0])
            return Plan(len(tests[0]), outputs=tests[1])
        jobs.append((harness_program(code), harness_stdin(tests, sample.row.get("entry_point"))))
        return Plan(len(tests), asserts=True)


@dataclass(frozen=True)
class Plan:
    """What one sample's programs check: ``n_tests`` tests, by the harness (assert-style) or the outputs."""

    n_tests: int
    asserts: bool = False
    outputs: list[str] | None = None

    @property
    def n_programs(self) -> int:
        return 1 if self.asserts else self.n_tests


def _spans(plans: list[Plan]) -> list[tuple[int, int]]:
    spans, lo = [], 0
    for plan in plans:
        spans.append((lo, lo + plan.n_programs))
        lo += plan.n_programs
    return spans


def verdict(outcomes: list[Outcome], plan: Plan) -> Scored:
    """One sample's :class:`Scored` from its programs' outcomes."""
    timeouts = any(o.status == "timeout" for o in outcomes)
    errors = any(o.status in MODEL_ERRORS for o in outcomes)
    if plan.asserts:
        report = harness_report(outcomes[0].stdout)
        if report.setup_error is not None:
            raise ScorerInfraError("sandbox_failed", f"the code harness could not start: {report.setup_error}")
        n_passed = len(report.passed & set(range(plan.n_tests)))
        ok = report.done and n_passed == plan.n_tests and outcomes[0].status == "passed"
        xcpu = report.solution_signal == signal.SIGXCPU
        timeouts = timeouts or xcpu
        errors = errors or report.oom or (report.load_error and not xcpu) or \
            (report.solution_signal is not None and not xcpu)
    else:
        wants = plan.outputs or []
        verdicts = [o.status == "passed" and same_output(o.stdout, w) for o, w in zip(outcomes, wants, strict=True)]
        n_passed, ok = sum(verdicts), all(verdicts)
        errors = errors or any(o.status == "failed" for o in outcomes)
    case = None if plan.asserts else next((i for i, v in enumerate(verdicts) if not v), 0)
    note = None if ok else failure_note(outcomes[case or 0], case, n_passed, plan.n_tests, timeouts, errors)
    return Scored(float(ok), None, counters={"code_timeouts": int(timeouts), "code_errors": int(errors)},
                  extras={"tests_passed_fraction": n_passed / plan.n_tests}, note=note)


def failure_note(bad: Outcome, case: int | None, n_passed: int, n_tests: int, timeouts: bool, errors: bool) -> str:
    """Why a sample failed, in one line (the result's ``notes``): how many tests passed, the first failing
    stdin/stdout ``case`` (None: assert-style, one program), what ended that program and the last line its
    stderr printed (the program's own words: informative, never part of a verdict)."""
    why = "timeout" if timeouts else "error" if errors else "wrong answer"
    ended = bad.detail or (f"exit {bad.exit_code}" if bad.exit_code else "")
    if case is not None:
        ended = f"case {case}: {ended or 'wrong output'}"
    return "; ".join(p for p in (f"{why}: {n_passed}/{n_tests} tests passed", ended, _last_line(bad.stderr)) if p)


def _last_line(stderr: bytes) -> str:
    """The last non-blank line of a program's stderr, printable characters only."""
    lines = [ln.strip() for ln in stderr.decode("utf-8", errors="replace").splitlines() if ln.strip()]
    return "".join(c for c in lines[-1] if c.isprintable()) if lines else ""


_PROBED: dict[str, str | None] = {}


def _probe(probe: Any) -> str | None:
    """bwrap's start-up check, once per process."""
    if "bwrap" not in _PROBED:
        _PROBED["bwrap"] = probe()
    return _PROBED["bwrap"]
