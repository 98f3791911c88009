"""The assert-style test harness of scorer ``code``: runs inside the sandbox; the solution never runs beside the tests.

This file's source, followed by ``_harness(<solution source>)``, is the program the sandbox runs
(``python -I -S``, standard library only). The process that starts it, the *test process*, is trusted:

1. it makes itself non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``): a process of the same uid can then
   neither ptrace it nor open its ``/proc/<pid>/{mem,fd,environ}``;
2. it forks the *solution process*, which points its stdin at /dev/null and its stdout at stderr, closes
   every other descriptor but its two pipes, and only then loads the solution. It serves calls: a request
   names a top-level function of the solution and carries plain-data arguments, the answer is the
   plain-data return value (or the exception's type name and text);
3. only after the fork does the test process read its tests from stdin (JSON: ``tests``, ``proxies``,
   ``modules``), so they are in no file, environment or memory the solution can reach. It runs each test
   with every name in ``proxies`` bound to a stub that calls into the solution process (``modules``:
   standard-library modules the tests use without importing them), and writes ``pass <i>`` for each test
   that ran to its end on its own stdout, which the solution process does not hold.

So a verdict is decided in a process where no solution code has run, on values that crossed a pipe as
plain data (None, bool, int, float, complex, str, bytes and lists, tuples, dicts, sets of them; a
subclass arrives as its base type): a rigged ``__eq__``, patched builtins, trace hooks, a forged report,
an early exit or a handler at exit change nothing the test process sees. What the solution process
controls is what every program controls: the values it returns, whether it raises, how long it takes.
Limits: a test that passes an argument that is not plain data, or needs a returned object that is not
(a class instance, a generator), fails; list, dict and set arguments are copied back after each call (so
in-place mutation is seen), other aliasing is not.

Report lines (stdout of the test process): ``pass <i>``, ``load-error``, ``oom``, ``solution exit <n>``
or ``solution signal <n>`` (how the solution process ended), ``setup-error <why>``, ``done``.
"""

from __future__ import annotations

import _signal  # signal's C half: signal itself imports enum (2 ms a sample)
import builtins
import os
import select
import sys
import time

try:  # json's C half: json's own imports (re, enum, ...) cost more than the interpreter's start-up
    import _json
except ImportError:  # a build without it: _harness reports a setup error (infrastructure, never the model's)
    _json = None

MAX_DEPTH = 200


def _enc(v: object, depth: int = 0) -> object:
    """A plain-data value as JSON (ints and floats tagged as hex strings: exact, and no size limit)."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if v is None or v is True or v is False:
        return v
    d = depth + 1
    for base, tag, conv in _ENCODERS:
        if isinstance(v, base):
            return [tag, conv(v, d)]
    raise TypeError(f"not plain data: {type(v).__name__}")


_ENCODERS: tuple[tuple[type, str, object], ...] = (
    (bool, "o", lambda v, d: bool(int.__int__(v))),
    (int, "i", lambda v, d: hex(int.__int__(v))),
    (float, "f", lambda v, d: float.hex(float.__float__(v))),
    (complex, "c", lambda v, d: [float.hex(complex.__getattribute__(v, "real")),
                                  float.hex(complex.__getattribute__(v, "imag"))]),
    (str, "u", lambda v, d: str.__str__(v)),
    (bytes, "b", lambda v, d: bytes.hex(v)),
    (list, "l", lambda v, d: [_enc(x, d) for x in list.__iter__(v)]),
    (tuple, "t", lambda v, d: [_enc(x, d) for x in tuple.__iter__(v)]),
    (dict, "d", lambda v, d: [[_enc(k, d), _enc(x, d)] for k, x in dict.items(v)]),
    (frozenset, "z", lambda v, d: [_enc(x, d) for x in frozenset.__iter__(v)]),
    (set, "s", lambda v, d: [_enc(x, d) for x in set.__iter__(v)]),
)


def _dec(x: object) -> object:
    """The exact plain value of an :func:`_enc` encoding; ValueError for anything else."""
    if x is None or x is True or x is False:
        return x
    if type(x) is not list or len(x) != 2 or type(x[0]) is not str:
        raise ValueError("malformed value")
    tag, body = x
    if tag == "o" and type(body) is bool:
        return body
    if tag == "u" and type(body) is str:
        return body
    if tag == "i" and type(body) is str:
        return int(body, 16)
    if tag == "f" and type(body) is str:
        return float.fromhex(body)
    if tag == "c" and type(body) is list and len(body) == 2:
        return complex(float.fromhex(body[0]), float.fromhex(body[1]))
    if tag == "b" and type(body) is str:
        return bytes.fromhex(body)
    if type(body) is not list:
        raise ValueError("malformed value")
    if tag == "d":
        return {_dec(k): _dec(v) for k, v in body}
    kinds = {"l": list, "t": tuple, "s": set, "z": frozenset}
    if tag not in kinds:
        raise ValueError("malformed value")
    return kinds[tag](_dec(y) for y in body)


class _Plain:
    """JSON decoding settings for ``_json``'s scanner (those of ``json.loads``, without NaN/Infinity)."""

    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int = float, int

    @staticmethod
    def parse_constant(name: str) -> object:
        raise ValueError(f"{name} is not plain JSON")


_SCAN = _json.make_scanner(_Plain()) if _json is not None else None


def _not_json(value: object) -> object:
    raise TypeError(f"not JSON: {type(value).__name__}")


def _dumps(value: object) -> str:
    """``json.dumps(value)`` (ASCII, no NaN), by the C encoder ``json`` itself uses."""
    encode = _json.make_encoder({}, _not_json, _json.encode_basestring_ascii, None, ": ", ", ", False, False, False)
    return "".join(encode(value, 0))


def _loads(data: bytes) -> object:
    """``json.loads(data)`` of UTF-8 bytes (ValueError when malformed or followed by anything)."""
    text = data.decode("utf-8").strip()
    try:
        value, end = _SCAN(text, 0)
    except StopIteration:
        raise ValueError("malformed JSON") from None
    if end != len(text):
        raise ValueError("malformed JSON: extra data")
    return value


def _send(out: object, msg: dict[str, object]) -> None:
    out.write(_dumps(msg).encode() + b"\n")
    out.flush()


def _serve(source: str, requests: int, answers: int) -> None:
    """The solution process: load the solution, then answer calls until the test process hangs up."""
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)
    for lo, hi in ((3, min(requests, answers)), (min(requests, answers) + 1, max(requests, answers)),
                   (max(requests, answers) + 1, 1 << 16)):
        os.closerange(lo, hi)
    rin, out = os.fdopen(requests, "rb"), os.fdopen(answers, "wb")
    g: dict[str, object] = {"__name__": "__solution__"}
    try:
        exec(compile(source, "solution.py", "exec"), g)  # user code
    except BaseException as e:  # user code
        __import__("traceback").print_exc()
        _send(out, {"load_error": type(e).__name__})
        os._exit(0)
    _send(out, {"loaded": True})
    for line in rin:
        _send(out, _answer(g, line))
    os._exit(0)


def _answer(g: dict[str, object], line: bytes) -> dict[str, object]:
    req = _loads(line)
    try:
        args = [_dec(a) for a in req["args"]]
        kwargs = {k: _dec(v) for k, v in req["kwargs"]}
        value = g[req["name"]](*args, **kwargs)  # user code
        after = {str(i): _enc(a) for i, a in enumerate(args) if type(a) in (list, dict, set)}
        return {"value": _enc(value), "after": after}
    except BaseException as e:  # user code
        try:
            return {"raise": str(type(e).__name__), "text": str(e)[:500]}
        except BaseException:  # user code (a rigged __str__)
            return {"raise": "RuntimeError", "text": "unprintable exception"}


class _Solution:
    """The test process's end of the pipes to the solution process."""

    def __init__(self, pid: int, requests: int, answers: int) -> None:
        self.pid = pid
        self.out = os.fdopen(requests, "wb")
        self.rin = os.fdopen(answers, "rb")
        self.lost = False
        self.oom = False

    def receive(self) -> dict[str, object] | None:
        line = self.rin.readline()
        if not line:
            self.lost = True
            return None
        msg = _loads(line)
        if type(msg) is not dict:
            raise ValueError("malformed answer")
        return msg

    def call(self, name: str, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
        if self.lost:
            raise RuntimeError("the solution process has ended")
        try:
            _send(self.out, {"name": name, "args": [_enc(a) for a in args],
                             "kwargs": [[k, _enc(v)] for k, v in kwargs.items()]})
        except BrokenPipeError:
            self.lost = True
            raise RuntimeError("the solution process has ended") from None
        msg = self.receive()
        if msg is None:
            raise RuntimeError("the solution process ended during a call")
        if "raise" in msg:
            raise _exception(str(msg["raise"]), str(msg.get("text", "")), self)
        for i, value in dict(msg.get("after") or {}).items():
            _copy_back(args[int(i)], _dec(value))
        return _dec(msg["value"])

    def end(self) -> str:
        """Hang up, then how the solution process ended (killed if it does not end within a second)."""
        self.out.close()
        if not _exited_within(self.pid, 1.0):
            os.kill(self.pid, _signal.SIGKILL)
        return _ending(os.waitpid(self.pid, 0)[1])


def _exited_within(pid: int, seconds: float) -> bool:
    """Whether the child ``pid`` (not reaped) exits within ``seconds``: woken at its exit through a pidfd,
    else polled every 5 ms."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0:
        try:
            return bool(select.select([fd], [], [], seconds)[0])
        finally:
            os.close(fd)
    give_up = time.monotonic() + seconds
    while time.monotonic() < give_up:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(0.005)
    return False


def _ending(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"solution signal {os.WTERMSIG(status)}"
    return f"solution exit {os.waitstatus_to_exitcode(status)}"


def _exception(name: str, text: str, solution: _Solution) -> BaseException:
    """The exception the solution raised, as a builtin exception type (never one that is not an Exception)."""
    kind = getattr(builtins, name, None)
    if name == "MemoryError":
        solution.oom = True
    if isinstance(kind, type) and issubclass(kind, Exception):
        return kind(text)
    return RuntimeError(f"{name}: {text}")


def _copy_back(arg: object, value: object) -> None:
    if type(arg) is list and type(value) is list:
        arg[:] = value
    elif type(arg) in (dict, set) and type(value) is type(arg):
        arg.clear()
        arg.update(value)


def _proxy(solution: _Solution, name: str) -> object:
    def call(*args: object, **kwargs: object) -> object:
        return solution.call(name, args, kwargs)
    call.__name__ = call.__qualname__ = name
    return call


def _non_dumpable() -> str | None:
    """prctl(PR_SET_DUMPABLE, 0), checked; through ``_ctypes`` (``ctypes``'s imports cost 2 ms per sample)."""
    try:
        import _ctypes

        class Int(_ctypes._SimpleCData):
            _type_ = "i"

        class Prctl(_ctypes.CFuncPtr):
            _flags_ = _ctypes.FUNCFLAG_CDECL
            _restype_ = Int

        class Libc:
            _handle = _ctypes.dlopen(None, 0)

        prctl = Prctl(("prctl", Libc))
        if prctl(4, 0, 0, 0, 0) != 0 or prctl(3, 0, 0, 0, 0) != 0:  # PR_SET/GET_DUMPABLE
            return "prctl(PR_SET_DUMPABLE, 0) failed"
    except (ImportError, OSError, AttributeError) as e:
        return f"cannot call prctl: {e}"
    return None


def _harness(source: str) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if p and os.path.abspath(p) != here]  # nothing writable on the path
    report = os.dup(1)
    os.dup2(2, 1)  # the tests' own prints go to stderr; stdout is the report's alone

    def say(line: str) -> None:
        os.write(report, (line + "\n").encode())

    why = _non_dumpable() if _json is not None else "the interpreter has no _json module"
    if why is not None:
        say(f"setup-error {why}")
        os._exit(3)
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(requests_w)
        os.close(answers_r)
        os.close(report)
        _serve(source, requests_r, answers_w)
    os.close(requests_r)
    os.close(answers_w)
    solution = _Solution(pid, requests_w, answers_r)
    spec = _loads(sys.stdin.buffer.read())  # read only now: the solution process never held the tests
    loaded = solution.receive()
    if loaded is None or "loaded" not in loaded:
        say("load-error")
        say(solution.end())
        say("done")
        return
    ns: dict[str, object] = {"__name__": "__test__"}
    for module in spec["modules"]:
        ns[module] = __import__(module)
    for name in spec["proxies"]:
        ns[name] = _proxy(solution, name)
    for i, test in enumerate(spec["tests"]):
        try:
            exec(compile(test, f"test_{i}.py", "exec"), ns)
        except BaseException:
            __import__("traceback").print_exc()
        else:
            say(f"pass {i}")
    if solution.oom:
        say("oom")
    say(solution.end())
    say("done")
