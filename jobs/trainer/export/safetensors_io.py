"""safetensors files written straight from tensor memory, checksummed while they are written.

What :mod:`ckpteval.jobs.trainer.export.hf_files` builds a snapshot's weight files from:

* :func:`_tagged_chunks` — the bytes of one safetensors file (header, then each tensor's memory,
  zero-copy, in :data:`CHUNK_BYTES` slices), laid out as ``safetensors.torch.save_file`` lays them out
  (byte-identical files for the same tensors with ``{"format": "pt"}`` metadata);
* :func:`write_chunks` / :func:`copy_file` — create a file exclusively and write chunks, a helper thread
  computing the running checksum of chunk *i* while the main thread writes it (``zlib.crc32`` and
  ``write`` both release the GIL); returns ``{"bytes": n, "crc32": c}``;
* :func:`write_safetensors` — the same for one shard, also returning each tensor's digest
  (:mod:`ckpteval.coord.snapshots.digests`: CRC-32 of its bytes) under ``"tensors"``. With the default ``zlib.crc32``
  nothing is checksummed twice: the helper thread checksums the header and each tensor separately
  and the file's CRC is combined from those (:func:`ckpteval.coord.snapshots.digests.crc32_combine`).

Limits: tensors must be contiguous dense CPU tensors of a dtype in :data:`DTYPES`; nobody may mutate
them while they are written. A failed write removes its partial file; an existing file is never
overwritten (``FileExistsError``).
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from ckpteval.coord.snapshots.digests import TensorDigest, crc32_combine, new_xxh3

Checksum = Callable[[bytes | memoryview, int], int]
"""A running checksum with ``zlib.crc32``'s signature: ``checksum(chunk, previous) -> value``."""

FileRecord = dict[str, Any]  # {"bytes": n, "crc32": c} (+ "tensors": {name: TensorDigest} for a shard)

CHUNK_BYTES = 16 * 1024 * 1024  # measured best of 1/4/16/64 MiB on /dev/shm
_QUEUE_DEPTH = 8

# safetensors dtype names, in the order safetensors itself lays tensors out in a file (larger
# alignment first, then by name); mirroring it makes our shards byte-identical to save_file's.
DTYPES: dict[torch.dtype, str] = {
    torch.uint64: "U64",
    torch.int64: "I64",
    torch.float64: "F64",
    torch.complex64: "C64",
    torch.float32: "F32",
    torch.uint32: "U32",
    torch.int32: "I32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.uint16: "U16",
    torch.int16: "I16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPE_RANK: dict[torch.dtype, int] = {dtype: rank for rank, dtype in enumerate(DTYPES)}


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _tagged_chunks(shard: dict[str, torch.Tensor]) -> Iterator[tuple[int, bytes | memoryview]]:
    """``(segment, chunk)``: segment 0 is the header, segment ``i`` the ``i``-th tensor in file order."""
    order = _file_order(shard)
    yield 0, _safetensors_header(shard, order)
    for segment, name in enumerate(order, start=1):
        data = _tensor_bytes(shard[name])
        for start in range(0, len(data), CHUNK_BYTES):
            yield segment, data[start : start + CHUNK_BYTES]


def _file_order(shard: dict[str, torch.Tensor]) -> list[str]:
    return sorted(shard, key=lambda name: (DTYPE_RANK[shard[name].dtype], name))


def _safetensors_header(shard: dict[str, torch.Tensor], order: list[str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        tensor = shard[name]
        end = offset + nbytes(tensor)
        header[name] = {
            "dtype": DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


# ---- file writing with on-the-fly checksums


class _ChecksumThread:
    """Checksums chunks in order on a helper thread while the caller writes them.

    Chunks come tagged with a segment number (the header, each tensor): each segment gets its own
    CRC-32 and XXH3-64 (:meth:`segments`, :meth:`fast_digests`). The file's checksum is combined from the
    CRCs when ``crc`` is ``zlib.crc32``; another checksum runs over every chunk as well."""

    def __init__(self, crc: Checksum) -> None:
        self._crc = crc
        self._combine = crc is zlib.crc32
        self._queue: queue.Queue[tuple[int, bytes | memoryview] | None] = queue.Queue(maxsize=_QUEUE_DEPTH)
        self._value = 0
        self._crcs: list[int] = []
        self._lengths: list[int] = []
        self._xxh: list[Any] = []  # a streaming XXH3-64 per segment
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ckpteval-checksum", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        finished = False
        try:
            while (item := self._queue.get()) is not None:
                if self._error is None:
                    try:
                        self._add(*item)
                    except (TypeError, ValueError, BufferError, OverflowError, MemoryError) as exc:
                        self._error = exc  # a chunk the checksum cannot read: re-raised in the caller's thread
            finished = True
        finally:
            if not finished:  # anything else: the thread dies loudly, the caller fails and never blocks on put
                self._error = self._error or RuntimeError("the checksum thread died (see its traceback)")
                while self._queue.get() is not None:
                    pass

    def _add(self, segment: int, chunk: bytes | memoryview) -> None:
        while len(self._crcs) <= segment:
            self._crcs.append(0)
            self._lengths.append(0)
            self._xxh.append(new_xxh3())
        self._crcs[segment] = zlib.crc32(chunk, self._crcs[segment])
        self._xxh[segment].update(chunk)
        self._lengths[segment] += len(chunk)
        if not self._combine:
            self._value = self._crc(chunk, self._value)

    def feed(self, chunk: bytes | memoryview, segment: int = 0) -> None:
        self._queue.put((segment, chunk))

    def stop(self) -> None:
        """Let the thread finish the queued chunks and end (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def result(self) -> int:
        """Stop the thread; the checksum of everything fed (re-raises the checksum's error)."""
        self.stop()
        if self._error is not None:
            raise self._error
        if not self._combine:
            return self._value
        value = 0
        for crc, length in zip(self._crcs, self._lengths, strict=True):
            value = crc32_combine(value, crc, length)
        return value

    def segments(self) -> list[int]:
        """The CRC-32 of each segment (after :meth:`result`); empty segments are 0."""
        return list(self._crcs)

    def fast_digests(self) -> list[int]:
        """The XXH3-64 of each segment (after :meth:`result`)."""
        return [x.intdigest() for x in self._xxh]


def write_chunks(path: Path, chunks: Iterable[bytes | memoryview], crc: Checksum, fsync: bool) -> FileRecord:
    """Create ``path`` exclusively and write ``chunks``, checksumming them on the side.

    On failure the partial file is removed (a file that already existed is left alone).
    """
    return _write_tagged(path, ((0, chunk) for chunk in chunks), crc, fsync)[0]


def write_safetensors(path: Path, shard: dict[str, torch.Tensor], crc: Checksum, fsync: bool) -> FileRecord:
    """Write one safetensors shard like :func:`write_chunks`; the record also holds ``"tensors"``:
    each tensor's dtype, shape and digests (CRC-32 and XXH3-64 of its bytes, :mod:`ckpteval.coord.snapshots.digests`)."""
    record, crcs, fast = _write_tagged(path, _tagged_chunks(shard), crc, fsync)
    crcs += [0] * (len(shard) + 1 - len(crcs))  # trailing empty tensors fed no chunk
    fast += [new_xxh3().intdigest()] * (len(shard) + 1 - len(fast))
    record["tensors"] = {
        name: _digest(shard[name], crcs[segment], fast[segment])
        for segment, name in enumerate(_file_order(shard), start=1)
    }
    return record


def _digest(tensor: torch.Tensor, crc: int, fast: int) -> TensorDigest:
    return {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape), "crc32": crc, "xxh3": fast}


def _write_tagged(
    path: Path, chunks: Iterable[tuple[int, bytes | memoryview]], crc: Checksum, fsync: bool
) -> tuple[FileRecord, list[int], list[int]]:
    path.parent.mkdir(parents=True, exist_ok=True)
    size = 0
    with open(path, "xb", buffering=0) as f:
        summer = _ChecksumThread(crc)
        try:
            for segment, chunk in chunks:
                summer.feed(chunk, segment)
                size += _write_all(f, chunk)
            if fsync:
                os.fsync(f.fileno())
            value = summer.result()
        except BaseException:
            summer.stop()
            path.unlink(missing_ok=True)
            raise
    return {"bytes": size, "crc32": value}, summer.segments(), summer.fast_digests()


def _write_all(f: Any, chunk: bytes | memoryview) -> int:
    view = memoryview(chunk)
    written = 0
    while written < len(view):
        written += f.write(view[written:])
    return written


def copy_file(src: Path, dst: Path, crc: Checksum, fsync: bool) -> FileRecord:
    def chunks() -> Iterator[bytes]:
        with open(src, "rb") as f:
            while block := f.read(CHUNK_BYTES):
                yield block

    return write_chunks(dst, chunks(), crc, fsync)
