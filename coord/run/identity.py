"""Run identity: which run a snapshot, an engine's loaded weights and a result belong to.

Owns the *run key* and the *weight version* strings. Several runs may share one staging dir (a
node's ``/dev/shm/ckpteval``, one Lustre scratch dir) and one inference server; the step number alone
cannot tell their snapshots or loaded weights apart, so:

- :func:`run_key` is ``<run_id>-<8 hex>``: the run id plus a CRC-32 of the run id and the manifest's
  ``created`` time. Two runs with one ``run_id`` (two ``demo`` run dirs) get different keys as long as
  they were created at different times (the trainer stamps ``time.time()``).
- :func:`weight_version` is ``<run_key>@<step>``: what a worker stamps an engine with when it loads a
  step's snapshot, and what every sample must carry. An engine shared by two runs' workers thus never
  passes run B's pin while it holds run A's weights of the same step.
- :func:`version_step` reads the step back from either form (``<key>@<step>`` or a legacy/fn-backend
  plain ``<step>``); :func:`version_run` the key (None for the plain form).

Guarantee: keys and versions are pure functions of run.json, identical on every node. Limits: two runs
with the same ``run_id`` *and* the same ``created`` time (hand-written manifests that leave ``created``
at 0) share a key; ``ckpteval train`` and the service always stamp ``created``.
"""

from __future__ import annotations

import zlib

from ckpteval.coord.run.manifest import RunManifest

VERSION_SEP = "@"


def run_key(manifest: RunManifest) -> str:
    """``<run_id>-<crc32 of run_id and created, 8 hex>``: the run's identity in markers and versions."""
    digest = zlib.crc32(f"{manifest.run_id}\0{manifest.created!r}".encode())
    return f"{manifest.run_id}-{digest:08x}"


def snapshots_key(manifest: RunManifest) -> str:
    """The run key the markers under ``manifest``'s own ``snapshot_roots`` carry: the run's own, or for a
    re-evaluation (its ``trainer.from_run_key``) the key of the run whose snapshots it evaluates."""
    source = manifest.trainer.get("from_run_key")
    return source if isinstance(source, str) and source else run_key(manifest)


def weight_version(key: str, step: int) -> str:
    """The version an engine is stamped with for ``step`` of the run ``key``."""
    return f"{key}{VERSION_SEP}{step}"


def version_step(version: str | None) -> int | None:
    """The step a version names (``<key>@<step>`` or plain ``<step>``), or None if it names none."""
    if version is None:
        return None
    tail = version.rpartition(VERSION_SEP)[2]
    return int(tail) if tail.isdigit() else None


def version_run(version: str | None) -> str | None:
    """The run key a version names; None for a plain (legacy or fn-backend) version."""
    if version is None or VERSION_SEP not in version:
        return None
    return version.rpartition(VERSION_SEP)[0]


MIXED_SEP = "|"  # a sample produced across a weight update: its versions joined, e.g. "3|4" (PROTOCOL.md)


def version_runs(version: str | None) -> set[str]:
    """The run keys of every version a sample names (one, or several for a mixed ``a|b`` sample)."""
    if version is None:
        return set()
    return {r for part in version.split(MIXED_SEP) if (r := version_run(part)) is not None}


def version_matches(version: str | None, key: str, step: int) -> bool:
    """Whether a sample's version is this run's ``step``: ``<key>@<step>``, or a plain ``<step>``.

    The plain form is what fn backends (handed an explicit snapshot path per unit, no shared state)
    and results written before run identity carry.
    """
    return version in {weight_version(key, step), str(step)}


__all__ = ["MIXED_SEP", "run_key", "snapshots_key", "version_matches", "version_run", "version_runs", "version_step", "weight_version"]
