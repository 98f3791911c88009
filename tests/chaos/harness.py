"""Shared machinery of the fault-injection suite: real processes, real runs, outcome counting, the report.

Nothing here fakes ckpteval. Workers are ``python -m ckpteval.jobs.cli worker`` processes with a real fn backend
(:class:`tests.support.workers.SumBackend`, which reads every snapshot's real safetensors; no torch import per
worker, which keeps the suite affordable on 2 cores), trainers are either ``python -m ckpteval.jobs.cli train``
processes or :class:`InProcTrainer` — this process acting as a training loop that drives the real
:class:`ckpteval.jobs.trainer.dispatcher.EvalDispatcher` with a real tiny model (real async export into the staging root,
real ledger, metrics.jsonl, ingestion and GC). Faults are real signals, real filesystems (tmpfs mounts),
real clock skew (libfaketime) and real bytes written over the protocol's files.

Scale: ``CKPTEVAL_CHAOS_SCALE=full`` (``make chaos``) runs the full counts; anything else (``make test``)
runs bounded counts so the whole chaos subset stays within a few minutes on 2 cores.

Counting (one :class:`Row` per fault class, printed at the end of the session and, at full scale, saved to
``bench/CHAOS.md`` by ``tests/chaos/conftest.py``):

* *points expected*: the eval points the scenario's trainer dispatched (every ``eval_interval`` plus the
  final step) — or, for subprocess trainers, every multiple of the interval up to the last step;
* *landed*: points the trainer logged (an ``eval/step`` line in ``metrics.jsonl``); of those, *skipped*
  counts points logged with ``eval/skipped_<reason>`` (documented skips, by reason);
* *lost*: expected but never logged — must be 0;
* *dup ingestions*: extra ``eval/step`` lines for one step plus extra ``ingested`` ledger records — must be 0;
* *double evals*: results kept in ``results/duplicates/`` (a lease is a hint, not a fence: allowed, shown);
* *trainer stalls*: in-process trainers, dispatcher calls that blocked the loop longer than
  :data:`STALL_S`, not counting the backpressure wait the scenario configured (``max_in_flight``: the wait
  the dispatcher logs as ``eval/backpressure_wait_seconds``, the behaviour a user asked for); subprocess trainers, gaps between consecutive ``train/*`` lines longer than
  :data:`PROC_STALL_S` (eval backpressure is configured out of reach, so any stall is the eval side's);
* *bytes deleted outside*: bytes of a sentinel directory outside the staging root that vanished — must be 0.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpteval.coord.results.files import ResultIndex
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.claims import lease_holders as coord_lease_holders
from ckpteval.coord.work.units import units_for_step

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
SCALE = "full" if os.environ.get("CKPTEVAL_CHAOS_SCALE", "").lower() == "full" else "bounded"
FULL = SCALE == "full"
STALL_S = 3.0  # an in-process trainer's dispatcher call longer than this is a stall
PROC_STALL_S = 6.0  # a subprocess trainer's gap between train/* lines longer than this is a stall
SUM_FN = "fn:tests.support.workers:SumBackend"
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def ensure_libfaketime() -> str | None:
    """Install Debian's ``faketime`` when it is missing and we may (root with apt-get): ``make test`` does
    its own set-up. Returns why it is unavailable, or None."""
    if LIBFAKETIME.exists():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "needs Debian's libfaketime (apt-get install faketime) and no root/apt to install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "faketime"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            return f"installing faketime failed: {' '.join(cmd)}: {proc.stderr.strip()[-500:]}"
    return None if LIBFAKETIME.exists() else f"faketime installed but {LIBFAKETIME} is missing"


def scaled(bounded: int, full: int) -> int:
    return full if FULL else bounded


SEED = int(os.environ.get("CHAOS_SEED", str(int(time.time()) % 100000)))


def rng(seed_name: str) -> random.Random:
    """A per-scenario RNG; ``CHAOS_SEED`` reproduces a run's choices (the seed is printed in the table)."""
    return random.Random(f"{SEED}:{seed_name}")


# -- processes ---------------------------------------------------------------------------------------
def base_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


class Procs:
    """Every process a scenario started; :meth:`reap` kills the survivors, each by its own pid."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.all: list[subprocess.Popen[bytes]] = []
        self.logs: dict[int, Path] = {}
        self._n = 0

    def start(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        self._n += 1
        log = self.logdir / f"{self._n:03d}-{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, cwd=REPO, env=env or base_env(), stdout=out, stderr=subprocess.STDOUT)
        self.all.append(proc)
        self.logs[proc.pid] = log
        return proc

    def cli(self, command: str, *args: str, name: str | None = None, env: dict[str, str] | None = None,
            prefix: list[str] | None = None, module: str = "ckpteval.jobs.cli") -> subprocess.Popen[bytes]:
        """``python -m ckpteval.jobs.cli <command> <args>`` (optionally behind ``prefix``, e.g. unshare, or through
        another entry ``module`` that ends in ckpteval.jobs.cli, e.g. tests.chaos.faketime_shim)."""
        return self.start([*(prefix or []), PYTHON, "-m", module, command, *args], name or command, env)

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        try:
            return self.logs[proc.pid].read_text(errors="replace")
        except (KeyError, FileNotFoundError):
            return ""

    def tail(self, proc: subprocess.Popen[bytes], n: int = 3000) -> str:
        return self.log(proc)[-n:]

    def wait(self, proc: subprocess.Popen[bytes], timeout: float) -> int:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(
                f"process {proc.args} did not finish in {timeout}s; log tail:\n{self.tail(proc)}"
            ) from None

    def reap(self) -> None:
        for p in self.all:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


class Fleet:
    """``n`` worker slots on one run; a killed slot can be restarted with the same flags."""

    def __init__(self, procs: Procs, run_dir: Path, n: int, *, engine: str = SUM_FN, extra: Iterable[str] = (),
                 env: dict[str, str] | None = None, prefix: list[str] | None = None, name: str = "w",
                 module: str = "ckpteval.jobs.cli") -> None:
        self.procs, self.run_dir, self.engine = procs, Path(run_dir), engine
        self.extra, self.env, self.prefix, self.name, self.module = list(extra), env, prefix, name, module
        self.slots: list[subprocess.Popen[bytes] | None] = [None] * n
        self.retired: list[subprocess.Popen[bytes]] = []  # killed/finished incarnations
        self.starts = 0

    def start(self, i: int) -> subprocess.Popen[bytes]:
        self.starts += 1
        proc = self.procs.cli(
            "worker", "--run-dir", str(self.run_dir), "--engine", self.engine, "--poll-interval", "0.1",
            "--worker-id", f"{self.name}{i}.{self.starts}", *self.extra,
            name=f"{self.name}{i}", env=self.env, prefix=self.prefix, module=self.module,
        )
        self.slots[i] = proc
        return proc

    def start_all(self) -> None:
        for i in range(len(self.slots)):
            self.start(i)

    def signal(self, i: int, sig: int, timeout: float = 30.0) -> int:
        """Send ``sig`` to slot ``i`` and wait for it to exit; returns its exit status."""
        proc = self.slots[i]
        assert proc is not None
        os.kill(proc.pid, sig)
        code = self.procs.wait(proc, timeout)
        self.retired.append(proc)
        self.slots[i] = None
        return code

    def live(self) -> list[tuple[int, subprocess.Popen[bytes]]]:
        return [(i, p) for i, p in enumerate(self.slots) if p is not None and p.poll() is None]

    def wait_all(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in [p for p in self.slots if p is not None]:
            codes.append(self.procs.wait(p, max(1.0, deadline - time.monotonic())))
        return codes

    def logs(self) -> str:
        every = self.retired + [p for p in self.slots if p is not None]
        return "\n".join(f"--- {p.pid}\n{self.procs.tail(p, 1500)}" for p in every)


def lease_holders(run: RunDir) -> dict[str, tuple[str, int]]:
    """unit id -> (host, pid) of its lease holder (filelock's owner record, via ckpteval.coord.work.claims)."""
    return {unit: (record.hostname, record.pid) for unit, record in coord_lease_holders(run.leases).items()}


def units_held_by(run: RunDir, pid: int) -> list[str]:
    return [u for u, (_h, p) in lease_holders(run).items() if p == pid]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := predicate():
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# -- an in-process training loop over the real EvalDispatcher -------------------------------------------
class InProcTrainer:
    """This process as a training loop: a real tiny model whose weights change every step, and the real
    :class:`~ckpteval.jobs.trainer.dispatcher.EvalDispatcher` (staging export, ledger, metrics.jsonl, ingestion, GC).

    Every dispatcher call is timed, less the backpressure wait it logged for a point it dispatched (a
    configured ``max_in_flight`` reached); one longer than :data:`STALL_S` counts as a trainer stall.
    """

    def __init__(self, run_dir: Path, *, n_prompts: int = 8, shard_size: int = 4, eval_interval: int = 5,
                 lease: tuple[float, float] = (3.0, 0.5), max_in_flight: int = 256, keep: int | None = None,
                 staging_dir: Path | None = None, room_check: Callable[[Path, int], bool] | None = None,
                 drain_timeout: float = 120.0, poll_interval: float = 0.1) -> None:
        import torch

        from ckpteval.jobs.metrics import MetricsSink
        from ckpteval.jobs.reference.model import ModelConfig, build_model
        from ckpteval.jobs.trainer.dispatcher import EvalDispatcher
        from tests.support.training import make_train_run

        self.torch = torch
        self.run, dispatch = make_train_run(
            Path(run_dir), eval_n_prompts=n_prompts, eval_shard_size=shard_size, eval_interval=eval_interval,
            lease_duration=lease[0], lease_heartbeat=lease[1], eval_max_in_flight=max_in_flight,
            eval_keep_snapshots=max_in_flight if keep is None else keep, eval_staging_dir=staging_dir,
        )
        self.sink = MetricsSink(self.run.metrics_path)
        extra = {} if room_check is None else {"room_check": room_check}
        self.dispatcher = EvalDispatcher.open(
            dispatch.with_waits(poll_interval_s=poll_interval, drain_timeout_s=drain_timeout,
                                backpressure_timeout_s=600.0), self.run, self.sink, self.run.base, **extra,
        )
        self.eval_interval = eval_interval
        self.sentinel = guard_outside(self.dispatcher.root, Path(run_dir).with_name(Path(run_dir).name + "-outside"))
        self.model = build_model(ModelConfig(), "llama", seed=0)
        self.param = next(self.model.parameters())
        self.step = 0
        self.blocked: list[float] = []
        self.close_s = 0.0

    def advance(self, n: int = 1, step_s: float = 0.0, dispatch: bool = True) -> None:
        """``n`` training steps of ``step_s`` seconds each (the compute a real step would take);
        ``dispatch=False``: steps that only ingest (no new points), as between eval intervals."""
        for _ in range(n):
            self.step += 1
            with self.torch.no_grad():
                self.param.add_(1e-3)
            t0 = time.monotonic()
            before = self.dispatcher.ledger.state.dispatched.get(self.step)
            if dispatch:
                self.dispatcher.maybe_dispatch(self.step, self.model)
            else:
                self.dispatcher.step = self.step
                self.dispatcher.poll()
            record = self.dispatcher.ledger.state.dispatched.get(self.step)
            waited = float(record.get("backpressure_wait_seconds", 0.0)) if record and record is not before else 0.0
            self.blocked.append(time.monotonic() - t0 - waited)
            if step_s:
                time.sleep(step_s)

    def run_until(self, done: Callable[[], bool], step_s: float, max_s: float, dispatch: bool = True) -> None:
        deadline = time.monotonic() + max_s
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"scenario did not reach its goal within {max_s}s (step {self.step})")
            self.advance(1, step_s, dispatch=dispatch)

    def close(self) -> None:
        t0 = time.monotonic()
        self.dispatcher.close(self.step, self.model)
        self.close_s = time.monotonic() - t0
        self.sink.close()

    @property
    def stalls(self) -> int:
        return sum(b > STALL_S for b in self.blocked)

    @property
    def max_block(self) -> float:
        return max(self.blocked, default=0.0)

    def dispatched(self) -> list[int]:
        return sorted(self.dispatcher.ledger.state.dispatched)


# -- progress of a trainer subprocess ------------------------------------------------------------------------
class ProgressMonitor(threading.Thread):
    """Watches ``metrics.jsonl`` of a trainer process: when each ``train/*`` line appeared (this process's
    monotonic clock). :meth:`new_incarnation` marks a restart (gaps across a kill are not stalls)."""

    def __init__(self, metrics_path: Path) -> None:
        super().__init__(daemon=True)
        self.path = Path(metrics_path)
        self.stop = threading.Event()
        self.seen: list[tuple[float, int, int]] = []  # (t, step, incarnation)
        self.incarnation = 0
        self._offset = 0
        self._partial = b""

    def new_incarnation(self) -> None:
        self._read()
        self.incarnation += 1

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self._read()

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self._offset:  # cut by a repair: re-read from the cut
                    self._offset, self._partial = size, b""
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        data, now = self._partial + data, time.monotonic()
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            try:
                rec = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(rec, dict) and "train/loss" in rec:
                self.seen.append((now, int(rec["step"]), self.incarnation))

    def gaps(self) -> list[float]:
        self._read()
        out = []
        for (t0, _s0, i0), (t1, _s1, i1) in zip(self.seen, self.seen[1:], strict=False):
            if i0 == i1:
                out.append(t1 - t0)
        return out

    def stalls(self, bound: float = PROC_STALL_S) -> int:
        return sum(g > bound for g in self.gaps())

    def max_gap(self) -> float:
        return max(self.gaps(), default=0.0)

    def incarnation_step(self) -> int | None:
        """The last step the current incarnation logged (None before its first train line): a restarted
        trainer is up and past its imports."""
        steps = [s for _t, s, inc in list(self.seen) if inc == self.incarnation]
        return steps[-1] if steps else None

    def last_step(self) -> int:
        self._read()
        return self.seen[-1][1] if self.seen else 0


def train_argv(run_dir: Path, *extra: str) -> list[str]:
    """``ckpteval train`` with the tiny eval set and settings that keep backpressure out of reach. The
    tallies count the points of the eval interval; step 0 (exactly once across SIGKILL + ``--resume``)
    is tests/test_train.py's."""
    return [
        "train", "--run-dir", str(run_dir), "--batch-size", "16", "--threads", "1", "--no-progress",
        "--eval-n-prompts", "8", "--eval-shard-size", "4", "--log-interval", "5", "--eval-poll-interval", "0.2",
        "--lease-duration", "3", "--lease-heartbeat", "0.5", "--eval-drain-timeout", "180", "--no-eval-at-start",
        *extra,
    ]


# -- what is outside the staging root -----------------------------------------------------------------------
class Sentinel:
    """Files outside every staging root whose bytes must all survive."""

    def __init__(self, root: Path, n_files: int = 3, size: int = 64 << 10) -> None:
        self.root = Path(root)
        (self.root / "nested").mkdir(parents=True, exist_ok=True)
        self.files: dict[Path, bytes] = {}
        for i in range(n_files):
            path = self.root / ("nested" if i % 2 else ".") / f"sentinel-{i}.bin"
            data = os.urandom(size)
            path.write_bytes(data)
            self.files[path] = data
        old = time.time() - 3 * 86400  # old enough for any "stale temp dir" rule
        for p in [*self.files, self.root / "nested", self.root]:
            os.utime(p, (old, old))

    @property
    def total(self) -> int:
        return sum(len(d) for d in self.files.values())

    def deleted_bytes(self) -> int:
        lost = 0
        for path, data in self.files.items():
            try:
                if path.read_bytes() != data:
                    lost += len(data)
            except FileNotFoundError:
                lost += len(data)
        return lost


def guard_outside(staging_root: Path, where: Path) -> Sentinel:
    """A sentinel directory outside the staging root and a symlink to it planted in the root (named like a
    snapshot, without a marker: never discovered, and never to be followed by GC)."""
    sentinel = Sentinel(where)
    Path(staging_root).mkdir(parents=True, exist_ok=True)
    os.symlink(sentinel.root, Path(staging_root) / "step-0000999999")
    return sentinel


# -- counting outcomes ---------------------------------------------------------------------------------------
def read_jsonl_tolerant(path: Path) -> list[dict[str, Any]]:
    """JSON lines; a torn last line and malformed lines are skipped (counted by the caller if it cares).

    Deliberately more lenient than the protocol's reader (:func:`ckpteval.coord.atomic.read_jsonl`, which
    names a malformed line): chaos scenarios write garbage lines on purpose and then count outcomes.
    """
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for line in raw[: raw.rfind(b"\n") + 1].splitlines():
        try:
            rec = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


@dataclass
class Tally:
    expected: list[int]
    landed: list[int]
    ok: list[int]
    skips: Counter[str]
    lost: list[int]
    dup_ingestions: int
    unexpected: list[int]
    units_without_result: list[str]
    units_total: int
    double_evals: int
    skip_steps: dict[str, list[int]] = field(default_factory=dict)

    def skips_text(self) -> str:
        return ", ".join(f"{r}×{n}" for r, n in sorted(self.skips.items())) or "-"

    def merged(self, other: Tally, step_offset: int) -> Tally:
        """Two runs' tallies as one row; ``other``'s expected steps are shifted so they stay distinct."""
        return Tally(
            expected=self.expected + [s + step_offset for s in other.expected], landed=self.landed + other.landed,
            ok=self.ok + other.ok, skips=self.skips + other.skips, lost=self.lost + other.lost,
            dup_ingestions=self.dup_ingestions + other.dup_ingestions, unexpected=self.unexpected + other.unexpected,
            units_without_result=self.units_without_result + other.units_without_result,
            units_total=self.units_total + other.units_total, double_evals=self.double_evals + other.double_evals,
        )


def tally(run_dir: Path, expected: Iterable[int], metrics_path: Path | None = None) -> Tally:
    """Points of ``expected`` steps as the trainer logged them (or whoever logs into ``metrics_path``: the
    service's ``service_metrics.jsonl``), cross-checked against the results."""
    run = RunDir(run_dir)
    manifest = run.manifest()
    expected = sorted(set(expected))
    metrics = [m for m in read_jsonl_tolerant(metrics_path or run.metrics_path) if "eval/step" in m]
    logged = Counter(int(m["eval/step"]) for m in metrics)
    ingested = Counter(
        r["step"] for r in read_jsonl_tolerant(run.ledger_path) if r.get("event") == "ingested"
    )
    reasons: dict[int, set[str]] = {}
    for m in metrics:
        for k, v in m.items():
            if k.startswith("eval/skipped_") and v:
                reasons.setdefault(int(m["eval/step"]), set()).add(k[len("eval/skipped_"):])
    landed = [s for s in expected if logged[s]]
    skips: Counter[str] = Counter()
    skip_steps: dict[str, list[int]] = {}
    for s in landed:
        for r in reasons.get(s, ()):
            skips[r] += 1
            skip_steps.setdefault(r, []).append(s)
    results = ResultIndex(run.results).refresh()
    missing = [
        u.id for s in expected if "drain_timeout" not in reasons.get(s, ())
        for u in units_for_step(manifest, s) if u not in results
    ]
    dup_dir = run.results / "duplicates"
    doubles = 0
    for p in dup_dir.glob("*.json") if dup_dir.is_dir() else ():
        try:
            doubles += isinstance(json.loads(p.read_bytes()).get("unit"), dict)
        except (ValueError, AttributeError):
            pass  # not a result (junk planted by a test): readers ignore duplicates/ anyway
    return Tally(
        expected=expected,
        landed=landed,
        ok=[s for s in landed if s not in reasons],
        skips=skips,
        lost=[s for s in expected if not logged[s]],
        dup_ingestions=sum(c - 1 for c in logged.values() if c > 1) + sum(c - 1 for c in ingested.values() if c > 1),
        unexpected=sorted(set(logged) - set(expected)),
        units_without_result=missing,
        units_total=sum(len(units_for_step(manifest, s)) for s in expected),
        double_evals=doubles,
        skip_steps=skip_steps,
    )


# -- the report ---------------------------------------------------------------------------------------------
@dataclass
class Row:
    fault_class: str
    faults: str
    expected: int
    landed: int
    ok: int
    skipped: str
    lost: int
    dup_ingestions: int
    double_evals: int
    stalls: int
    max_gap_s: float
    outside_deleted: int
    wall_s: float
    notes: str
    nodeid: str = ""
    result: str = "?"


ROWS: list[Row] = []
RESULTS: dict[str, str] = {}  # nodeid -> passed/failed (filled by the conftest hook)


def record(nodeid: str, fault_class: str, faults: str, t: Tally, *, stalls: int, max_gap_s: float,
           outside_deleted: int, wall_s: float, notes: str = "") -> Row:
    row = Row(
        fault_class=fault_class, faults=faults, expected=len(t.expected), landed=len(t.landed), ok=len(t.ok),
        skipped=t.skips_text(), lost=len(t.lost), dup_ingestions=t.dup_ingestions, double_evals=t.double_evals,
        stalls=stalls, max_gap_s=round(max_gap_s, 2), outside_deleted=outside_deleted, wall_s=round(wall_s, 1),
        notes=notes, nodeid=nodeid,
    )
    ROWS.append(row)
    print(f"\nchaos: {fault_class}: expected {row.expected}, landed {row.landed} (ok {row.ok}, skips {row.skipped}), "
          f"lost {row.lost}, dup ingestions {row.dup_ingestions}, stalls {row.stalls}, outside deleted "
          f"{row.outside_deleted}, {row.wall_s} s", flush=True)
    return row


HEADER = ("fault class", "faults injected", "points expected", "landed", "ok", "documented skips", "lost",
          "dup ingestions", "double evals", "trainer stalls (max gap s)", "bytes deleted outside", "wall s",
          "test")


def table_markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        result = RESULTS.get(r.nodeid, r.result)
        cells = (r.fault_class, r.faults, r.expected, r.landed, r.ok, r.skipped, r.lost, r.dup_ingestions,
                 r.double_evals, f"{r.stalls} ({r.max_gap_s:.2f})", r.outside_deleted, r.wall_s, result)
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def machine() -> dict[str, str]:
    from ckpteval.jobs.trainer.config import filesystem_type

    mem = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    import tempfile

    tmp = Path(os.environ.get("PYTEST_BASETEMP", tempfile.gettempdir()))
    return {
        "cores": str(os.cpu_count()),
        "ram": mem,
        "run-dir filesystem": f"{filesystem_type(tmp)} ({tmp})",
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def report_markdown(rows: list[Row]) -> str:
    m = machine()
    notes = "\n".join(f"- **{r.fault_class}**: {r.notes}" for r in rows if r.notes)
    return (
        "# ckpteval chaos report\n\n"
        "Generated by `make chaos` (`CKPTEVAL_CHAOS_SCALE=full pytest -q tests/chaos -s`); "
        "the suite's tests assert every guarantee, this table is the record. "
        "Definitions of the columns: `tests/chaos/harness.py`.\n\n"
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n"
        f"- scale: {SCALE} (seed {SEED}; rerun with `CHAOS_SEED={SEED}`)\n"
        f"- machine: {m['cores']} cores, {m['ram']} RAM, {m['run-dir filesystem']}, "
        f"Linux {m['kernel']}, Python {m['python']}\n"
        f"- stall bounds: in-process trainer {STALL_S:g} s per dispatcher call, "
        f"trainer process {PROC_STALL_S:g} s between `train/*` lines\n\n"
        f"{table_markdown(rows)}\n\n## Notes per fault class\n\n{notes}\n"
    )


MATRIX_HEADER = ("cell (posture × restart)", "faults injected", "points expected", "logged", "documented skips",
                 "lost", "logged twice", "double evals", "notes", "wall s", "test")


def matrix_markdown(heading: str, rows: list[Row]) -> str:
    """The requeue matrix's section of bench/CHAOS.md (tests/chaos/test_requeue_matrix.py)."""
    m = machine()
    lines = ["| " + " | ".join(MATRIX_HEADER) + " |", "|" + "---|" * len(MATRIX_HEADER)]
    for r in rows:
        cells = (r.fault_class.removeprefix("requeue: "), r.faults, r.expected, r.landed, r.skipped, r.lost,
                 r.dup_ingestions, r.double_evals, r.notes or "-", r.wall_s, RESULTS.get(r.nodeid, r.result))
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    load = os.getloadavg()
    return (
        f"{heading}\n\n"
        "Generated by `CKPTEVAL_CHAOS_SCALE=full pytest -q tests/chaos/test_requeue_matrix.py -s` (also part "
        "of `make chaos`); each cell is real processes killed with real signals and restarted with the "
        "identical command (postures and restart modes: the test module's docstring).\n\n"
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; scale: {SCALE} (seed {SEED}); "
        f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (shared machine)\n"
        f"- machine: {m['cores']} cores, {m['ram']} RAM, {m['run-dir filesystem']}, Linux {m['kernel']}\n\n"
        + "\n".join(lines) + "\n\n"
        f"Totals: {len(rows)} cells, {sum(r.faults.count(';') + 1 for r in rows if r.faults != '-')} faults, "
        f"{sum(r.expected for r in rows)} points expected, {sum(r.landed for r in rows)} logged, "
        f"{sum(r.lost for r in rows)} lost, {sum(r.dup_ingestions for r in rows)} logged twice.\n\n"
    )
