"""Attestation: after a load, the engine proves which weights it holds — not only which label it wears.

A version label says what an engine was *asked* to load; another client can relabel it
(``/update_weight_version``) and a buggy load can keep stale tensors under the right label. After
every load (and before the first unit of a version this evaluator did not load itself), the worker
asks the engine about its weights and compares (:func:`attest`):

* ``tensor_digests`` — an engine that digests what it holds (the in-process hf engine,
  :meth:`~ckpteval.jobs.eval.engines.hf.HFEngine.weight_digests`): every tensor cast to the snapshot's dtype,
  XXH3-64 of its bytes (CRC-32 for a marker written before XXH3), compared with the digests the
  exporter recorded in the snapshot's marker (:mod:`ckpteval.coord.digests`). Any missing, extra or different tensor fails. **Proves**: the engine holds
  bit for bit the tensors the marker lists (up to CRC-32 collisions, not a defence against forgery), so a
  stale layer, a dropped tensor, a relabelled engine or a snapshot changed after its marker is caught.
  An engine holding a narrower dtype than the file (bf16 for an F32 snapshot) cannot match: the unit
  records ``attested: false`` with the reason, it is not failed.
* ``consistency`` — an engine that reports checksums in its own layout (sglang's ``/weights_checker``
  ``checksum``: fused, sharded tensors that cannot be compared with the files): the first checksum
  recorded for this snapshot (its marker's identity) and parallel layout in
  ``RUN/weight_checksums/`` (first writer wins) is the reference; every later load, by this or any
  engine of the same layout, must reproduce it. **Proves**: all engines of one layout that scored this
  snapshot held the same weights as the first one did, and a reload reproduced them (a relabelled
  engine, a stale or dropped tensor after an honest first load, a snapshot changed between loads are
  caught). **Does not prove** that the first load was right (a bug shared by every load, or a first
  engine that was already wrong, is invisible), nor anything across layouts (tp2 vs tp1 differ by design).
* ``none`` — an engine that reports nothing (an fn backend, a foreign HTTP server without the route, a
  legacy marker without tensor digests): recorded as not attested, never failed.

A failed comparison raises :class:`AttestFailed` (skip ``attest_failed``, the message says what
differed): never a scored point. Every result records its :class:`Attestation` (``attest``).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import dumps, publish_exclusive, read_json_object
from ckpteval.coord.digests import compare_digests, digest_name
from ckpteval.coord.rundir import RunDir
from ckpteval.coord.snapshot import Marker, is_adapter_snapshot, producer_identity, read_marker
from ckpteval.jobs.eval.engines.base import Engine, EngineChecksum, EngineError
from ckpteval.jobs.eval.pinning import WorkerSkip


class AttestFailed(WorkerSkip):
    """The engine's weights are not the snapshot's (what differed is the message)."""

    reason = "attest_failed"


@dataclass(frozen=True)
class Attestation:
    """How a unit's weights were attested: ``attested`` (proven), ``how`` (``tensor_digests`` |
    ``consistency`` | ``none``), ``detail`` (what was compared, or why nothing could be) and
    ``seconds`` (the time the engine's report and the comparison took)."""

    attested: bool
    how: str
    detail: str
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


NOT_ATTESTED = Attestation(False, "none", "the backend reports nothing about its weights")


def attest(engine: Engine, snapshot: Path, marker: Marker, run: RunDir) -> Attestation:
    """Attest every engine behind ``engine`` (each member of a pool) against ``snapshot``'s ``marker``.

    :class:`AttestFailed` when one differs; else the weakest member's attestation."""
    t0 = time.perf_counter()
    if is_adapter_snapshot(marker.files):
        return Attestation(False, "none", "a LoRA adapter snapshot: the engine holds base + adapter, not the files")
    members = getattr(engine, "engines", None) or [engine]
    results = [_attest_one(e, snapshot, marker, run) for e in members]
    weakest = next((a for a in results if not a.attested), results[0])
    detail = weakest.detail if len(results) == 1 else f"{len(results)} engines: {weakest.detail}"
    return Attestation(weakest.attested, weakest.how, detail, time.perf_counter() - t0)


def attest_dir(engine: Engine, snapshot: Path, run: RunDir) -> Attestation:
    """:func:`attest` against the marker in ``snapshot``; a directory without a readable marker (a
    caller evaluating a bare model dir) is recorded as not attested (how ``none``)."""
    try:
        marker = read_marker(snapshot)
    except (FileNotFoundError, ValueError) as e:
        return Attestation(False, "none", f"no readable .complete marker to attest against: {e}")
    return attest(engine, snapshot, marker, run)


def _attest_one(engine: Any, snapshot: Path, marker: Marker, run: RunDir) -> Attestation:
    try:
        if hasattr(engine, "weight_digests"):
            return _by_digests(engine, marker)
        if hasattr(engine, "weights_checksum"):
            return _by_consistency(engine.weights_checksum(), snapshot, marker, run)
    except EngineError as e:
        if hasattr(engine, "weight_digests"):
            raise
        return Attestation(False, "none", f"the engine did not report a checksum: {e}")
    return NOT_ATTESTED


def _by_digests(engine: Any, marker: Marker) -> Attestation:
    expected = marker.tensors
    if expected is None:
        return Attestation(False, "none", "the snapshot's marker holds no tensor digests (written before them)")
    digest = digest_name(expected)  # xxh3 when the marker has it: a fraction of CRC-32's cost
    report = engine.weight_digests({name: d["dtype"] for name, d in expected.items()}, digest)
    lossy = set(report.lossy)
    comparable = {n: d for n, d in expected.items() if n not in lossy}
    got = {n: v for n, v in report.digests.items() if n not in lossy and report.aliases.get(n) not in lossy}
    differences = compare_digests(comparable, got, report.aliases, digest)
    if differences:
        raise AttestFailed(f"the engine's weights are not step {marker.step}'s snapshot: {'; '.join(differences)}")
    if lossy:
        return Attestation(False, "tensor_digests", f"{len(lossy)} tensors held in a narrower dtype than the "
                           f"snapshot's (e.g. {sorted(lossy)[0]}): not comparable; {len(comparable)} others match")
    return Attestation(True, "tensor_digests", f"{len(comparable)} tensors match the marker's {digest} digests")


def snapshot_id(marker: Marker) -> str:
    """A short identity of a snapshot's bytes: SHA-256 over its marker's files, sizes and CRCs."""
    listing = sorted((n, f["bytes"], f["crc32"]) for n, f in marker.files.items())
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:16]


def _by_consistency(report: EngineChecksum, snapshot: Path, marker: Marker, run: RunDir) -> Attestation:
    path = run.weight_checksum_path(snapshot.name, snapshot_id(marker), report.layout)
    record = {"step": marker.step, "snapshot": str(snapshot), "layout": report.layout,
              "checksum": report.checksum, "tensors": report.tensors, "by": producer_identity(), "at": time.time()}
    path.parent.mkdir(parents=True, exist_ok=True)
    if publish_exclusive(path, dumps(record)):
        return Attestation(True, "consistency", f"first checksum recorded for this snapshot, layout {report.layout}")
    first = read_json_object(path)
    if first.get("checksum") != report.checksum:
        raise AttestFailed(
            f"the engine's weights checksum {report.checksum[:16]} differs from the first one recorded for step "
            f"{marker.step} (layout {report.layout}, {path.name}): {str(first.get('checksum'))[:16]}"
        )
    return Attestation(True, "consistency", f"reproduces the first checksum recorded for layout {report.layout}")
