"""Attestation: after a load, the engine proves which weights it holds — not only which label it wears.

Owns checking an engine's per-tensor checksums against the snapshot's (hf: computed from the files) or, for
sglang, against the checksum that stands for the snapshot (:mod:`ckpteval.coord.snapshots.weight_checksums`),
and the skips that follow (``attest_failed``, ``attest_disputed``). See docs/PROTOCOL.md §4 "Attestation" and
docs/USER_GUIDE.md "Proving which weights scored".
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckpteval.coord.results.files import Result, ResultIndex, skip_result, write_result
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.digests import compare_digests
from ckpteval.coord.snapshots.snapshot import Marker, is_adapter_snapshot, producer_identity, read_marker
from ckpteval.coord.snapshots.weight_checksums import OVERTURNED, ChecksumRecords, records_dir
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.engines.base import (
    ChecksumsWeights,
    DigestsWeights,
    Engine,
    EngineChecksum,
    EngineError,
    ServesHTTP,
    members,
)
from ckpteval.jobs.eval.skips import WorkerSkip


class AttestFailed(WorkerSkip):
    """The engine's weights are not the snapshot's (what differed is the message)."""

    reason = "attest_failed"


class AttestDisputed(AttestFailed):
    """The engine's checksum differs from another instance's load of the snapshot and none stands yet:
    which one is right needs a further independent load (the unit is left for it, never scored here)."""

    reason = "attest_disputed"


@dataclass(frozen=True)
class _Pending:
    """A consistency checksum compared with what stands, not yet recorded (:func:`settle` records it)."""

    records: ChecksumRecords
    report: EngineChecksum
    observation: dict[str, Any]
    loaded: bool
    run: RunDir


@dataclass(frozen=True)
class Attestation:
    """How a unit's weights were attested (see the module docstring): ``attested`` (compared and equal),
    ``how`` (``tensor_digests`` | ``consistency`` | ``none``), ``detail``, ``seconds`` (the engine's report
    and the comparison), ``state`` and ``by`` (which engine, instance, when, loaded by itself or adopted)."""

    attested: bool
    how: str
    detail: str
    seconds: float = 0.0
    state: str = "none"
    by: dict[str, Any] = field(default_factory=dict)
    pending: tuple[_Pending, ...] = field(default=(), repr=False, compare=False)
    members: tuple[Attestation, ...] = field(default=(), repr=False, compare=False)  # a pool's, one per engine
    checksums: tuple[tuple[str, str], ...] = ()  # consistency: (records dir name, checksum) per member

    def to_json(self) -> dict[str, Any]:
        out = {"attested": self.attested, "how": self.how, "detail": self.detail, "seconds": self.seconds,
               "state": self.state}
        if self.checksums:  # what scored the unit: a checksum that later loses has its units re-derived
            out["checksums"] = dict(self.checksums)
        return {**out, "by": dict(self.by)} if self.by else out


NOT_ATTESTED = Attestation(False, "none", "the backend reports nothing about its weights")


def attest(engine: Engine, snapshot: Path, marker: Marker, run: RunDir, *, loaded: bool = True) -> Attestation:
    """Compare every engine behind ``engine`` (each member of a pool) with ``snapshot``'s ``marker`` and
    what stands for it; records nothing (:func:`settle` does, after the canary).

    ``loaded``: whether the caller loaded the snapshot into the engine itself (from disk, in this
    process) — only such a load may become a reference. :class:`AttestFailed` when one member differs;
    else the weakest member's attestation (pending members included)."""
    t0 = time.perf_counter()
    if is_adapter_snapshot(marker.files):
        return Attestation(False, "none", "a LoRA adapter snapshot: the engine holds base + adapter, not the files")
    results = [_attest_one(e, snapshot, marker, run, loaded) for e in members(engine)]
    return _combine(results, time.perf_counter() - t0)


def settle(attestation: Attestation, *, record: bool = True) -> Attestation:
    """Decide the pending consistency checksums of ``attestation`` against the record: add each as an
    observation (when its engine loaded the snapshot itself and ``record``: the canary neither failed nor
    flagged), publish a checksum that another instance reproduced, and give the final attestation.

    :class:`AttestFailed` when a checksum differs from the one that stands; :class:`AttestDisputed` when
    it differs from every other instance's and none stands."""
    if not attestation.pending:
        return attestation
    t0 = time.perf_counter()
    members = attestation.members or (attestation,)
    for m in members:  # every member's observation first: two members of a pool witness each other
        if m.pending and m.pending[0].loaded and record:
            m.pending[0].records.observe(m.pending[0].observation)
    results = [_settle_one(m.pending[0], record) if m.pending else m for m in members]
    return _combine(results, attestation.seconds + time.perf_counter() - t0)


def attest_dir(engine: Engine, snapshot: Path, run: RunDir) -> Attestation:
    """:func:`attest` and :func:`settle` of a load the caller made (the shared posture: no canary) against
    the marker in ``snapshot``; a directory without a readable marker (a caller evaluating a bare model
    dir) is recorded as not attested (how ``none``)."""
    try:
        marker = read_marker(snapshot)
    except (FileNotFoundError, ValueError) as e:
        return Attestation(False, "none", f"no readable .complete marker to attest against: {e}")
    return settle(attest(engine, snapshot, marker, run, loaded=True))


def _combine(results: list[Attestation], seconds: float) -> Attestation:
    weakest = next((a for a in results if not a.attested), results[0])
    detail = weakest.detail if len(results) == 1 else f"{len(results)} engines: {weakest.detail}"
    pending = tuple(p for a in results for p in a.pending)
    checksums = tuple(c for a in results for c in a.checksums)
    return replace(weakest, detail=detail, seconds=seconds, pending=pending, checksums=checksums,
                   members=tuple(results) if len(results) > 1 else ())


def _provenance(engine: Any, loaded: bool, instance: str | None = None) -> dict[str, Any]:
    """Who holds the weights: the engine (a server's URL, else its class), its instance, when, and how."""
    name = engine.base_url if isinstance(engine, ServesHTTP) else type(engine).__name__
    return {"engine": str(name), "instance": instance or f"{socket.gethostname()}:{os.getpid()}",
            "loaded": "self" if loaded else "adopted", "at": time.time()}


def _attest_one(engine: Any, snapshot: Path, marker: Marker, run: RunDir, loaded: bool) -> Attestation:
    try:
        if isinstance(engine, DigestsWeights):
            return replace(_by_digests(engine, marker), by=_provenance(engine, loaded))
        if isinstance(engine, ChecksumsWeights):
            return _by_consistency(engine, engine.weights_checksum(), snapshot, marker, run, loaded)
    except EngineError as e:
        if isinstance(engine, DigestsWeights):
            raise
        return Attestation(False, "none", f"the engine did not report a checksum: {e}",
                           by=_provenance(engine, loaded))
    return replace(NOT_ATTESTED, by=_provenance(engine, loaded))


def _by_digests(engine: Any, marker: Marker) -> Attestation:
    expected = marker.tensors
    if expected is None:
        return Attestation(False, "none", "the snapshot's marker holds no tensor digests (written before them)")
    digest = "xxh3"  # every marker's tensors carry it (parse_marker): a fraction of CRC-32's cost
    report = engine.weight_digests({name: d["dtype"] for name, d in expected.items()}, digest)
    lossy = set(report.lossy)
    comparable = {n: d for n, d in expected.items() if n not in lossy}
    got = {n: v for n, v in report.digests.items() if n not in lossy and report.aliases.get(n) not in lossy}
    differences = compare_digests(comparable, got, report.aliases, digest)
    if differences:
        raise AttestFailed(f"the engine's weights are not step {marker.step}'s snapshot: {'; '.join(differences)}")
    if lossy:
        return Attestation(False, "tensor_digests", f"{len(lossy)} tensors held in a narrower dtype than the "
                           f"snapshot's (e.g. {sorted(lossy)[0]}): not comparable; {len(comparable)} others match",
                           state="incomparable")
    return Attestation(True, "tensor_digests", f"{len(comparable)} tensors match the marker's {digest} digests",
                       state="compared")


def snapshot_id(marker: Marker) -> str:
    """A short identity of a snapshot's bytes: SHA-256 over its marker's files, sizes and CRCs."""
    listing = sorted((n, f["bytes"], f["crc32"]) for n, f in marker.files.items())
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:16]


def _by_consistency(engine: Any, report: EngineChecksum, snapshot: Path, marker: Marker, run: RunDir,
                    loaded: bool) -> Attestation:
    records = ChecksumRecords(records_dir(run.weight_checksums, snapshot.name, snapshot_id(marker), report.layout))
    by = _provenance(engine, loaded, report.instance)
    standing = records.standing()
    if standing is not None and standing["checksum"] != report.checksum:
        raise AttestFailed(_differs(report, marker.step, standing))
    observation = {"step": marker.step, "snapshot": str(snapshot), "layout": report.layout,
                   "checksum": report.checksum, "tensors": report.tensors, "instance": report.instance,
                   "engine": by["engine"], "by": producer_identity(), "at": by["at"], "how": "load from disk"}
    pending = _Pending(records, report, observation, loaded, run)
    return Attestation(False, "consistency", "pending", state="pending", by=by, pending=(pending,),
                       checksums=((records.path.name, report.checksum),))


def _differs(report: EngineChecksum, step: int, standing: dict[str, Any]) -> str:
    return (f"the engine's weights checksum {report.checksum[:16]} differs from the one that stands for step "
            f"{step} (layout {report.layout}, reproduced by {len(standing.get('instances') or [])} "
            f"independent loads): {str(standing['checksum'])[:16]}")


def _settle_one(p: _Pending, record: bool) -> Attestation:
    report, layout, step = p.report, p.report.layout, p.observation["step"]
    done = Attestation(False, "consistency", "", state="reference", by=_by(p),
                       checksums=((p.records.path.name, report.checksum),))
    decision = p.records.decide(report.checksum, report.instance)
    if decision.state == "mismatch":
        raise AttestFailed(_differs(report, step, p.records.standing() or {"checksum": decision.reference}))
    if decision.state == "compared":
        return replace(done, attested=True, state="compared",
                       detail=f"equals the checksum that stands for layout {layout} (reproduced by independent loads)")
    if decision.state == "reproduced":
        if p.loaded and record:
            standing = p.records.stand(report.checksum, [report.instance, *decision.witnesses],
                                       {"step": step, "layout": layout, "by": producer_identity()})
            overturn_lost(p.run, step)  # a dispute settled: units a losing checksum scored are re-derived
            if standing["checksum"] != report.checksum:  # another checksum won the race to stand
                raise AttestFailed(_differs(report, step, standing))
        if not p.loaded:
            return replace(done, state="unverified", detail=f"the engine did not load the snapshot itself; its "
                           f"checksum matches an unconfirmed load ({decision.witnesses[0]}), layout {layout}")
        return replace(done, attested=True, state="compared", detail=f"reproduces the checksum of an independent "
                       f"load ({', '.join(decision.witnesses)}), layout {layout}: it stands")
    if decision.state == "disputed":
        who = ", ".join(decision.witnesses)
        if not p.loaded:
            raise AttestFailed(f"the engine did not load step {step} itself and its checksum {report.checksum[:16]} "
                               f"matches no load of it (layout {layout}; loaded by {who})")
        raise AttestDisputed(f"the engine's checksum {report.checksum[:16]} of step {step} differs from the one "
                             f"{who} reported (layout {layout}) and none stands yet: left for another independent "
                             "load to decide (both are recorded)")
    if not p.loaded:
        return replace(done, state="unverified", detail=f"the engine did not load the snapshot itself and no "
                       f"checksum stands for layout {layout}: nothing compared, nothing recorded")
    return replace(done, detail=f"first checksum of this snapshot for layout {layout}: nothing to compare; "
                   f"{'recorded' if record else 'not recorded (canary over its bound)'}, it stands once "
                   "an independent load reproduces it")


def overturn_lost(run: RunDir, step: int) -> list[WorkUnit]:
    """Supersede every current result of ``step`` scored by a checksum that is not the one standing for its
    snapshot and layout with an ``attest_overturned`` skip of the next generation (workers re-run such units:
    :data:`~ckpteval.coord.snapshots.weight_checksums.OVERTURNED`); the units superseded here.

    Called by whoever makes a checksum stand (after publishing it) and by a worker after publishing a result
    attested by consistency (after publishing it): of two such racing, at least one sees the other's file."""
    index = ResultIndex(run.results)
    overturned = []
    for unit, result in index.refresh(only_steps=[step]).items():
        lost = _lost_to(run, result)
        if lost is None:
            continue
        skip = skip_result(unit, OVERTURNED, f"scored by weights checksum {lost[0][:16]}, which lost: "
                           f"{lost[1][:16]} stands for step {step} ({lost[2]}); the unit is re-derived")
        if write_result(run.results, skip, index.generation(unit) + 1):
            overturned.append(unit)
    return overturned


def lost(run: RunDir, result: Result) -> bool:
    """Whether ``result`` was scored by a checksum that another now stands against (reads the standing records
    only: the cheap check before :func:`overturn_lost` reads the step's results)."""
    return _lost_to(run, result) is not None


def _lost_to(run: RunDir, result: Result) -> tuple[str, str, str] | None:
    """(the result's checksum, the one standing, the records dir) when ``result`` was scored by a checksum
    that lost; None when it stands, nothing stands yet, or the result names no checksum."""
    checksums = result.attest.get("checksums") if result.ok else None
    for name, checksum in (checksums or {}).items() if isinstance(checksums, dict) else ():
        try:
            standing = ChecksumRecords(run.weight_checksums / str(name)).standing()
        except ValueError:
            continue
        if standing is not None and standing["checksum"] != checksum:
            return str(checksum), str(standing["checksum"]), str(name)
    return None


def _by(p: _Pending) -> dict[str, Any]:
    return {"engine": p.observation["engine"], "instance": p.report.instance,
            "loaded": "self" if p.loaded else "adopted", "at": p.observation["at"]}
