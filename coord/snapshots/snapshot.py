"""Snapshots: HF model directories published atomically and marked ``.complete``.

A snapshot is a directory ``AutoModelForCausalLM.from_pretrained`` can load (config.json, safetensors
shards + index, tokenizer files) plus a ``.complete`` JSON marker written *last*: step, weight_version,
every file with its byte size and CRC-32, producer, time, and ``run``: the key of the run whose trainer
wrote it (:mod:`ckpteval.coord.run.identity`; absent: no run's). Older formats (another ``protocol``, tensor
digests without ``xxh3``) are refused when read, in one line naming the file and what it has.

Guarantees:
- :func:`publish_snapshot` writes into a hidden temp dir (``.tmp-*``), fsyncs every file, writes the
  marker last, then renames the dir to ``step-<step>`` and fsyncs the root. A crash at any point
  leaves either nothing under the final name or a complete snapshot; discovery ignores ``.tmp-*``.
- :func:`mark_complete` turns an existing directory (a trainer's periodic HF checkpoint, reuse mode)
  into a snapshot by writing the marker into it atomically, after its files are durable.
- :func:`verify_snapshot` ``fast`` checks the marker, every listed file's presence and size, and parses
  every safetensors header (offsets inside the file); ``full`` also recomputes checksums. It checks
  what the marker lists, never that a model's config.json is there, so a LoRA adapter snapshot
  (``adapter_config.json`` + ``adapter_model.safetensors``, no config.json) verifies like any other.

Why CRC-32 (zlib): it detects truncation, torn or bit-flipped pages at ≈3.8 GB/s vs ≈1.6 for SHA-256
(tmpfs writes ≈2 GB/s; bench/RESULTS.md), so checksumming while writing does not halve export speed; no
defence against a malicious writer. Limits: ``fast`` verification misses a bit flip in tensor data.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpteval.coord import PROTOCOL_VERSION
from ckpteval.coord.atomic import TMP_PREFIX, fsync_dir, read_json_object, tmp_name, write_json_atomic
from ckpteval.coord.run.identity import weight_version
from ckpteval.coord.snapshots.digests import TensorDigest, safetensors_digests

MARKER = ".complete"
# A LoRA adapter snapshot (run.json names ``eval.base_model``): PEFT's names, which sglang's loader reads
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The canary a trainer may store with a snapshot (ckpteval.jobs.eval.proof.canary): teacher-forced log-probs of a probe.
CANARY = "canary.json"
CHUNK = 8 << 20
FileInfo = dict[str, Any]  # {"bytes": n, "crc32": c} (+ "tensors": {name: TensorDigest} for a safetensors file)


class SnapshotError(RuntimeError):
    """A snapshot cannot be used; ``reason`` is the skip reason the worker records."""

    reason = "ckpt_corrupt"

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


class SnapshotMissing(SnapshotError):
    reason = "ckpt_missing"


class SnapshotCorrupt(SnapshotError):
    reason = "ckpt_corrupt"


@dataclass(frozen=True)
class Marker:
    step: int
    weight_version: str
    files: dict[str, FileInfo]
    producer: dict[str, Any]
    mode: str  # staging | reuse | foreign
    created: float
    run: str | None = None  # run key (ckpteval.coord.run.identity) of the run that wrote it; None: no run's

    @property
    def total_bytes(self) -> int:
        return sum(f["bytes"] for f in self.files.values())

    @property
    def tensors(self) -> dict[str, TensorDigest] | None:
        """Every tensor's digest with its ``file``; None unless every safetensors file lists them (a writer
        that reported file checksums only: nothing to attest against)."""
        shards = {n: f for n, f in self.files.items() if n.endswith(".safetensors")}
        if not shards or any(not isinstance(f.get("tensors"), dict) for f in shards.values()):
            return None
        return {t: {**d, "file": n} for n, f in shards.items() for t, d in f["tensors"].items()}

    def to_json(self) -> dict[str, Any]:
        return {"protocol": PROTOCOL_VERSION, "step": self.step, "weight_version": self.weight_version,
                "checksum": "crc32", "files": self.files, "producer": self.producer, "mode": self.mode,
                "created": self.created, **({"run": self.run} if self.run is not None else {})}


# -- location rules: the one place that builds or parses a snapshot directory's name ----------------
SNAPSHOT_PREFIX = "step-"
CHECKPOINT_PREFIX = "checkpoint-"
TRAILING_DIGITS = re.compile(r"(\d+)$")


def snapshot_dirname(step: int) -> str:
    """A staging snapshot (or reference training checkpoint): ``step-<10 digits>``, so names sort by step."""
    return f"{SNAPSHOT_PREFIX}{step:010d}"


def checkpoint_dirname(step: int) -> str:
    """Reuse mode: the trainer's periodic HF checkpoint of ``step``, named as HF Trainer names it."""
    return f"{CHECKPOINT_PREFIX}{step}"


def snapshot_path(root: Path, step: int, mode: str) -> Path:
    """Where the snapshot of ``step`` lives under ``root``: a ``reuse`` checkpoint or a staging export."""
    return Path(root) / (checkpoint_dirname(step) if mode == "reuse" else snapshot_dirname(step))


def step_from_name(path: Path) -> int | None:
    """The step a dir name says: its trailing digits (``step-0000000100``, ``checkpoint-100``), if any."""
    m = TRAILING_DIGITS.search(Path(path).name)
    return int(m.group(1)) if m else None


def producer_identity() -> dict[str, Any]:
    """Who wrote a snapshot or result: host, pid and any scheduler ids found in the environment."""
    ident: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid()}
    for key in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_PROCID", "SLURM_HET_SIZE"):
        if key in os.environ:
            ident[key.lower()] = os.environ[key]
    return ident


# -- checksums ---------------------------------------------------------------------------------------
def file_info(path: Path) -> FileInfo:
    """Size and CRC-32 of a file, read in chunks."""
    crc, n = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
            n += len(chunk)
    return {"bytes": n, "crc32": crc}


EVAL_FILE_SUFFIXES = (".safetensors", ".json", ".model", ".txt", ".jinja", ".tiktoken")
TRAINER_STATE_FILES = frozenset({"trainer_state.json"})


def is_eval_file(name: str) -> bool:
    """Whether a checkpoint file is one eval loads: a *top-level* config, tokenizer, chat template,
    weights or weight-index file. Not: a trainer's ``global_stepN/`` optimizer shards, ``latest``,
    ``rng_state*.pth``, ``optimizer.pt``, ``scheduler.pt``, ``training_args.bin``, ``trainer_state.json``."""
    return "/" not in name and name.endswith(EVAL_FILE_SUFFIXES) and name not in TRAINER_STATE_FILES


def _snapshot_files(directory: Path, eval_only: bool = False) -> list[str]:
    """Every regular file of a snapshot, relative, excluding the marker and temp names (and, with
    ``eval_only``, every file :func:`is_eval_file` rejects)."""
    names = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = [] if eval_only else [d for d in dirs if not d.startswith(TMP_PREFIX)]
        for name in files:
            if name == MARKER or name.startswith(TMP_PREFIX):
                continue
            rel = os.path.relpath(os.path.join(root, name), directory)
            if not eval_only or is_eval_file(rel):
                names.append(rel)
    return sorted(names)


def _fsync_tree(directory: Path, names: list[str]) -> None:
    for name in names:
        fd = os.open(directory / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for sub in {Path(n).parent for n in names}:
        fsync_dir(directory / sub)


def describe_files(
    directory: Path, known: Mapping[str, FileInfo] | None, *, eval_only: bool = False
) -> dict[str, FileInfo]:
    """Size and CRC-32 of every file (``eval_only``: of every file eval loads, see :func:`is_eval_file`).

    FileNotFoundError if a file vanishes while it is read (a rotated checkpoint)."""
    infos = {}
    for name in _snapshot_files(directory, eval_only):
        info = (known or {}).get(name)
        infos[name] = dict(info) if info is not None else _describe(directory / name)
    return infos


def _describe(path: Path) -> FileInfo:
    """A file's size and CRC-32; a safetensors file's tensor digests too, from the same single read (an
    unparsable one gets its checksum only: verification reports it)."""
    if path.name.endswith(".safetensors"):
        try:
            info, tensors = safetensors_digests(path)
            return {**info, "tensors": tensors}
        except ValueError:
            pass
    return file_info(path)


# -- publishing ---------------------------------------------------------------------------------------
def publish_snapshot(
    root: Path,
    step: int,
    write_files: Callable[[Path], Mapping[str, FileInfo] | None],
    *,
    producer: dict[str, Any] | None = None,
    run: str | None = None,
) -> Path:
    """Publish a staging snapshot of ``step`` under ``root``; returns its final path.

    ``write_files(tmp_dir)`` writes the model files and may return their ``FileInfo`` (computed while
    writing, so nothing is read twice); files it does not report are checksummed here. Idempotent: if
    a complete snapshot of the same step already exists (a requeued trainer re-exporting), it is kept
    and the new copy discarded — only if it is this ``run``'s: another run's snapshot under the name
    (two runs sharing a flat staging root) is ``FileExistsError``, never adopted and never replaced.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / snapshot_dirname(step)
    tmp = tmp_name(final)
    tmp.mkdir()
    try:
        infos = describe_files(tmp, write_files(tmp))
        _fsync_tree(tmp, list(infos))
        marker = Marker(
            step, _marker_version(run, step), infos, producer or producer_identity(), "staging", time.time(), run
        )
        write_json_atomic(tmp / MARKER, marker.to_json())
        if (final / MARKER).exists():
            existing = read_marker(final)  # raises if the existing one is not a valid snapshot
            if final.is_symlink() or existing.step != step or existing.run != run:
                raise FileExistsError(f"{final}: occupied by something that is not this run's step {step} snapshot")
            shutil.rmtree(tmp)
            return final
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(root)
    return final


def mark_complete(
    directory: Path,
    step: int,
    *,
    known: Mapping[str, FileInfo] | None = None,
    producer: dict[str, Any] | None = None,
    mode: str = "reuse",
    run: str | None = None,
) -> Marker:
    """Mark an existing checkpoint dir as a snapshot of ``step`` of ``run`` (reuse mode); returns the marker.

    The marker covers exactly the files eval loads (:func:`is_eval_file`): a trainer's optimizer shards
    and RNG/trainer state, written around the weights, are neither checksummed nor verified."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: checkpoint directory does not exist")
    infos = describe_files(directory, known, eval_only=True)
    _fsync_tree(directory, list(infos))
    marker = Marker(step, _marker_version(run, step), infos, producer or producer_identity(), mode, time.time(), run)
    write_json_atomic(directory / MARKER, marker.to_json())
    return marker


def _marker_version(run: str | None, step: int) -> str:
    return str(step) if run is None else weight_version(run, step)


# -- reading -----------------------------------------------------------------------------------------
def parse_marker(obj: Any, source: Path) -> Marker:
    """Validate a decoded marker; ValueError names the file and field."""
    if not isinstance(obj, dict):
        raise ValueError(f"{source}: marker must be a JSON object")
    if obj.get("protocol") != PROTOCOL_VERSION:
        raise ValueError(f"{source}: marker protocol {obj.get('protocol')!r}: this ckpteval reads only protocol "
                         f"{PROTOCOL_VERSION} markers (an older format: export or mark the snapshot again)")

    def need(key: str, kind: type | tuple[type, ...]) -> Any:
        if key not in obj:
            raise ValueError(f"{source}: marker field {key} is missing")
        value = obj[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"{source}: marker field {key} has the wrong type ({type(value).__name__})")
        return value

    step = need("step", int)
    if step < 0:
        raise ValueError(f"{source}: marker field step must be >= 0")
    files = need("files", dict)
    for name, info in files.items():
        ok = isinstance(info, dict) and all(_is_count(info.get(k)) for k in ("bytes", "crc32"))
        if not ok or os.path.isabs(name) or ".." in Path(name).parts or not _valid_tensors(info.get("tensors")):
            raise ValueError(f"{source}: marker field files[{name!r}] is invalid")
        if any("xxh3" not in d for d in (info.get("tensors") or {}).values()):
            raise ValueError(f"{source}: marker field files[{name!r}] has tensor digests without xxh3, an older "
                             "format (written before XXH3): export or mark the snapshot again")
    return Marker(
        step=step,
        weight_version=need("weight_version", str),
        files=files,
        producer=need("producer", dict),
        mode=need("mode", str),
        created=float(need("created", (int, float))),
        run=_optional_run(obj, source),
    )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _valid_tensors(tensors: Any) -> bool:
    """A file's optional ``tensors``: name -> {"dtype": str, "shape": [int], "crc32": int, "xxh3": int}."""
    if tensors is None:
        return True
    return isinstance(tensors, dict) and all(
        isinstance(d, dict) and isinstance(d.get("dtype"), str) and _is_count(d.get("crc32"))
        and ("xxh3" not in d or _is_count(d["xxh3"]))
        and isinstance(d.get("shape"), list) and all(_is_count(x) for x in d["shape"])
        for d in tensors.values()
    )


def _optional_run(obj: dict[str, Any], source: Path) -> str | None:
    run = obj.get("run")
    if run is not None and (not isinstance(run, str) or not run):
        raise ValueError(f"{source}: marker field run must be a non-empty string")
    return run


def read_marker(directory: Path) -> Marker:
    """The marker of a snapshot dir; FileNotFoundError if absent, ValueError if malformed."""
    path = Path(directory) / MARKER
    return parse_marker(read_json_object(path), path)


def check_safetensors_header(path: Path, size: int) -> None:
    """Parse a safetensors header and check every tensor's data lies inside the file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SnapshotCorrupt(path, "safetensors file shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise SnapshotCorrupt(path, f"safetensors header length {n} does not fit the file")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SnapshotCorrupt(path, f"safetensors header is not JSON ({e})") from None
    data_len = size - 8 - n
    end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1] <= data_len):
            raise SnapshotCorrupt(path, f"tensor {name!r} lies outside the file ({offsets}, data {data_len} B)")
        end = max(end, offsets[1])
    if end != data_len:
        raise SnapshotCorrupt(path, f"tensor data ends at {end} but the file holds {data_len} data bytes")


def is_adapter_snapshot(files: Mapping[str, Any]) -> bool:
    """Whether a snapshot's file list is a LoRA adapter's (it names :data:`ADAPTER_WEIGHTS`)."""
    return ADAPTER_WEIGHTS in files


class VerifiedSnapshots:
    """:func:`verify_snapshot` once per snapshot per process: a snapshot that passed is not checked again
    while its ``.complete`` marker file keeps its identity (device, inode, size, mtime) — one ``stat`` per
    unit instead of the marker read, a ``stat`` per file and a header read per safetensors file (metadata
    round trips on Lustre; ``full`` re-reads every byte). A re-published or re-marked snapshot has a new
    marker (written by rename: a new inode), so it is verified again; a failure is never remembered.

    Limits: damage to a file under an unchanged marker after it passed here is not seen before the next
    unit of this process: the unit then reads the damaged file (an engine already holding the weights
    does not), and a failed unit is checked again without this cache (``ckpteval.jobs.eval.worker.evaluators``), so it
    still ends ``ckpt_missing`` / ``ckpt_corrupt``. A foreign checkpoint (marker kept elsewhere) is always
    verified in full.
    """

    def __init__(self) -> None:
        self._passed: dict[str, tuple[tuple[int, int, int, int], str, Marker]] = {}  # dir -> (identity, mode, marker)

    def verify(self, directory: Path, mode: str = "fast", marker: Marker | None = None) -> Marker:
        """``verify_snapshot(directory, mode, marker)``, or the marker it returned when the snapshot passed
        before (in ``mode`` or ``full``) with the same marker file."""
        if marker is not None:
            return verify_snapshot(directory, mode, marker)
        try:
            st = os.stat(Path(directory) / MARKER)
        except OSError:
            return verify_snapshot(directory, mode)  # raises with its usual message
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        passed = self._passed.get(str(directory))
        if passed is not None and passed[0] == identity and passed[1] in {mode, "full"}:
            return passed[2]
        checked = verify_snapshot(directory, mode)
        self._passed[str(directory)] = (identity, mode, checked)
        return checked


def verify_snapshot(directory: Path, mode: str = "fast", marker: Marker | None = None) -> Marker:
    """Check a snapshot and return its marker, or raise SnapshotMissing / SnapshotCorrupt.

    ``marker`` may be supplied (e.g. an adopted foreign checkpoint's record kept elsewhere). Full
    models and LoRA adapters verify alike (every listed file, safetensors headers parsed); an adapter
    snapshot (its marker lists :data:`ADAPTER_WEIGHTS`) must also list :data:`ADAPTER_CONFIG`.
    """
    if mode not in {"fast", "full"}:
        raise ValueError(f"verify mode must be 'fast' or 'full', got {mode!r}")
    directory = Path(directory)
    if marker is None:
        try:
            marker = read_marker(directory)
        except FileNotFoundError:
            raise SnapshotMissing(directory, "no .complete marker (missing or unfinished snapshot)") from None
        except ValueError as e:
            raise SnapshotCorrupt(directory, str(e)) from None
    if is_adapter_snapshot(marker.files) and ADAPTER_CONFIG not in marker.files:
        raise SnapshotCorrupt(directory, f"adapter snapshot without {ADAPTER_CONFIG} in its marker")
    for name, expected in marker.files.items():
        path = directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise SnapshotMissing(path, "listed in the marker but missing") from None
        if size != expected["bytes"]:
            raise SnapshotCorrupt(path, f"size {size} B, marker says {expected['bytes']} B")
        if name.endswith(".safetensors"):
            check_safetensors_header(path, size)
        if mode == "full" and file_info(path)["crc32"] != expected["crc32"]:
            raise SnapshotCorrupt(path, "CRC-32 differs from the marker")
    return marker
