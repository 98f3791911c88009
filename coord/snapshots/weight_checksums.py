"""The record behind sglang's consistency proof: per snapshot and checksum layout, every honest load's
checksum (an *observation*) and the checksum that *stands* once an independent load reproduced it.

Files (docs/PROTOCOL.md §4 "Attestation"), all under ``RUN/weight_checksums/<snapshot dir>.<snapshot id>.<layout>/``:

* ``obs.<checksum[:16]>.<instance key>.json`` — one engine instance's checksum of the snapshot after it
  loaded the snapshot from disk itself (``{"step", "snapshot", "layout", "checksum", "tensors", "instance",
  "engine", "by", "at", "how"}``). Published first-writer-wins per (checksum, instance): a reload in place on
  the same instance is the same fact, not a second witness.
* ``reference.json`` — the checksum that stands (``{"checksum", "instances", "by", "at", ...}``): published
  first-writer-wins only when observations from at least two *instances* (two servers, or two launches of
  one: sglang's ``startup_time`` tells launches apart) report the same checksum.

:func:`decide` is the one rule every reader applies: against a standing reference a checksum is
``compared`` (equal) or ``mismatch``; without one it is ``reproduced`` (another instance observed the
same: the caller publishes the reference), ``disputed`` (other instances observed only other checksums:
neither stands until a further independent load reproduces one) or ``reference`` (no other instance has
observed anything: nothing was compared).

Guarantees: a checksum stands only if two engine instances that each loaded the snapshot from disk
reported it; a file is complete before it is visible (:func:`ckpteval.coord.atomic.publish_exclusive`);
once published, a reference never changes. Limits: two instances sharing a deterministic bug (the same
buggy build on the same layout) reproduce each other; an instance key is only as independent as the
server's URL and ``startup_time`` (absent: every launch behind one URL counts as one instance; one server
reachable under two URLs counts as two); this module trusts its callers to record only loads they made
themselves and whose canary passed.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import dumps, publish_exclusive, read_json_object

REFERENCE = "reference.json"
OVERTURNED = "attest_overturned"
"""The skip that supersedes a result scored by a checksum that lost once one stood: the unit is re-run by
any worker (no flag needed), writing the next generation (:mod:`ckpteval.coord.results.files`)."""
OBSERVATION_PREFIX = "obs."


def records_dir(root: Path, snapshot_dir: str, snapshot_id: str, layout: str) -> Path:
    """``root/<snapshot dir>.<snapshot id>.<layout>/`` (the layout made filename-safe)."""
    safe = "".join(c if c.isalnum() or c in "-_+" else "_" for c in layout)
    return Path(root) / f"{snapshot_dir}.{snapshot_id}.{safe}"


def instance_key(instance: str) -> str:
    """A short, filename-safe key of an engine instance (``<url>@<startup time>``)."""
    return hashlib.sha256(instance.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Decision:
    """What a checksum is worth against the record: ``state`` (``compared`` | ``mismatch`` | ``reproduced`` |
    ``disputed`` | ``reference``), the ``reference`` checksum it was compared with (if any) and the
    ``witnesses``: instances whose observations agree (reproduced) or disagree (disputed)."""

    state: str
    reference: str | None = None
    witnesses: tuple[str, ...] = ()


class ChecksumRecords:
    """One snapshot-and-layout's observations and reference (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def standing(self) -> dict[str, Any] | None:
        """The reference that stands, or None. ValueError names a malformed file."""
        try:
            record = read_json_object(self.path / REFERENCE)
        except FileNotFoundError:
            return None
        if not isinstance(record.get("checksum"), str):
            raise ValueError(f"{self.path / REFERENCE}: no checksum")
        return record

    def observations(self) -> list[dict[str, Any]]:
        """Every observation (a malformed or vanished one is passed over: it witnesses nothing)."""
        out = []
        names = sorted(p.name for p in self.path.iterdir()) if self.path.is_dir() else []
        for name in names:
            if not (name.startswith(OBSERVATION_PREFIX) and name.endswith(".json")):
                continue
            try:
                obs = read_json_object(self.path / name)
            except (FileNotFoundError, ValueError):
                continue
            if isinstance(obs.get("checksum"), str) and isinstance(obs.get("instance"), str):
                out.append(obs)
        return out

    def observe(self, observation: dict[str, Any]) -> bool:
        """Publish ``observation`` (needs ``checksum`` and ``instance``); False if this instance already
        recorded this checksum."""
        self.path.mkdir(parents=True, exist_ok=True)
        name = f"{OBSERVATION_PREFIX}{observation['checksum'][:16]}.{instance_key(observation['instance'])}.json"
        return publish_exclusive(self.path / name, dumps(observation))

    def stand(self, checksum: str, instances: list[str], extra: dict[str, Any]) -> dict[str, Any]:
        """Publish ``checksum`` as the reference (first writer wins); the reference that stands after."""
        self.path.mkdir(parents=True, exist_ok=True)
        record = {**extra, "checksum": checksum, "instances": sorted(instances), "at": time.time()}
        publish_exclusive(self.path / REFERENCE, dumps(record))
        standing = self.standing()
        if standing is None:  # cannot happen: the name existed or was just published (never removed)
            raise FileNotFoundError(f"{self.path / REFERENCE}: vanished after publication")
        return standing

    def decide(self, checksum: str, instance: str) -> Decision:
        """:func:`decide` over this record."""
        return decide(checksum, instance, self.standing(), self.observations())


def decide(checksum: str, instance: str, standing: dict[str, Any] | None,
           observations: list[dict[str, Any]]) -> Decision:
    """The rule (see the module docstring); ``observations`` may include the caller's own."""
    if standing is not None:
        ref = str(standing["checksum"])
        return Decision("compared" if ref == checksum else "mismatch", ref)
    others = [o for o in observations if o["instance"] != instance]
    agree = sorted({o["instance"] for o in others if o["checksum"] == checksum})
    if agree:
        return Decision("reproduced", checksum, tuple(agree))
    if others:
        return Decision("disputed", None, tuple(sorted({o["instance"] for o in others})))
    return Decision("reference")


def summarize(root: Path) -> dict[str, int]:
    """Over every snapshot-and-layout record under ``root`` (``RUN/weight_checksums/``): how many have a
    checksum that ``stands`` (compared: reproduced by independent loads), how many are ``reference_only``
    (one checksum, observed by one instance: nothing compared yet) and how many are ``disputed`` (instances
    observed different checksums, none stands). Read-only; unreadable entries count as nothing."""
    counts = {"stands": 0, "reference_only": 0, "disputed": 0}
    dirs = sorted(p for p in Path(root).iterdir() if p.is_dir()) if Path(root).is_dir() else []
    for d in dirs:
        records = ChecksumRecords(d)
        try:
            standing = records.standing()
        except ValueError:
            continue
        if standing is not None:
            counts["stands"] += 1
            continue
        seen = records.observations()
        if len({o["checksum"] for o in seen}) > 1:
            counts["disputed"] += 1
        elif seen:
            counts["reference_only"] += 1
    return counts
