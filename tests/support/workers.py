"""Shared helpers for the eval-side tests: real runs, real tiny-model snapshots, real fn backends.

Nothing here is a fake of ckpteval: runs are created with :mod:`coord`, snapshots are published with
``ckpteval.coord.snapshots.snapshot.publish_snapshot`` around ``ckpteval.jobs.trainer.export.hf_files.write_hf_files`` of a tiny
``ckpteval.jobs.reference.model.build_model`` Llama, and the fn backends below are real ``CheckpointEvalFn`` classes
(loaded by import path in worker subprocesses) that score from the snapshot's actual safetensors.
torch is imported lazily so that fn-backend worker processes importing this module stay light.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from ckpteval.coord.results.files import Result, ResultIndex
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.snapshot import publish_snapshot
from ckpteval.coord.work.claims import attempts_path, lease_holders
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.engines.fn import CheckpointEvalFn, EvalSkip
from tests.support.runs import flip_byte  # noqa: F401  (re-exported for the worker tests)

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


# -- runs --------------------------------------------------------------------------------------------
def make_eval_run(
    tmp: Path,
    *,
    n_prompts: int = 8,
    shard_size: int = 4,
    lease: LeaseSettings | None = None,
    engine: dict[str, Any] | None = None,
    scorer: str = "exact",
    max_new_tokens: int = 4,
    name: str = "run",
    snapshot_root: Path | None = None,
    n_samples: int = 1,
    replay: Any = None,
) -> RunDir:
    """A run with the built-in addition eval set (``n_prompts`` rows) and one snapshot root (``replay``: its
    ``eval.replay``, a :class:`ckpteval.coord.results.replays.ReplaySettings`)."""
    from dataclasses import replace

    from ckpteval.jobs.eval.kinds.generate.evalsets import write_addition_dataset

    run = RunDir.create(tmp / name)
    spec = write_addition_dataset(run, n=n_prompts, shard_size=shard_size)
    spec = replace(spec, scorer=scorer, max_new_tokens=max_new_tokens, n_samples=n_samples)
    manifest = RunManifest(
        run_id=f"test-{name}",
        eval=EvalSpec(entries=(spec,), engine=engine or {}, **({"replay": replay} if replay is not None else {})),
        snapshot_roots=(str(snapshot_root or run.snapshots),),
        lease=lease or LeaseSettings(30.0, 5.0),
    )
    return RunDir.create(run.path, manifest)


def version(run: RunDir, step: int) -> str:
    """The weight version a worker of ``run`` stamps an engine with for ``step`` (ckpteval.coord.run.identity)."""
    from ckpteval.coord.run.identity import run_key, weight_version

    return weight_version(run_key(run.manifest()), step)


# -- snapshots of the tiny model ------------------------------------------------------------------------
_BASE: dict[str, Path] = {}


def base_dir(tmp: Path) -> Path:
    """A base model dir (config, generation config, tokenizer; no weights), made once per tmp dir."""
    from ckpteval.jobs.reference.model import save_base_model_dir

    key = str(tmp)
    if key not in _BASE:
        _BASE[key] = save_base_model_dir(tmp / "base-model")
    return _BASE[key]


def model_writer(tmp: Path, seed: int) -> Callable[[Path], dict[str, dict[str, int]]]:
    """A ``write_files`` for publish_snapshot: the tiny model with weights drawn from ``seed``."""
    from ckpteval.jobs.reference.model import build_model
    from ckpteval.jobs.trainer.export.hf_files import write_hf_files

    base = base_dir(tmp)

    def write(d: Path) -> dict[str, dict[str, int]]:
        model = build_model(seed=seed)
        return write_hf_files(d, model.state_dict(), base)

    return write


def publish_model(tmp: Path, root: Path, step: int, seed: int | None = None) -> Path:
    """Publish a real HF snapshot of the tiny model for ``step`` under ``root`` (as :func:`publish_as_trainer`)."""
    return publish_as_trainer(root, step, model_writer(tmp, step if seed is None else seed))


def publish_as_trainer(root: Path, step: int, write_files: Callable[[Path], Any]) -> Path:
    """``publish_snapshot`` as a run's trainer does it: under a run's own ``RUN/snapshots`` the marker names
    that run (:func:`own_run_key`; a worker ignores a run-less marker there), elsewhere no run."""
    return publish_snapshot(root, step, write_files, run=own_run_key(root))


def own_run_key(root: Path) -> str | None:
    """The run key of the run whose ``RUN/snapshots`` ``root`` is (its ``run.json`` lists it), else None (also
    when that run.json is one this ckpteval refuses: a test of the refusal)."""
    from ckpteval.coord.run.identity import run_key

    try:
        manifest = RunDir(Path(root).parent).manifest()
    except (FileNotFoundError, ValueError):
        return None
    listed = {Path(r).resolve() for r in manifest.snapshot_roots}
    return run_key(manifest) if Path(root).resolve() in listed else None


def write_foreign_checkpoint(tmp: Path, path: Path, step: int) -> Path:
    """An HF Trainer style ``checkpoint-N/`` dir: model files + trainer_state.json, no marker."""
    model_writer(tmp, step)(path)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


# -- results --------------------------------------------------------------------------------------------
def results(run: RunDir) -> dict[Any, Result]:
    return dict(ResultIndex(run.results).refresh())


def duplicates(run: RunDir) -> list[dict[str, Any]]:
    d = run.results / "duplicates"
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.is_dir() else []


def lease_holder_pid(run: RunDir) -> dict[str, int]:
    """unit id -> pid of the process holding its lease (filelock's owner record, via ckpteval.coord.work.claims)."""
    return {unit: record.pid for unit, record in lease_holders(run.leases).items()}


def counted_claimers(run: RunDir, unit_id: str) -> list[int]:
    """The pids whose claims of ``unit_id`` were counted (``<unit>.attempts``), in claim order."""
    try:
        step = WorkUnit.from_id(unit_id).step
        return [int(line) for line in attempts_path(run.leases, unit_id, step).read_text().split()]
    except FileNotFoundError:
        return []


def claimed_at(result: Result) -> float:
    """Wall-clock time the result's worker started the unit (written_at minus its total time)."""
    return result.written_at - result.timings.get("total_s", 0.0)


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.05, what: str = "condition") -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := predicate():
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


# -- worker processes ---------------------------------------------------------------------------------
def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    return env


def spawn(command: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``python -m ckpteval.jobs.cli <command> <args>`` as a real process (stdout+stderr piped as text)."""
    return subprocess.Popen(
        [PYTHON, "-m", "ckpteval.jobs.cli", command, *args],
        cwd=REPO,
        env={**worker_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    """Wait for ``proc``; on timeout kill it (by its own pid) and fail loudly with its output."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"process {proc.args} did not finish in {timeout}s; output:\n{out}") from None
    return proc.returncode, out


def kill_all(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


# -- real fn backends ---------------------------------------------------------------------------------------
def safetensors_sum(checkpoint_dir: str) -> float:
    """Sum of every float tensor in the checkpoint's safetensors files (reads the real weights)."""
    from safetensors.numpy import load_file

    total = 0.0
    for path in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        for array in load_file(str(path)).values():
            total += float(array.astype("float64").sum())
    return total


def row_score(weight_sum: float, prompt: str) -> float:
    """A deterministic, prompt- and weight-dependent score in [0, 1)."""
    return (zlib.crc32(f"{weight_sum:.6e}|{prompt}".encode()) % 1000) / 1000


class SumBackend(CheckpointEvalFn):
    """Scores every row from the snapshot's safetensors sum; optional delay per unit (slow evals)."""

    def __init__(self, delay_s: float = 0.0, version_offset: int = 0) -> None:
        self.delay_s = float(os.environ.get("SUMBACKEND_DELAY_S", delay_s))  # per-process override
        self.version_offset = version_offset
        self.disposed = False

    def evaluate_checkpoint(self, checkpoint_dir: str, input: dict[str, Any]) -> dict[str, Any]:  # noqa: A002
        weight_sum = safetensors_sum(checkpoint_dir)
        end = time.monotonic() + self.delay_s
        while time.monotonic() < end:
            time.sleep(0.05)
        start, stop = input["samples"]  # this unit's samples of each row
        scores = [row_score(weight_sum, r["prompt"]) for r in input["rows"] for _ in range(start, stop)]
        version = str(input["step"] + self.version_offset)
        return {"scores": scores, "weight_versions": [version] * len(scores), "message": f"sum={weight_sum:.4f}"}

    def dispose(self) -> None:
        self.disposed = True


class SeedBackend(SumBackend):
    """A sampler whose sample is a function of its seed alone (what a seeded engine promises): each sample
    scores 1 when its seed is divisible by 3 and answers ``seed % 4`` (so maj@n has votes to count). It
    checks it got one seed per sample of the unit's range (``input["samples"]``) and reads the weights."""

    def evaluate_checkpoint(self, checkpoint_dir: str, input: dict[str, Any]) -> dict[str, Any]:  # noqa: A002
        start, stop = input["samples"]
        seeds = input["seeds"]
        if len(seeds) != len(input["rows"]) * (stop - start):
            raise ValueError(f"{len(seeds)} seeds for {len(input['rows'])} rows x samples {start}-{stop}")
        safetensors_sum(checkpoint_dir)
        return {"scores": [float(s % 3 == 0) for s in seeds], "answers": [str(s % 4) for s in seeds]}


class FlipBackend(SumBackend):
    """The scripted noisy engine of the replay tests (#29): a sample scores 1 when its row's
    :func:`row_score` on the snapshot's weights is >= 0.5, else 0 — then is flipped at random with probability
    ``flip`` per evaluation: the k-th time this process scores (step, prompt, sample) it flips when
    ``blake2b(f"{seed}:{step}:{prompt}:{sample}:{k}")`` falls in the bottom ``flip`` of its range (counted per
    process: a worker builds a backend per load). ``flip`` 0: the deterministic engine (every evaluation of a
    snapshot scores the same)."""

    seen: ClassVar[dict[tuple[int, str, int], int]] = {}

    def __init__(self, flip: float = 0.0, seed: int = 0, delay_s: float = 0.0) -> None:
        super().__init__(delay_s)
        self.flip, self.seed = flip, seed

    def evaluate_checkpoint(self, checkpoint_dir: str, input: dict[str, Any]) -> dict[str, Any]:  # noqa: A002
        weight_sum = safetensors_sum(checkpoint_dir)
        start, stop = input["samples"]
        scores = []
        for row in input["rows"]:
            for sample in range(start, stop):
                key = (input["step"], row["prompt"], sample)
                k = self.seen[key] = self.seen.get(key, -1) + 1
                base = float(row_score(weight_sum, row["prompt"]) >= 0.5)
                digest = hashlib.blake2b(f"{self.seed}:{key[0]}:{key[1]}:{sample}:{k}".encode(), digest_size=8)
                draw = int.from_bytes(digest.digest(), "big") / 2**64  # not crc32: linear, so its draws correlate
                scores.append(1.0 - base if draw < self.flip else base)
        return {"scores": scores, "weight_versions": [str(input["step"])] * len(scores)}


class AdapterMissingBackend(SumBackend):
    """Refuses every unit the way a LoRA backend does when the run's adapter is not there."""

    def evaluate_checkpoint(self, checkpoint_dir: str, input: dict[str, Any]) -> dict[str, Any]:  # noqa: A002
        raise EvalSkip("adapter_missing", f"no adapter for step {input['step']}")


class BadOutputBackend(SumBackend):
    """Returns one score too few (a backend bug the worker must record as ``crashed``)."""

    def evaluate_checkpoint(self, checkpoint_dir: str, input: dict[str, Any]) -> dict[str, Any]:  # noqa: A002
        out = super().evaluate_checkpoint(checkpoint_dir, input)
        return {"scores": out["scores"][:-1]}


def digit_overlap(completion: str, answer: str) -> float:
    """A partial-credit scorer (fraction of answer positions matched) so untrained models score > 0."""
    completion = completion.strip()
    return sum(a == b for a, b in zip(completion, answer, strict=False)) / len(answer)


def completion_hash(completion: str, answer: str) -> float:
    """A scorer that depends on the exact completion text, so equal scores mean equal generations."""
    return (zlib.crc32(completion.encode()) % 1000) / 1000


def digit_first(completion: str, answer: str) -> tuple[float, str]:
    """Full credit when the completion starts with a digit (an untrained model does so now and then); the
    extracted answer is the whole completion (so equal answers mean equal generations; maj@n votes on them)."""
    return float(completion[:1].isdigit()), completion.strip()


def run_inprocess(opts: Any, **kw: Any) -> tuple[int, Any]:
    """Build and run a worker in this process (no signal handlers); returns (exit code, worker)."""
    from ckpteval.jobs.eval.worker.main import prepare_worker

    worker = prepare_worker(opts, **kw)
    try:
        code = worker.run()
    finally:
        worker.evaluator.close()
    return code, worker


def start_serve(snapshot: Path, version: str, log: Path, timeout: float = 60.0,
                module: str = "ckpteval.jobs.cli") -> tuple[str, subprocess.Popen[str]]:
    """Launch ``python -m ckpteval.jobs.cli serve`` (the real HTTP engine) on a free port; (url, process).
    ``module``: another entry point taking the same arguments (``tests.support.stale_serve``: a buggy engine)."""
    return _start_listening(["--model", str(snapshot), "--weight-version", version], log, timeout, module)


def start_judge(mode: str, log: Path, *extra: str, timeout: float = 60.0) -> tuple[str, subprocess.Popen[str]]:
    """Launch ``python -m ckpteval.jobs.cli serve --judge MODE`` (the judge stand-in) on a free port; (its OpenAI
    base URL ``http://h:p/v1``, process)."""
    url, proc = _start_listening(["--judge", mode, *extra], log, timeout)
    return f"{url}/v1", proc


def _start_listening(args: list[str], log: Path, timeout: float,
                     module: str = "ckpteval.jobs.cli") -> tuple[str, subprocess.Popen[str]]:
    import select

    cmd = [PYTHON, "-m", module, "serve", *args, *([] if "--port" in args else ["--port", "0"])]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=worker_env(), stdout=subprocess.PIPE, stderr=err, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready and (line := proc.stdout.readline()).startswith("serving on "):
            return line.split()[-1], proc
    proc.kill()
    raise RuntimeError(f"serve did not start (rc={proc.poll()}): {log.read_text()[-2000:]}")


RELOAD: dict[str, Any] = {"url": "", "snapshot": "", "fired": False}


def reloading_scorer(completion: str, answer: str) -> float:
    """A scorer that, on its first call, has *another client* reload the server (``RELOAD["url"]``)
    under version 999 — what happens when an sglang server is shared with someone else."""
    if not RELOAD["fired"]:
        import httpx

        RELOAD["fired"] = True
        body = {"model_path": RELOAD["snapshot"], "weight_version": "999"}
        httpx.post(f"{RELOAD['url']}/update_weights_from_disk", json=body, timeout=60).raise_for_status()
    return 0.0


def scripted_run(tmp: Path, policy: Callable[..., Any], steps: tuple[int, ...], *, reasoning: dict[str, str],
                 **run: Any) -> RunDir:
    """A run (:func:`make_eval_run` with ``run``; sampled at temperature 1, seed 3, ``reasoning``) whose ``steps``
    are real tiny-model snapshots, evaluated by a real worker (``--once --engine http:``) against a
    :class:`tests.support.canned_engine.ScriptedEngine` replying by ``policy``."""
    from dataclasses import replace

    from ckpteval.coord.run.manifest import save_manifest
    from tests.support.canned_engine import ScriptedEngine

    out = make_eval_run(tmp, **run)
    manifest = out.manifest()
    spec = replace(manifest.eval.entries[0], temperature=1.0, seed=3, reasoning=reasoning)
    save_manifest(out.manifest_path, replace(manifest, eval=replace(manifest.eval, entries=(spec,))))
    for step in steps:
        publish_model(tmp, out.snapshots, step)
    with ScriptedEngine(policy) as url:
        proc = subprocess.Popen([PYTHON, "-m", "ckpteval.jobs.cli", "worker", "--run-dir", str(out.path), "--once",
                                 "--engine", f"http:{url}", "--poll-interval", "0.05"], env=worker_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        code, log = finish(proc, 240)
    if code != 0:
        raise RuntimeError(f"the worker exited {code}:\n{log}")
    return out
