"""Results: the facts, one file per unit, and their index.

A *result* is one JSON file per work unit, ``results/step-<N>/<unit>.json`` (protocol 2), published first-writer-wins: the
file is written and fsync'd under a temp name, then hard-linked to the final name, which fails if a
result already exists. So readers see at most one result per unit, never a torn one, and a rare
double evaluation (a lease is not a fence) lands in ``results/duplicates/`` for audit instead.
A result holds per-sample scores, the scorer's extracted answer of each sample (``answers``, optional:
results written before it existed have none), the weight versions that produced them, how many samples
the grader gave up on (``grader_timeouts``), the scorer's per-sample ``counters`` summed and ``extras``
as ``{"sum", "n"}``, its per-sample ``notes`` when it had something to say (why a code program failed), the scorer's identity (``scorer``: what scored, e.g. a judge's model id), the engine's identity
(``engine``: :class:`~ckpteval.coord.results.engine_identity.EngineIdentity`, what it was and how it ran), how the
engine's weights were attested (``attest``), the canary's comparison (``fidelity``), what the unit cost
(``cost``: tokens, engine/load/attestation seconds, GPUs; summed per point as ``eval/cost/*``), timings,
the worker's identity, the lease token and attempt — or a skip record with a reason (and ``blame``:
``"scorer"`` when the scorer itself raised, so the skip was written at once). A unit of an ``env`` entry
also holds ``episodes``: per episode its reward, turns, tokens, the version of every turn and how it ended. A unit of an ``lm_eval`` entry holds the task's ``metrics`` instead of
per-sample scores, with the version read back before and after.

A result that carries its unit's completions (``Result.kept``, never part of its JSON) has them published beside
it by :func:`write_result` once it has won (:mod:`ckpteval.coord.results.completions`); a failure to keep them is one line
on stderr, never the result's.

Points (one step's metrics) are derived from these by :mod:`ckpteval.coord.results.points`.

**Infrastructure skips are superseded, never overwritten.** A skip whose reason is in
:data:`INFRA_SKIPS` (a judge, a sandbox, an environment server failed, an inference server shed the load —
not the unit, not the model) may be followed by a re-evaluation of the unit (``ckpteval backfill``, ``worker --retry-infra-skips``),
published first-writer-wins as ``results/<unit>.retry<k>.json`` with ``k`` one more than the generation
it supersedes. The unit's result is the one of its highest generation; earlier files stay (the record
of what failed). Every file is still written once and never changed. A skip in :data:`BACKOFF_SKIPS` (a
server shedding load) is not re-evaluated before :func:`retry_due` says so: ``backoff_s`` x 2^generation
after it was written, on the result's own clock, so every worker of a fleet waits for the same moment.

Limits: :class:`ResultIndex` caches what it has read; a result file is immutable once published, so
the cache is never stale, but a result deleted by hand stays in the cache until a new index is built.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckpteval.coord import PROTOCOL_VERSION
from ckpteval.coord.atomic import (
    dumps,
    fsync_dir,
    publish_exclusive,
    read_json_object,
    write_json_atomic,
)
from ckpteval.coord.results.engine_identity import parse_identity
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.run.rundir import DUPLICATES, step_dir_name, step_of_dir, unit_dir
from ckpteval.coord.snapshots.snapshot import producer_identity
from ckpteval.coord.work.units import WorkUnit, check_score_count, expected_scores, units_for_step

# Skips blaming a service outside the unit (judge server, sandbox, environment server): a later evaluation
# may supersede them with a result of the next generation (module docstring).
INFRA_SKIPS = frozenset({"judge_failed", "sandbox_failed", "env_failed", "overloaded"})
BACKOFF_SKIPS = frozenset({"overloaded"})  # retried only after a backoff (retry_due): the server sheds load


SCORE_BOUND = 1e15
"""The largest |score| (and |extra|) a scorer, reward, environment or backend may return: a run's sums of
millions of them stay finite (1e308 + 1e308 is inf) and exact to well below a unit."""

@dataclass(frozen=True)
class Result:
    unit: WorkUnit
    status: str  # "ok" | "skipped"
    scores: tuple[float, ...] = ()
    weight_versions: tuple[str | None, ...] = ()
    answers: tuple[str | None, ...] = ()  # the scorer's extracted answer per sample; () in old results
    grader_timeouts: int = 0
    skip_reason: str | None = None
    message: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    worker: dict[str, Any] = field(default_factory=dict)
    lease_token: str | None = None
    attempt: int = 0
    snapshot: str | None = None
    written_at: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)  # harness units: the task's metrics
    counters: dict[str, int] = field(default_factory=dict)  # the scorer's per-sample counts, summed
    extras: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> {"sum": s, "n": samples}
    scorer: dict[str, Any] = field(default_factory=dict)  # the scorer's identity() ({}: not recorded)
    blame: str | None = None  # a skip's culprit when known ("scorer": the scorer raised)
    attest: dict[str, Any] = field(default_factory=dict)  # {"attested", "how", "detail", "seconds"}; {}: not recorded
    cost: dict[str, float] = field(default_factory=dict)  # what the unit cost (tokens, engine seconds, GPUs)
    fidelity: dict[str, float] = field(default_factory=dict)  # the canary's comparison; {}: no canary
    episodes: tuple[dict[str, Any], ...] = ()  # env units: per episode reward, turns, tokens, versions, ended
    notes: tuple[str | None, ...] = ()  # per sample: why it scored so, when the scorer said (e.g. a code error)
    # the unit's completions (ckpteval.coord.results.completions.Completions), published beside the result when it wins;
    # never part of the result's JSON
    kept: Any = field(default=None, repr=False, compare=False)
    engine: dict[str, Any] = field(default_factory=dict)  # the engine's identity (coord.engine_identity); {}: none
    completions_sha256: str | None = None  # the kept completions' content digest (coord.results.completions)
    truncated: tuple[float | None, ...] = ()  # per sample: 1 cut at the length limit, 0 not, None not said; () none said

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict[str, Any]:
        return {
            "protocol": PROTOCOL_VERSION,
            "unit": self.unit.to_json(),
            "status": self.status,
            "n": len(self.scores),
            "score_sum": sum(self.scores),
            "scores": list(self.scores),
            "weight_versions": list(self.weight_versions),
            **({"answers": list(self.answers)} if self.answers else {}),
            "grader_timeouts": self.grader_timeouts,
            "skip_reason": self.skip_reason,
            "message": self.message,
            "timings": self.timings,
            "worker": self.worker,
            "lease_token": self.lease_token,
            "attempt": self.attempt,
            "snapshot": self.snapshot,
            "written_at": self.written_at,
            **({"metrics": self.metrics} if self.metrics else {}),
            **({"counters": self.counters} if self.counters else {}),
            **({"extras": self.extras} if self.extras else {}),
            **({"scorer": self.scorer} if self.scorer else {}),
            **({"blame": self.blame} if self.blame else {}),
            **({"attest": self.attest} if self.attest else {}),
            **({"cost": self.cost} if self.cost else {}),
            **({"completions_sha256": self.completions_sha256} if self.completions_sha256 else {}),
            **({"fidelity": {k: v if math.isfinite(v) else None for k, v in self.fidelity.items()}}
               if self.fidelity else {}),  # null: infinite (the canary's token ids differed), never bare
            **({"episodes": list(self.episodes)} if self.episodes else {}),
            **({"notes": list(self.notes)} if self.notes else {}),
            **({"engine": self.engine} if self.engine else {}),
            **({"truncated": list(self.truncated)} if self.truncated else {}),
        }


def ok_result(
    unit: WorkUnit,
    scores: list[float],
    versions: list[str | None],
    answers: list[str | None] | None = None,
    **kw: Any,
) -> Result:
    if len(scores) != len(versions):
        raise ValueError(f"unit {unit.id}: {len(scores)} scores but {len(versions)} weight versions")
    if answers is not None and len(answers) != len(scores):
        raise ValueError(f"unit {unit.id}: {len(scores)} scores but {len(answers)} extracted answers")
    return Result(unit, "ok", tuple(scores), tuple(versions), tuple(answers or ()), **kw)


def harness_result(unit: WorkUnit, metrics: dict[str, float], versions: list[str | None], **kw: Any) -> Result:
    """An lm-eval task's unit: its metrics, and the engine's version read back before and after it.

    lm-eval's adapters do not report a version per sample, so ``weight_versions`` holds the unit's
    read-backs (no ``scores``); the pin check around the unit is what makes them the unit's version.
    """
    if not metrics or not versions:
        raise ValueError(f"unit {unit.id}: a harness result needs metrics and the versions read back")
    return Result(unit, "ok", (), tuple(versions), metrics=dict(metrics), **kw)


def _parse_metrics(obj: Any, source: Path) -> dict[str, float]:
    """The optional ``metrics`` object of a result: metric name -> number."""
    raw = obj.get("metrics") or {}
    if not isinstance(raw, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool) for k, v in raw.items()
    ):
        raise ValueError(f"{source}: field metrics must be an object of metric name -> number")
    return {k: float(v) for k, v in raw.items()}


def skip_result(unit: WorkUnit, reason: str, message: str = "", **kw: Any) -> Result:
    if not reason or not reason.replace("_", "").isalnum():
        raise ValueError(f"skip reason {reason!r} must be a non-empty identifier (it becomes a metric name)")
    return Result(unit, "skipped", skip_reason=reason, message=message, **kw)


def parse_result(obj: Any, source: Path) -> Result:
    """Validate a decoded result; ValueError names the file and field."""
    if not isinstance(obj, dict):
        raise ValueError(f"{source}: result must be a JSON object")
    try:
        u = obj["unit"]
        unit = WorkUnit.from_json(u)
        status = obj["status"]
        scores = tuple(float(s) for s in obj.get("scores", ()))
        versions = tuple(None if v is None else str(v) for v in obj.get("weight_versions", ()))
        answers = tuple(None if a is None else str(a) for a in obj.get("answers") or ())
        grader_timeouts = int(obj.get("grader_timeouts", 0))
        counters = {str(k): int(v) for k, v in (obj.get("counters") or {}).items()}
        extras = {str(k): {"sum": float(v["sum"]), "n": int(v["n"])} for k, v in (obj.get("extras") or {}).items()}
        scorer = dict(obj.get("scorer") or {})
        attest = dict(obj.get("attest") or {})
        cost = {str(k): float(v) for k, v in (obj.get("cost") or {}).items()}
        fidelity = {str(k): math.inf if v is None else float(v) for k, v in (obj.get("fidelity") or {}).items()}
        episodes = tuple(dict(e) for e in obj.get("episodes") or ())
        notes = tuple(None if n is None else str(n) for n in obj.get("notes") or ())
        truncated = tuple(None if c is None else float(c) for c in obj.get("truncated") or ())
        engine = dict(obj.get("engine") or {})
        parse_identity(engine)  # a malformed identity is a malformed result, never pooled as "none"
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{source}: malformed result ({type(e).__name__}: {e})") from None
    if status not in {"ok", "skipped"}:
        raise ValueError(f"{source}: field status must be 'ok' or 'skipped', got {status!r}")
    if status == "skipped" and not obj.get("skip_reason"):
        raise ValueError(f"{source}: a skipped result needs a skip_reason")
    metrics = _parse_metrics(obj, source)
    if len(scores) != len(versions) and not (metrics and not scores):  # harness: versions read back per unit
        raise ValueError(f"{source}: {len(scores)} scores but {len(versions)} weight_versions")
    if answers and len(answers) != len(scores):
        raise ValueError(f"{source}: {len(scores)} scores but {len(answers)} answers")
    if notes and len(notes) != len(scores):
        raise ValueError(f"{source}: {len(scores)} scores but {len(notes)} notes")
    if truncated and (len(truncated) != len(scores) or any(c not in (0.0, 1.0, None) for c in truncated)):
        raise ValueError(f"{source}: field truncated must be one of 0, 1 or null per score ({len(scores)})")
    return Result(
        unit=unit,
        status=status,
        scores=scores,
        weight_versions=versions,
        answers=answers,
        grader_timeouts=grader_timeouts,
        skip_reason=obj.get("skip_reason"),
        message=str(obj.get("message", "")),
        timings=dict(obj.get("timings") or {}),
        worker=dict(obj.get("worker") or {}),
        lease_token=obj.get("lease_token"),
        attempt=int(obj.get("attempt", 0)),
        snapshot=obj.get("snapshot"),
        written_at=float(obj.get("written_at", 0.0)),
        metrics=metrics,
        counters=counters,
        extras=extras,
        scorer=scorer,
        blame=obj.get("blame"),
        attest=attest,
        cost=cost,
        fidelity=fidelity,
        episodes=episodes,
        notes=notes,
        truncated=truncated,
        engine=engine,
        completions_sha256=obj["completions_sha256"] if isinstance(obj.get("completions_sha256"), str) else None,
    )


def write_result(results_dir: Path, result: Result, generation: int = 0) -> bool:
    """Publish a unit's result of ``generation`` (0, or k > 0 superseding an infrastructure skip of k - 1);
    True if it is *the* result of that generation, False if one existed (kept as duplicate).

    It goes in ``results/step-<N>/``, created (and made durable) by the first result of the step."""
    results_dir = Path(results_dir)
    if result.kept is not None:  # bound to the text it was scored from (a worker has coord.completions loaded)
        from ckpteval.coord.results.completions import content_digest

        result = replace(result, completions_sha256=content_digest(result.kept))
    stamped = stamp(result)
    data = dumps(stamped.to_json())
    final = unit_dir(results_dir, result.unit.step) / result.unit.result_name_at(generation)
    try:
        won = publish_exclusive(final, data, keep_dir_open=True)
    except FileNotFoundError:  # the step's first result: its directory first (a missing results/ still raises)
        if not results_dir.is_dir():
            raise
        final.parent.mkdir(exist_ok=True)
        fsync_dir(results_dir)
        won = publish_exclusive(final, data, keep_dir_open=True)
    if won:
        if result.kept is not None:
            # whoever built ``kept`` (a worker) has coord.completions loaded; a trainer never needs it
            from ckpteval.coord.results.completions import keep_beside

            keep_beside(results_dir, result.kept, generation, stamped.lease_token, len(result.scores))
        return True
    dup_dir = results_dir / DUPLICATES
    dup_dir.mkdir(exist_ok=True)
    write_json_atomic(dup_dir / f"{result.unit.id}.{os.getpid()}.{time.time_ns()}.json", stamped.to_json())
    return False


def stamp(result: Result) -> Result:
    """The result as published: ``written_at`` (now) and ``worker`` (this process) filled in if unset."""
    if result.written_at and result.worker:
        return result
    stamped = Result(**{**result.__dict__, "written_at": result.written_at or time.time()})
    return stamped if stamped.worker else Result(**{**stamped.__dict__, "worker": producer_identity()})


def result_names(directory: Path) -> list[str]:
    """The result file names in one directory, in listing order (one listing; FileNotFoundError if it is gone):
    ``*.json``, not temporary (``TMP_PREFIX``) or private (any name starting with ``.``)."""
    return [n for n in os.listdir(directory) if n.endswith(".json") and not n.startswith(".")]


def result_generation(name: str) -> int:
    """The generation of a result file name: ``<unit>.json`` is 0, ``<unit>.retry<k>.json`` is k (a name
    relative to ``results/`` may carry its step directory)."""
    name = name.rsplit("/", 1)[-1]
    stem = name[: -len(".json")] if name.endswith(".json") else name
    tail = stem.rsplit(".", 1)[-1]
    return int(tail[len("retry"):]) if tail.startswith("retry") and tail[len("retry"):].isdigit() else 0


def retry_due(result: Result, generation: int, backoff_s: float, now: float | None = None) -> bool:
    """Whether an infrastructure skip (``result``, of ``generation``) may be re-evaluated now: at once,
    except a :data:`BACKOFF_SKIPS` one, ``backoff_s * 2**generation`` seconds after it was written."""
    if result.skip_reason not in BACKOFF_SKIPS:
        return True
    return (time.time() if now is None else now) >= result.written_at + backoff_s * 2**generation


class ResultIndex:
    """Reads ``results/step-<N>/`` incrementally (:mod:`ckpteval.coord.run.rundir`): one listing of ``results/`` per
    refresh (none with ``only_steps``) plus one per step directory not in ``skip_steps``, each result file read
    once. A ``*.json`` directly under ``results/`` is no result (protocol 2 keeps none there).

    Malformed result files are not trusted and not fatal to readers: they are collected in
    :attr:`errors` (name relative to ``results/`` → message) so status can show them, and the unit counts
    as unfinished. With the run's ``manifest``, an ok result of a per-sample entry whose number of scores is
    not its unit's (:func:`~ckpteval.coord.work.units.expected_scores`) is malformed too: pooled, its samples
    would move across prompts.
    """

    def __init__(self, results_dir: Path, manifest: RunManifest | None = None) -> None:
        self.results_dir = Path(results_dir)
        self.manifest = manifest
        self._by_unit: dict[WorkUnit, Result] = {}
        self._by_step: dict[int, dict[WorkUnit, Result]] = {}
        self._generation: dict[WorkUnit, int] = {}
        self._seen: dict[str, set[str]] = {}  # step directory under results/ -> its result names read
        self._misplaced: set[str] = set()  # step directories holding a result of another step's unit
        self.errors: dict[str, str] = {}

    def refresh(self, skip_steps: Collection[int] = (), only_steps: Collection[int] | None = None) -> dict[WorkUnit, Result]:
        """Read what is new. ``skip_steps``: steps whose directory is not listed again (a caller that has
        settled them: on Lustre a listing is a round trip per directory block). ``only_steps``: list just
        these steps' directories, not ``results/`` itself, which holds a name per step."""
        for directory, base in self._names(skip_steps, only_steps):
            seen = self._seen.setdefault(directory, set())
            if base in seen:
                continue
            name = f"{directory}/{base}"
            path = self.results_dir / name
            try:
                result = self._checked(parse_result(read_json_object(path), path), path)
            except (ValueError, FileNotFoundError) as e:
                self.errors[name] = str(e)
                continue
            self._take(directory, base, result)
        return self._by_unit

    def publish(self, result: Result, generation: int = 0) -> bool:
        """:func:`write_result`, and the published result goes into the index as written, so the next
        :meth:`refresh` does not read it back (one open per unit less for a worker). False (a duplicate):
        the first writer's result is read by the next refresh as usual."""
        stamped = stamp(result)
        if not write_result(self.results_dir, stamped, generation):
            return False
        directory, base = step_dir_name(result.unit.step), result.unit.result_name_at(generation)
        path = self.results_dir / directory / base
        try:  # published, so every reader with the manifest refuses it: so does this index
            self._take(directory, base, self._checked(parse_result(json.loads(dumps(stamped.to_json())), path), path))
        except ValueError as e:
            self.errors[f"{directory}/{base}"] = str(e)
        return True

    def _checked(self, result: Result, source: Path) -> Result:
        """``result``, or ValueError naming ``source`` when it is ok but carries a number of scores other than
        its unit's (known only with the manifest; a unit of a dataset the run lacks is not checked)."""
        if self.manifest is None or not result.ok:
            return result
        try:
            expected = expected_scores(self.manifest, result.unit)
        except KeyError:
            return result
        if expected is not None and len(result.scores) != expected:
            try:
                check_score_count(self.manifest.entry(result.unit.dataset), result.unit, len(result.scores))
            except ValueError as e:
                raise ValueError(f"{source}: {e}") from None
        return result

    def _take(self, directory: str, base: str, result: Result) -> None:
        """Index one result read (or published) as ``directory/base`` under ``results/``."""
        self._seen.setdefault(directory, set()).add(base)
        name = f"{directory}/{base}"
        self.errors.pop(name, None)
        if step_of_dir(directory) != result.unit.step:
            self._misplaced.add(directory)
        generation = result_generation(name)
        if generation >= self._generation.get(result.unit, 0):  # the highest generation is the result
            self._by_unit[result.unit] = result
            self._by_step.setdefault(result.unit.step, {})[result.unit] = result
            self._generation[result.unit] = generation

    def _names(self, skip_steps: Collection[int], only_steps: Collection[int] | None) -> list[tuple[str, str]]:
        """Result files as (step directory under ``results/``, name): ``("step-<N>", "<unit>.json")``."""
        names: list[tuple[str, str]] = []
        if only_steps is not None:
            dirs = [step_dir_name(s) for s in sorted(only_steps) if s not in skip_steps]
        else:
            try:
                top = list(os.scandir(self.results_dir))
            except FileNotFoundError:
                return []
            dirs = [e.name for e in top if (s := step_of_dir(e.name)) is not None and s not in skip_steps and e.is_dir()]
        for d in dirs:
            try:
                names += [(d, n) for n in result_names(self.results_dir / d)]
            except (FileNotFoundError, NotADirectoryError):
                continue
        return names

    def step_read(self, step: int) -> tuple[frozenset[str], dict[WorkUnit, Result]] | None:
        """What this index has read of ``results/step-<N>/``: its result names and the results of the step's
        units — None when that is not the whole story (a malformed file there, or a result of another step's
        unit there)."""
        directory = step_dir_name(step)
        prefix = f"{directory}/"
        if directory in self._misplaced or any(n.startswith(prefix) for n in self.errors):
            return None
        return frozenset(self._seen.get(directory, ())), dict(self._by_step.get(step, {}))

    def get(self, unit: WorkUnit) -> Result | None:
        return self._by_unit.get(unit)

    def generation(self, unit: WorkUnit) -> int:
        """The generation of the unit's current result (0 when it has none or only the first)."""
        return self._generation.get(unit, 0)

    def for_step(self, step: int) -> dict[WorkUnit, Result]:
        return dict(self._by_step.get(step, {}))

    def steps(self) -> set[int]:
        return set(self._by_step)


def write_point_skip(results_dir: Path, manifest: RunManifest, step: int, reason: str, message: str = "") -> None:
    """Record a whole point as skipped (trainer-side reasons: busy, export_failed): one skip per unit."""
    for unit in units_for_step(manifest, step):
        write_result(results_dir, skip_result(unit, reason, message))
