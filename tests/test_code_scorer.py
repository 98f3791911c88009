"""Scorer ``code`` (jobs/eval/scorers/code/scorer.py) through a real worker: canned completions, known scores.

Real processes throughout: ``ckpteval worker --engine http:URL`` against
:class:`tests.support.canned_engine.CannedEngine` (a real HTTP server replaying canned completions, so
expected scores are known), real snapshots, programs run by the real sandbox (bwrap). The adversarial
sweep sends hostile completions (fork bomb, infinite loop, memory bomb, a 10 GB write, 100 MB of
stdout, a network connect, reading and writing the run dir and results/, killing the parent, setsid
escapes, deleting files) and checks, for each: the worker survives, the unit's result is what it must
be, nothing in the run dir changes, no sandboxed process is left behind. Tests that need bwrap are
skipped, with the probe's reason, where it cannot start.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.results.points import dataset_score, derive_point, point_metrics
from ckpteval.coord.run.identity import run_key
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.kinds.generate.evalsets import write_jsonl
from ckpteval.jobs.eval.sandbox import core as sandbox_module
from ckpteval.jobs.eval.sandbox.core import Limits, Sandbox, probe_bwrap
from ckpteval.jobs.eval.scorers import Sample, ScorerContext, ScorerInfraError, make_scorer
from ckpteval.jobs.eval.scorers.code import harness as code_harness
from ckpteval.jobs.eval.scorers.code.scorer import (
    extract_code,
    harness_program,
    harness_stdin,
    row_tests,
    same_output,
)
from ckpteval.jobs.eval.worker.evalconfig import read_eval_config
from tests.support.canned_engine import CannedEngine
from tests.support.runs import write_tiny_shards
from tests.support.sandbox import survivors
from tests.support.workers import PYTHON, REPO, finish, publish_as_trainer, results, worker_env

WHY_NOT = probe_bwrap()
needs_bwrap = pytest.mark.skipif(WHY_NOT is not None, reason=f"bwrap cannot start here: {WHY_NOT}")
EXAMPLE = [json.loads(line) for line in (REPO / "examples/evalsets/code.jsonl").read_text().splitlines()]
FAST = {"timeout_s": 2.0, "memory_mb": 256}


# -- pure parts ------------------------------------------------------------------------------------------
def test_code_is_the_last_python_block_else_any_block_else_the_whole_text() -> None:
    two = "Try:\n```python\nx = 1\n```\nBetter:\n```py\nx = 2\n```\n"
    assert extract_code(two) == "x = 2\n"
    assert extract_code("```python\na = 1\n```\n```text\nout\n```") == "a = 1\n"
    assert extract_code("see\n```\nb = 2\n```") == "b = 2\n"
    assert extract_code("print(3)") == "print(3)"


def test_row_formats_and_their_errors() -> None:
    assert row_tests({"tests": ["assert f()"]}, "r") == ["assert f()"]
    humaneval = row_tests({"tests": "def check(candidate):\n    assert candidate()\n", "entry_point": "f"}, "r")
    assert humaneval == ["def check(candidate):\n    assert candidate()\n\ncheck(f)\n"]
    assert row_tests({"inputs": ["1"], "outputs": ["2"]}, "r") == (["1"], ["2"])
    for bad in ({"tests": []}, {"inputs": ["1"], "outputs": []}, {"prompt": "x"}, {"tests": "x", "entry_point": "a b"}):
        with pytest.raises(ValueError, match="^data.jsonl:3: "):
            row_tests(bad, "data.jsonl:3")


def test_a_malformed_code_row_is_refused_when_the_eval_config_is_read(tmp_path: Path) -> None:
    (tmp_path / "code.jsonl").write_text(json.dumps(EXAMPLE[0]) + "\n" + json.dumps({"prompt": "p", "inputs": ["1"]}) + "\n")
    (tmp_path / "eval.json").write_text(json.dumps({"eval": {"datasets": [
        {"name": "code", "path": "code.jsonl", "n_prompts": 2, "scorer": "code", "scorer_options": {"timeout_s": 3}}]}}))
    with pytest.raises(ValueError, match=r"code.jsonl:2: a code row needs 'tests'"):
        read_eval_config(tmp_path / "eval.json")
    (tmp_path / "eval.json").write_text(json.dumps({"eval": {"datasets": [
        {"name": "code", "path": "code.jsonl", "n_prompts": 2, "scorer": "code", "scorer_options": {"timeout": 3}}]}}))
    with pytest.raises(ValueError, match="timeout_s"):  # an unknown option is refused naming the closest
        read_eval_config(tmp_path / "eval.json")


def test_outputs_compare_line_by_line_ignoring_surrounding_whitespace() -> None:
    assert same_output(b"1 2 \n3\n\n", "1 2\n3")
    assert not same_output(b"1 2\n", "1 2\n3\n")


# -- in process: the scorer on the example set ----------------------------------------------------------
def spec(rows: list[dict[str, Any]], options: dict[str, Any] | None = None, **kw: Any) -> GenerateEntry:
    return GenerateEntry(name="code", path="data/code.jsonl", n_prompts=len(rows), scorer="code",
                       scorer_options=dict(options or FAST), **kw)


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}```\nIt reads the input as specified."


def wrong(row: dict[str, Any]) -> str:
    return fenced("pass\n") if "tests" in row else fenced("print('wrong')\n")


@needs_bwrap
def test_reference_solutions_score_1_and_wrong_ones_0(tmp_path: Path) -> None:
    scorer = make_scorer(spec(EXAMPLE), ScorerContext(tmp_path, {"sandbox_concurrency": 2}))
    samples = [Sample(fenced(r["solution"]), r, r["prompt"]) for r in EXAMPLE]
    samples += [Sample(wrong(r), r, r["prompt"]) for r in EXAMPLE]
    add = EXAMPLE[0]  # add(a, b): a - b passes one of its three asserts
    samples.append(Sample(fenced("def add(a, b):\n    return a - b\n"), add, add["prompt"]))
    scored = scorer.score(samples)
    assert [s.score for s in scored] == [1.0] * 20 + [0.0] * 21
    assert [s.extras["tests_passed_fraction"] for s in scored] == [1.0] * 20 + [0.0] * 20 + [1 / 3]
    assert all(s.counters == {"code_timeouts": 0, "code_errors": 0} for s in scored[:20])
    assert scorer.identity()["sandbox"] == "bwrap"


@needs_bwrap
def test_timeouts_and_errors_are_counted_and_printing_a_fake_pass_does_not_count(tmp_path: Path) -> None:
    row = EXAMPLE[0]
    scorer = make_scorer(spec([row], {"timeout_s": 1.0, "memory_mb": 128}), ScorerContext(tmp_path, {}))
    completions = ["while True: pass", "x = bytearray(10**10)", "def add(a, b) return",
                   "import sys\nprint('pass 0\\npass 1\\npass 2\\ndone')\nsys.exit(0)"]
    scored = scorer.score([Sample(c, row, "") for c in completions])
    assert [s.score for s in scored] == [0.0] * 4
    assert [s.counters for s in scored] == [{"code_timeouts": 1, "code_errors": 0}, {"code_timeouts": 0, "code_errors": 1},
                                            {"code_timeouts": 0, "code_errors": 1}, {"code_timeouts": 0, "code_errors": 1}]


@pytest.mark.parametrize("mode", ["bwrap", "rlimits-only"])
def test_an_exit_or_signal_the_program_chooses_scores_0_never_a_skip(tmp_path: Path, mode: str) -> None:
    """Real-time signals (35-64) and bwrap's 128 + n exit statuses name no signal.Signals member: each is
    the program's failure (0, an error), never an exception that ends the unit as a skip (#37)."""
    if mode == "bwrap" and WHY_NOT is not None:
        pytest.skip(f"bwrap cannot start here: {WHY_NOT}")
    stdin_row, assert_row = EXAMPLE[10], EXAMPLE[0]
    assert "inputs" in stdin_row and "tests" in assert_row
    ctx = ScorerContext(tmp_path, {"unsafe_code_rlimits_only": mode == "rlimits-only"})
    scorer = make_scorer(spec([stdin_row, assert_row], FAST), ctx)
    chosen = ["import os\nos._exit(163)\n", "import os\nos.kill(os.getpid(), 50)\n"]
    samples = [Sample(fenced(c), stdin_row, "") for c in chosen]
    samples += [Sample(fenced(f"import os\nos.kill(os.getppid(), {sig})\n"), assert_row, "") for sig in (35, 63)]
    scored = scorer.score(samples)
    assert [(s.score, s.counters["code_errors"]) for s in scored] == [(0.0, 1)] * 4, [s.note for s in scored]


@needs_bwrap
def test_prepend_prompt_scores_humaneval_style_continuations(tmp_path: Path) -> None:
    row = {"prompt": "def gcd(a, b):\n", "tests": "def check(candidate):\n    assert candidate(12, 18) == 6\n",
           "entry_point": "gcd"}
    body = "    while b:\n        a, b = b, a % b\n    return a\n"
    with_prompt = make_scorer(spec([row], {**FAST, "prepend_prompt": True}), ScorerContext(tmp_path, {}))
    without = make_scorer(spec([row]), ScorerContext(tmp_path, {}))
    assert [s.score for s in with_prompt.score([Sample(body, row, row["prompt"])])] == [1.0]
    assert [s.score for s in without.score([Sample(body, row, row["prompt"])])] == [0.0]  # a bare body does not load
    assert with_prompt.identity() != without.identity()


def bwrap_failing_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, good_calls: int) -> Path:
    """A real ``bwrap`` wrapper on PATH: the first ``good_calls`` calls run the real bwrap, later ones fail as
    bwrap does when it cannot create namespaces."""
    real = subprocess.run(["sh", "-c", "command -v bwrap"], capture_output=True, text=True, check=True).stdout.strip()
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    count = tmp_path / "bwrap-calls"
    count.write_text("0")
    script = bindir / "bwrap"
    script.write_text(f"#!/bin/sh\nn=$(cat {count}); echo $((n + 1)) > {count}\n"
                      f"if [ $n -ge {good_calls} ]; then echo 'bwrap: setting up uid map: Permission denied' >&2; exit 1; fi\n"
                      f"exec {real} \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return count


@needs_bwrap
def test_a_sandbox_that_stops_starting_is_an_infra_failure_never_a_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # this process's shared pools may already hold warm runners (started before bwrap broke): the scorer gets new ones
    monkeypatch.setattr(sandbox_module, "_SHARED", {})
    row = EXAMPLE[0]
    scorer = make_scorer(spec([row]), ScorerContext(tmp_path, {}))
    bwrap_failing_after(tmp_path, monkeypatch, good_calls=0)
    try:
        with pytest.raises(ScorerInfraError) as info:
            scorer.score([Sample(fenced(row["solution"]), row, "")])
    finally:
        for box in sandbox_module._SHARED.values():
            box.close()
    assert info.value.reason == "sandbox_failed" and "uid map" in str(info.value)


# -- through a real worker ------------------------------------------------------------------------------
def code_run(tmp: Path, rows: list[dict[str, Any]], **kw: Any) -> RunDir:
    run = RunDir.create(tmp / "run")
    write_jsonl(run.data / "code.jsonl", rows)
    manifest = RunManifest(run_id="test-code", eval=EvalSpec(entries=(spec(rows, **kw),)),
                           snapshot_roots=(str(run.snapshots),), lease=LeaseSettings(30.0, 5.0))
    run = RunDir.create(run.path, manifest)
    publish_as_trainer(run.snapshots, 1, lambda d: write_tiny_shards(d))
    return run


def run_worker(run: RunDir, url: str, cwd: Path, *flags: str, env: dict[str, str] | None = None,
               timeout: float = 240) -> tuple[int, str, int]:
    cwd.mkdir(exist_ok=True)
    proc = subprocess.Popen([PYTHON, "-m", "ckpteval.jobs.cli", "worker", "--run-dir", str(run.path), "--once",
                             "--engine", f"http:{url}", "--poll-interval", "0.05", *flags],
                            cwd=cwd, env={**worker_env(), **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    code, out = finish(proc, timeout)
    return code, out, proc.pid


@needs_bwrap
def test_worker_scores_canned_completions_with_pass_at_k(tmp_path: Path) -> None:
    rows = EXAMPLE[:4] + EXAMPLE[10:14]  # two of each assert kind and four stdin/stdout problems
    run = code_run(tmp_path, rows, shard_size=4, n_samples=2, temperature=0.7, pass_k=(1, 2), max_new_tokens=64)
    # sample 0 right for every row; sample 1 right for odd rows only
    canned = {r["prompt"]: [fenced(r["solution"]), fenced(r["solution"]) if i % 2 else wrong(r)]
              for i, r in enumerate(rows)}
    with CannedEngine(canned) as url:
        code, out, pid = run_worker(run, url, tmp_path / "cwd", "--sandbox-concurrency", "2")
    assert code == 0, out
    got = results(run)
    assert sorted(got) == [WorkUnit(1, "code", 0), WorkUnit(1, "code", 1)]
    scores = [s for shard in (0, 1) for s in got[WorkUnit(1, "code", shard)].scores]
    assert scores == [1.0, 0.0, 1.0, 1.0] * 4
    for shard in (0, 1):
        r = got[WorkUnit(1, "code", shard)]
        assert r.counters == {"code_timeouts": 0, "code_errors": 0}
        assert r.extras["tests_passed_fraction"] == {"sum": 6.0, "n": 8}
        assert r.scorer["sandbox"] == "bwrap" and r.scorer["name"] == "code"
        # each bound is recorded with the result (#26 §2): how total memory is bounded here, the /tmp caps
        assert r.scorer["memory_total_by"] in ("cgroup-v1", "cgroup-v2", "rlimit_as x nproc"), r.scorer
        assert r.scorer["memory_total_mb"] > 0 and r.scorer["tmp_mb"] > 0 and r.scorer["tmp_inodes"] > 0, r.scorer
    (ds,) = run.manifest().eval.entries
    point = dataset_score(ds, run_key(run.manifest()), 1, [got[WorkUnit(1, "code", i)] for i in (0, 1)])
    assert (point.score, point.derived["pass@1"], point.derived["pass@2"]) == (0.75, 0.75, 1.0)
    assert point.extras["tests_passed_fraction"] == 0.75 and point.counters["code_errors"] == 0
    assert (point.extras["truncated"], point.extras["no_answer"]) == (0.0, 0.0)  # every canned one stopped, with a program
    assert survivors(f"ckpteval-{pid}") == []


def hostile_programs(run_path: Path, workdir: Path, listen_port: int) -> dict[str, tuple[str, dict[str, int]]]:
    """name -> (completion, expected counters). Every program prints "pwned" only if its attack worked (the
    writers check for the run's snapshots/ dir, which no program creates: inside the sandbox the run's
    path, under the test's /tmp, lands in the program's own private /tmp)."""
    r, res, wd = str(run_path), str(run_path / "results"), str(workdir)
    seen = f"import os\nprint('pwned' if os.path.isdir({str(run_path / 'snapshots')!r}) else 'contained')"
    timeout, error, neither = {"code_timeouts": 1, "code_errors": 0}, {"code_timeouts": 0, "code_errors": 1}, \
        {"code_timeouts": 0, "code_errors": 0}
    return {
        "fork_bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", timeout),
        "infinite_loop": ("while True:\n    pass\n", timeout),
        "memory_bomb": ("x = bytearray(1 << 34)\nprint('pwned')\n", error),
        "write_10gb": ("with open('big', 'wb') as f:\n    for _ in range(10240):\n        f.write(b'x' * (1 << 20))\n"
                       "print('pwned')\n", error),
        "stdout_100mb": ("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\nprint('pwned')\n", error),
        "network": (f"import socket\nsocket.create_connection(('127.0.0.1', {listen_port}), timeout=1)\nprint('pwned')\n",
                    error),
        "read_run_dir": (f"print(open({r + '/run.json'!r}).read())\nprint('pwned')\n", error),
        "write_results": (f"import os\nfor path in ({res + '/pwned.json'!r}, {r + '/run.json'!r}):\n"
                          "    try:\n        os.makedirs(os.path.dirname(path), exist_ok=True)\n"
                          "        open(path, 'a').write('pwned')\n    except OSError:\n        pass\n"
                          f"{seen}\n", neither),
        "kill_parent": ("import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept OSError:\n    pass\n"
                        "os.killpg(0, signal.SIGKILL)\nprint('pwned')\n", error),  # killpg: its own group only
        "setsid_escape": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                          "        time.sleep(120)\n        print('pwned')\n    os._exit(0)\nprint('escaped?')\n", neither),
        "delete_files": (f"import os, shutil\nfor d in ('.', {wd!r}, {r!r}, '/sandbox'):\n"
                         "    shutil.rmtree(d, ignore_errors=True)\n"
                         "    for f in (os.listdir(d) if os.path.isdir(d) else []):\n"
                         "        try:\n            os.remove(os.path.join(d, f))\n        except OSError:\n            pass\n"
                         f"{seen}\n", neither),
    }


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@needs_bwrap
def test_adversarial_sweep_worker_survives_and_nothing_leaks(tmp_path: Path) -> None:
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    (workdir / "canary.txt").write_text("the worker's working directory")
    canned: dict[str, list[str]] = {}
    with CannedEngine(canned) as url:  # the network program dials this server's port
        programs = hostile_programs(tmp_path / "run", workdir, int(url.rsplit(":", 1)[1]))
        rows = [{"prompt": f"Problem {name}: print pwned.\n", "inputs": [""], "outputs": ["pwned"]} for name in programs]
        canned.update({row["prompt"]: [fenced(programs[name][0])] for row, name in zip(rows, programs, strict=True)})
        run = code_run(tmp_path, rows, shard_size=1)
        before = tree_digest(run.path)
        code, out, pid = run_worker(run, url, workdir, "--sandbox-concurrency", "2")
    assert code == 0, out  # the worker survived every program
    got = results(run)
    for shard, (name, (_, counters)) in enumerate(programs.items()):
        r = got[WorkUnit(1, "code", shard)]
        assert (r.status, r.scores, r.counters) == ("ok", (0.0,), counters), f"{name}: {r}"
    metrics = point_metrics(derive_point(run.manifest(), 1, got))  # what the trainer logs for the point
    assert (metrics["eval/code"], metrics["eval/code/code_timeouts"], metrics["eval/code/code_errors"]) == (0.0, 2, 6)
    after = tree_digest(run.path)
    assert {k: v for k, v in after.items() if k in before} == before, "a file of the run dir changed"
    assert not [p for p in run.path.rglob("*") if "pwned" in p.name]
    assert (workdir / "canary.txt").read_text() == "the worker's working directory"
    assert survivors(f"ckpteval-{pid}") == [], "a sandboxed process outlived its unit"


# -- the worker's start-up check --------------------------------------------------------------------------
@needs_bwrap
def test_worker_refuses_code_sets_where_bwrap_cannot_start_unless_opted_in(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    row = EXAMPLE[0]
    run = code_run(tmp_path, [row], shard_size=1)
    bwrap_failing_after(tmp_path, monkeypatch, good_calls=0)
    with CannedEngine({row["prompt"]: [fenced(row["solution"])]}) as url:
        code, out, _ = run_worker(run, url, tmp_path / "cwd", timeout=120)
        assert code == 2 and "Traceback" not in out, out
        assert "bwrap cannot start a sandbox" in out and "--unsafe-code-rlimits-only" in out, out
        assert results(run) == {}
        code, out, _ = run_worker(run, url, tmp_path / "cwd", "--unsafe-code-rlimits-only", timeout=120)
    assert code == 0, out
    r = results(run)[WorkUnit(1, "code", 0)]
    assert r.scores == (1.0,) and r.scorer["sandbox"] == "rlimits-only"


@needs_bwrap
def test_a_sandbox_failing_mid_run_skips_the_unit_sandbox_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    row = EXAMPLE[0]
    run = code_run(tmp_path, [row], shard_size=1)
    bwrap_failing_after(tmp_path, monkeypatch, good_calls=1)  # the worker's start-up probe passes
    with CannedEngine({row["prompt"]: [fenced(row["solution"])]}) as url:
        code, out, _ = run_worker(run, url, tmp_path / "cwd", "--max-attempts", "1", timeout=120)
    r = results(run).get(WorkUnit(1, "code", 0))
    assert r is not None and r.status == "skipped" and r.skip_reason == "sandbox_failed", out
    assert not r.scores


# -- verdicts the program cannot reach (#26) -------------------------------------------------------------
# Every hostile completion below solves nothing (its function returns a wrong value) and tries to make the
# harness report a pass anyway; each must score 0 on an MBPP-shaped row and on a HumanEval-shaped row.
FORGE = """
import os, re, sys
def _forge():
    seen = ''
    for path in ('/sandbox/main.py', globals().get('__file__') or ''):
        try:
            seen += open(path).read()
        except OSError:
            pass
    lines = ['pass %d' % i for i in range(10)] + ['done']
    for nonce in set(re.findall(r'[0-9a-f]{32}', seen)) | {'0' * 32}:
        lines += ['%s pass %d' % (nonce, i) for i in range(10)] + [nonce + ' done']
    text = '\\n' + '\\n'.join(lines) + '\\n'
    for fd in range(0, 20):
        try:
            os.write(fd, text.encode())
        except OSError:
            pass
    print(text)
"""
HOSTILE: dict[str, str] = {
    "nonce_from_file_top_level": FORGE + "_forge()\n",
    "nonce_from_file_atexit": FORGE + "import atexit\natexit.register(_forge)\n",
    "forge_then_exit_0": FORGE + "_forge()\nos._exit(0)\n",
    "replace_exec_and_compile": "import builtins\n_c = compile\nbuiltins.exec = lambda *a, **k: None\n"
                                "builtins.compile = lambda *a, **k: _c('pass', 'x', 'exec')\n",
    "settrace_swaps_check": "import sys, threading\ndef _noop(*a, **k):\n    return None\n"
                            "def _tracer(frame, event, arg):\n    for k in ('check', 'candidate'):\n"
                            "        if k in frame.f_globals:\n            frame.f_globals[k] = _noop\n    return _tracer\n"
                            "sys.settrace(_tracer)\nthreading.settrace(_tracer)\nsys.setprofile(_tracer)\n",
    "reporter_via_main_and_frames": "import sys, __main__\n_lines = ['pass %d' % i for i in range(10)] + ['done']\n"
                                    "for _v in list(vars(__main__).values()):\n    if callable(_v):\n"
                                    "        for _l in _lines:\n            try:\n                _v(_l)\n"
                                    "            except BaseException:\n                pass\n"
                                    "_f = sys._getframe(0)\nwhile _f is not None:\n"
                                    "    for _v in list(_f.f_locals.values()):\n"
                                    "        if callable(_v) and getattr(_v, '__name__', '') in ('say', '_report', 'report'):\n"
                                    "            for _l in _lines:\n                _v(_l)\n    _f = _f.f_back\n",
    "redefined_check": "def check(candidate):\n    return None\n",
    "replaced_assertion_error": "import builtins, sys\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n"
                                "sys.excepthook = lambda *a: None\n",
    "guessed_nonces": "import secrets\nfor _ in range(50):\n    n = secrets.token_hex(16)\n"
                      "    print('\\n'.join('%s pass %d' % (n, i) for i in range(10)) + '\\n' + n + ' done')\n",
    "kill_the_test_process": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
    "stop_the_test_process": "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\n",
    "rt_signal_to_the_test_process": "import os\nos.kill(os.getppid(), 35)\n",  # no signal.Signals member
    "rt_signal_to_itself": "import os\nos.kill(os.getpid(), 50)\n",
    "exit_163_reads_as_signal_35": "import os\nos._exit(163)\n",
}
EXITS = {"os_exit_0": "import os\nos._exit(0)\n", "sys_exit": "import sys\nsys.exit(0)\n",
         "system_exit": "raise SystemExit(0)\n", "exit_builtin": "exit()\n",
         "exit_from_atexit": "import atexit, os\natexit.register(lambda: os._exit(0))\n"}
RIGGED_EQ = {  # the function returns an object equal to everything
    "eq_always_true": "class _Any:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n"
                      "        return False\n    def __bool__(self):\n        return True\n",
    "int_subclass_eq_true": "class _Any(int):\n    def __eq__(self, other):\n        return True\n"
                            "    __hash__ = int.__hash__\n",
}
HUMANEVAL = {"prompt": "def mean(xs):\n", "entry_point": "mean",
             "tests": "METADATA = {'author': 'x'}\n\n\ndef check(candidate):\n"
                      "    assert abs(candidate([1.0, 2.0]) - 1.5) < 1e-6\n    assert candidate([2]) == 2\n"
                      "    assert True\n"}
ROWS = {"mbpp": (EXAMPLE[0], "add", "def add(a, b):\n    return a + b\n"),
        "humaneval": (HUMANEVAL, "mean", "def mean(xs):\n    return sum(xs) / len(xs)\n")}


def hostile_completions(name: str) -> dict[str, str]:
    """attack -> completion for the row whose function is ``name`` (always wrong: returns None or a rigged
    object), attack code around it."""
    wrong = f"def {name}(*args):\n    return None\n"
    out = {attack: wrong + code for attack, code in {**HOSTILE, **EXITS}.items()}
    out |= {attack: code + f"def {name}(*args):\n    return _Any()\n" for attack, code in RIGGED_EQ.items()}
    return out


@needs_bwrap
@pytest.mark.parametrize("fmt", ["mbpp", "humaneval"])
def test_no_hostile_completion_scores_a_pass_and_honest_controls_do(tmp_path: Path, fmt: str) -> None:
    row, name, honest = ROWS[fmt]
    scorer = make_scorer(spec([row], {"timeout_s": 3.0, "memory_mb": 256}), ScorerContext(tmp_path, {}))
    attacks = hostile_completions(name)
    controls = {  # honest solutions doing odd-but-legal things
        "plain": honest,
        "prints_and_atexit": "import atexit\natexit.register(print, 'bye')\nprint('pass 0\\ndone')\n" + honest,
        "own_check_and_eq_class": "class _Thing:\n    def __eq__(self, o):\n        return True\n"
                                  "def check(candidate):\n    return None\n" + honest,
        "main_block": honest + "if __name__ == '__main__':\n    input()\n",
    }
    scored = scorer.score([Sample(fenced(c), row, "") for c in [*attacks.values(), *controls.values()]])
    got = dict(zip([*attacks, *controls], [s.score for s in scored], strict=True))
    assert {k: v for k, v in got.items() if k in attacks and v != 0.0} == {}, got
    assert [got[k] for k in controls] == [1.0] * len(controls), got
    assert scorer.identity()["judge"] == "split-process"


LOOKUP = """
import glob, os, re
_seen = ''
for _p in ['/sandbox/main.py', '/dev/stdin'] + glob.glob('/proc/*/fd/*') + glob.glob('/proc/*/environ') + \\
        glob.glob('/proc/*/cmdline'):
    try:
        _fd = os.open(_p, os.O_RDONLY | os.O_NONBLOCK)
        _seen += os.read(_fd, 1 << 20).decode(errors='ignore')
        os.close(_fd)
    except OSError:
        pass
for _pid in [p for p in os.listdir('/proc') if p.isdigit()]:  # every process's writable memory, too
    try:
        with open('/proc/%s/maps' % _pid) as _maps, open('/proc/%s/mem' % _pid, 'rb') as _mem:
            for _line in _maps:
                _lo, _hi = (int(x, 16) for x in _line.split()[0].split('-'))
                if 'rw' in _line.split()[1] and _hi - _lo < (64 << 20):
                    _mem.seek(_lo)
                    _seen += _mem.read(_hi - _lo).decode('latin-1')
    except (OSError, ValueError, OverflowError):
        pass
_table = {(int(a), int(b)): int(c) for a, b, c in re.findall(r'add\\((-?\\d+), (-?\\d+)\\) == (-?\\d+)', _seen)}
def add(a, b):
    return _table.get((a, b), 12345)
"""


@needs_bwrap
def test_a_completion_cannot_read_the_tests_to_answer_from_a_lookup_table(tmp_path: Path) -> None:
    """The tests reach only the test process (on its stdin, after the solution process is forked): a
    completion that hunts for them finds nothing; the same completion given the tests scores 1 (the hunt works)."""
    row = EXAMPLE[0]
    scorer = make_scorer(spec([row]), ScorerContext(tmp_path, {}))
    (hunted,) = scorer.score([Sample(fenced(LOOKUP), row, "")])
    assert (hunted.score, hunted.counters) == (0.0, {"code_timeouts": 0, "code_errors": 0})
    leaked = LOOKUP.replace("_seen = ''", f"_seen = {' '.join(row['tests'])!r}")
    assert [s.score for s in scorer.score([Sample(fenced(leaked), row, "")])] == [1.0]


@needs_bwrap
def test_values_cross_as_plain_data_with_in_place_changes_and_exceptions(tmp_path: Path) -> None:
    row = {"prompt": "", "tests": [
        "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]",
        "assert pair(1) == (1, 2) and type(pair(1)) is tuple",
        "try:\n    pair(-1)\nexcept ValueError as e:\n    assert 'negative' in str(e)\nelse:\n    raise AssertionError",
        "assert big() == 2 ** 20000 and nan() != nan()",
        "assert math.isclose(pair(2)[1], 3.0)",
    ]}
    solution = ("import collections, math\nP = collections.namedtuple('P', 'a b')\n"
                "def sort_in_place(xs):\n    xs.sort()\n"
                "def pair(n):\n    if n < 0:\n        raise ValueError('negative')\n    return P(n, n + 1)\n"
                "def big():\n    return 2 ** 20000\ndef nan():\n    return float('nan')\n")
    scorer = make_scorer(spec([row]), ScorerContext(tmp_path, {}))
    (good,) = scorer.score([Sample(fenced(solution), row, "")])
    assert (good.score, good.extras["tests_passed_fraction"]) == (1.0, 1.0)
    (bad,) = scorer.score([Sample(fenced(solution.replace("xs.sort()", "return sorted(xs)")), row, "")])
    assert bad.extras["tests_passed_fraction"] == 0.8


class _Mutate(ast.NodeTransformer):
    """One mutation of a program: the ``k``-th applicable site of the operator ``op`` changed."""

    SWAPS: dict[type, type] = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Eq: ast.NotEq,
                               ast.Mod: ast.FloorDiv, ast.Gt: ast.GtE}

    def __init__(self, k: int) -> None:
        self.k, self.seen = k, -1

    def _hit(self) -> bool:
        self.seen += 1
        return self.seen == self.k

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        if type(node.op) in self.SWAPS and self._hit():
            node.op = self.SWAPS[type(node.op)]()
        return node

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if type(node.ops[0]) in self.SWAPS and self._hit():
            node.ops[0] = self.SWAPS[type(node.ops[0])]()
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if type(node.value) is int and self._hit():
            return ast.Constant(node.value + 1)
        return node


def mutants(solution: str, n: int = 3) -> list[str]:
    out = []
    for k in range(12):
        mutated = ast.unparse(_Mutate(k).visit(ast.parse(solution))) + "\n"
        if mutated != ast.unparse(ast.parse(solution)) + "\n" and mutated not in out:
            out.append(mutated)
        if len(out) == n:
            break
    return out


def row_format(row: dict[str, Any]) -> str:
    return "stdio" if "inputs" in row else "humaneval" if isinstance(row["tests"], str) else "mbpp"


def reference_verdict(row: dict[str, Any], program: str) -> bool:
    """The reference harness of the row's format, in a plain subprocess: human-eval's check_correctness
    (program + test + ``check(entry_point)``, passed when it exits 0), the MBPP asserts after the program,
    and stdin/stdout cases (exit 0 and the expected output)."""
    def plain(source: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run([PYTHON, "-I", "-c", source], input=stdin, capture_output=True, text=True, timeout=10,
                              check=False)
    if "inputs" in row:
        runs = [plain(program, i) for i in row["inputs"]]
        return all(r.returncode == 0 and same_output(r.stdout.encode(), o) for r, o in zip(runs, row["outputs"], strict=True))
    if isinstance(row["tests"], str):
        return plain(f"{program}\n{row['tests']}\ncheck({row['entry_point']})\n").returncode == 0
    return plain(program + "\n" + "\n".join(row["tests"]) + "\n").returncode == 0


@needs_bwrap
def test_verdicts_agree_with_the_reference_harnesses_sample_by_sample(tmp_path: Path) -> None:
    """Canonical and mutated solutions of every example row (HumanEval, MBPP, stdin/stdout): the scorer's
    verdict equals the reference harness's, sample by sample."""
    samples, programs = [], []
    for row in [*EXAMPLE, HUMANEVAL | {"solution": ROWS["humaneval"][2]}]:
        for program in [row["solution"], *mutants(row["solution"])]:
            samples.append(Sample(fenced(program), row, row["prompt"]))
            programs.append((row, program))
    scorer = make_scorer(spec([s.row for s in samples]), ScorerContext(tmp_path, {"sandbox_concurrency": 2}))
    ours = [s.score == 1.0 for s in scorer.score(samples)]
    theirs = [reference_verdict(row, program) for row, program in programs]
    disagree = [(row.get("name"), program) for (row, program), a, b in zip(programs, ours, theirs, strict=True) if a != b]
    for fmt in ("humaneval", "mbpp", "stdio"):
        mine = [(a, b) for (row, _), a, b in zip(programs, ours, theirs, strict=True) if row_format(row) == fmt]
        print(f"agreement {fmt}: {sum(a == b for a, b in mine)}/{len(mine)} samples "
              f"({sum(b for _, b in mine)} pass by the reference)")
    assert disagree == []
    assert 0 < sum(theirs) < len(theirs)  # both verdicts occur


@needs_bwrap
def test_an_unencodable_completion_is_that_samples_error_not_the_units(tmp_path: Path) -> None:
    add, stdio = EXAMPLE[0], EXAMPLE[10]
    scorer = make_scorer(spec([add, stdio]), ScorerContext(tmp_path, {}))
    samples = [Sample(fenced("s = '\udc80'\n" + add["solution"]), add, ""), Sample(fenced("print('\udc80')\n"), stdio, ""),
               Sample(fenced(add["solution"]), add, ""), Sample(fenced(stdio["solution"]), stdio, "")]
    scored = scorer.score(samples)
    assert [s.score for s in scored] == [0.0, 0.0, 1.0, 1.0]
    assert [s.counters["code_errors"] for s in scored] == [1, 1, 0, 0]


def test_the_tests_free_names_call_the_solution_except_modules_and_builtins() -> None:
    spec_ = json.loads(harness_stdin(["import os\nassert f(len([1])) == math.floor(g.x)", "def check(c):\n    c(1)\n"
                                      "check(numbers)\n"], entry_point="numbers"))
    assert (spec_["proxies"], spec_["modules"]) == (["f", "g", "numbers"], ["math"])


def test_the_harness_speaks_json_through_jsons_own_c_codec_and_refuses_what_json_would_not_carry() -> None:
    """The harness uses json's C half (``_json``): the same bytes as ``json.dumps``, the same values back, and a
    ValueError for anything malformed, trailing or non-finite (the solution process writes the answers)."""
    for value in [{"value": ["l", [["u", "x\u00e9\n\""], None, True]], "after": {}}, {"name": "f", "args": [], "kwargs": []},
                  {"tests": ["assert f(1) == 2\n"], "proxies": ["f"], "modules": ["math"]}, "s", []]:
        assert code_harness._dumps(value) == json.dumps(value)
        assert code_harness._loads(json.dumps(value).encode()) == value
    for bad in [b"", b"[1,", b"NaN", b'{"value": Infinity}', b"[1] x", b'"\x01"', b"\xff"]:
        with pytest.raises(ValueError):
            code_harness._loads(bad)
    with pytest.raises(ValueError):
        code_harness._dumps({"value": float("nan")})


@needs_bwrap
def test_the_harness_loads_none_of_the_slow_modules() -> None:
    """json (re, enum), signal (enum) and ctypes cost a sample more than the interpreter's start-up: the
    harness does without them (throughput, #26); the solution process, forked from it, sees its modules."""
    probe = "import sys\nprint([m for m in ('json', 're', 'enum', 'signal', 'ctypes') if m in sys.modules], flush=True)\ndef f():\n    return 1\n"
    box = Sandbox(Limits(wall_s=10.0), concurrency=1)
    try:
        outcome = box.run(harness_program(probe), harness_stdin(["assert f() == 1"]))
    finally:
        box.close()
    assert outcome.status == "passed" and b"pass 0" in outcome.stdout and b"done" in outcome.stdout, outcome
    assert b"[]\n" in outcome.stderr, outcome


@needs_bwrap
def test_a_failed_sample_says_why_in_the_results_notes(tmp_path: Path) -> None:
    """#31: a code error carries its text — the result's ``notes`` say per sample how many tests passed,
    what ended the program (the first failing case for stdin/stdout) and its stderr's last line; a pass
    has no note, and the notes survive the result file's round trip."""
    from ckpteval.coord.results.files import ok_result, parse_result
    from ckpteval.coord.work.units import WorkUnit
    from ckpteval.jobs.eval.scorers import UnitTally

    add, stdio = EXAMPLE[0], EXAMPLE[10]
    scorer = make_scorer(spec([add, stdio]), ScorerContext(tmp_path, {}))
    samples = [Sample(fenced("1 / 0\n"), add, ""), Sample(fenced("print('wrong')\n"), stdio, ""),
               Sample(fenced("import sys\nsys.stderr.write('bad input\\n')\nsys.exit(3)\n"), stdio, ""),
               Sample(fenced(add["solution"]), add, "")]
    scored = scorer.score(samples)
    notes = [s.note for s in scored]
    assert notes[0] is not None and notes[0].startswith("error: 0/") and "ZeroDivisionError" in notes[0], notes[0]
    assert notes[1] is not None and notes[1].startswith("wrong answer: 0/") and "case 0: wrong output" in notes[1]
    assert notes[2] is not None and "case 0: exit status 3" in notes[2] and notes[2].endswith("bad input"), notes[2]
    assert notes[3] is None and scored[3].score == 1.0
    tally = UnitTally.of(scored)
    result = ok_result(WorkUnit(1, "code", 0), [s.score for s in scored], ["1"] * 4, **tally.as_result_fields())
    assert parse_result(json.loads(json.dumps(result.to_json())), tmp_path / "r.json").notes == tuple(notes)
    assert UnitTally.of(scored[3:]).notes == ()  # no note at all: no notes field
