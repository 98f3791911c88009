"""Per-tensor digests of a snapshot's weights, and the comparison that attests an engine against them.

What it owns:

* the digests of one tensor's raw little-endian bytes as safetensors stores them (:data:`DIGESTS`):
  ``xxh3`` (64-bit XXH3, :func:`tensor_digest`; about 4-8x faster than CRC-32 here, so an engine's
  attestation costs a fraction of a reload) and ``crc32`` (``zlib.crc32``, what the file checksum is
  combined from). The exporter (computed while it writes, :mod:`ckpteval.jobs.trainer.export`) and the marking of
  a reused or foreign checkpoint (:func:`safetensors_digests`, one read that also yields the file's CRC)
  record both per tensor; an engine digests the parameters it holds (cast to the snapshot's dtype) with
  ``xxh3`` (a marker whose tensors lack it is an older format, refused when read:
  :func:`ckpteval.coord.snapshots.snapshot.parse_marker`);
* :func:`crc32_combine` — the CRC of ``A + B`` from the CRCs of ``A`` and ``B`` (zlib's algorithm),
  so a file's CRC is derived from its header's and its tensors' without checksumming a byte twice;
* :func:`compare_digests` — what differs between a marker's tensors and an engine's report: missing,
  extra and different tensors, named.
* :func:`weights_id` — one fingerprint of a marker's tensors: two snapshots with one id hold the same
  weights (status checks a snapshot with step 0's weights against a published base score too).

Promises: a tensor digest depends only on the tensor's dtype-encoded bytes (not on the file it lies
in, its offset or shard); :func:`crc32_combine` equals ``zlib.crc32`` of the concatenation.

Limits: both digests detect accidental change (a stale layer, a dropped or rescaled tensor, a corrupt
page, another snapshot's weights); neither is a defence against someone forging weights with equal
digests, which is not in the threat model (see docs/PROTOCOL.md, "Attestation").
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

READ_CHUNK = 8 << 20
TensorDigest = dict[str, Any]  # {"dtype": "BF16", "shape": [..], "crc32": c, "xxh3": x} (+ "file" in a marker)
DIGESTS = ("xxh3", "crc32")  # the per-tensor digests a marker may hold, the fastest first


def tensor_digest(data: Any, name: str) -> int:
    """Digest ``name`` (one of :data:`DIGESTS`) of a bytes-like object."""
    if name == "xxh3":
        return xxhash.xxh3_64_intdigest(data)
    return zlib.crc32(data)


def new_xxh3() -> Any:
    """A streaming XXH3-64 (``update(chunk)``, ``intdigest()``)."""
    return xxhash.xxh3_64()

_POLY = 0xEDB88320  # CRC-32 (reflected), as zlib


def _multmodp(a: int, b: int) -> int:
    """``a * b mod p`` over GF(2) for reflected CRC-32 polynomials (zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def _x2nmodp(n: int, k: int) -> int:
    """``x^(n * 2^k) mod p``."""
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` given ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's ``crc32_combine``)."""
    return _multmodp(_x2nmodp(len2, 3), crc1) ^ crc2


def safetensors_digests(path: Path) -> tuple[dict[str, int], dict[str, TensorDigest]]:
    """One read of a safetensors file: its ``{"bytes", "crc32"}`` and each tensor's digest.

    ValueError for a header that is not a safetensors header or data that does not match it.
    """
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > 100 << 20:
            raise ValueError(f"{path}: safetensors header length {n} is implausible")
        raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: safetensors header is not JSON ({e})") from None
        crc, size = zlib.crc32(raw, zlib.crc32(head)), 8 + len(raw)
        tensors: dict[str, TensorDigest] = {}
        for name, begin, end, meta in _data_order(header, path):
            gap = begin - (size - 8 - n)
            if gap < 0:
                raise ValueError(f"{path}: tensor {name!r} overlaps the tensor before it")
            if gap:  # bytes between tensors (not written by safetensors itself) still count for the file
                crc, size = crc32_combine(crc, _crc_of_next(f, gap, path), gap), size + gap
            value, fast = _digests_of_next(f, end - begin, path)
            tensors[name] = {"dtype": meta["dtype"], "shape": list(meta["shape"]), "crc32": value, "xxh3": fast}
            crc, size = crc32_combine(crc, value, end - begin), size + end - begin
        while rest := f.read(READ_CHUNK):  # trailing bytes no tensor claims still count for the file
            crc, size = zlib.crc32(rest, crc), size + len(rest)
    return {"bytes": size, "crc32": crc}, tensors


def _data_order(header: dict[str, Any], path: Path) -> list[tuple[str, int, int, dict[str, Any]]]:
    entries = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise ValueError(f"{path}: tensor {name!r} has no valid data_offsets")
        entries.append((name, offsets[0], offsets[1], meta))
    return sorted(entries, key=lambda e: (e[1], e[2]))


def _crc_of_next(f: Any, length: int, path: Path) -> int:
    return _digests_of_next(f, length, path, fast=False)[0]


def _digests_of_next(f: Any, length: int, path: Path, fast: bool = True) -> tuple[int, int | None]:
    """CRC-32 and (``fast``) XXH3-64 of the next ``length`` bytes of ``f``."""
    crc, left, xxh = 0, length, new_xxh3() if fast else None
    while left:
        chunk = f.read(min(left, READ_CHUNK))
        if not chunk:
            raise ValueError(f"{path}: file ends inside its tensor data")
        crc, left = zlib.crc32(chunk, crc), left - len(chunk)
        if xxh is not None:
            xxh.update(chunk)
    return crc, None if xxh is None else xxh.intdigest()


def compare_digests(
    expected: Mapping[str, Mapping[str, Any]], got: Mapping[str, int], aliases: Mapping[str, str] | None = None,
    digest: str = "crc32",
) -> list[str]:
    """What differs between a marker's tensors and an engine's ``digest`` of each (empty: the same weights).

    ``aliases`` maps a name the engine holds to the name whose storage it shares (a tied
    ``lm_head.weight``): such a name is not extra when its partner is in the marker.
    """
    aliases = aliases or {}
    missing = sorted(set(expected) - set(got))
    extra = sorted(n for n in set(got) - set(expected) if aliases.get(n) not in expected)
    different = sorted(n for n in set(expected) & set(got) if int(expected[n][digest]) != got[n])
    out = []
    for label, names in (("missing", missing), ("extra", extra), ("different", different)):
        if names:
            shown = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
            out.append(f"{label} {len(names)}: {shown}")
    return out


def weights_id(tensors: Mapping[str, Mapping[str, Any]] | None) -> str | None:
    """One fingerprint of a snapshot's weights from its marker's tensors (:attr:`Marker.tensors`): every
    tensor's name, dtype, shape and ``xxh3``, not the file holding it. Two snapshots with one id hold the same
    weights (a resharded copy included); None when the marker lists no tensor digests."""
    if not tensors:
        return None
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(tensors):
        t = tensors[name]
        h.update(json.dumps([name, t.get("dtype"), t.get("shape"), t.get("xxh3")]).encode() + b"\n")
    return h.hexdigest()
