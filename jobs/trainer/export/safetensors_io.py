"""safetensors files written straight from tensor memory, checksummed while they are written.

What :mod:`jobs.trainer.export.hf_files` builds a snapshot's weight files from:

* :func:`safetensors_chunks` — the bytes of one safetensors file (header, then each tensor's memory,
  zero-copy, in :data:`CHUNK_BYTES` slices), laid out as ``safetensors.torch.save_file`` lays them out
  (byte-identical files for the same tensors with ``{"format": "pt"}`` metadata);
* :func:`write_chunks` / :func:`copy_file` — create a file exclusively and write chunks, a helper thread
  computing the running checksum of chunk *i* while the main thread writes it (``zlib.crc32`` and
  ``write`` both release the GIL); returns ``{"bytes": n, "crc32": c}``.

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
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

Checksum = Callable[[bytes | memoryview, int], int]
"""A running checksum with ``zlib.crc32``'s signature: ``checksum(chunk, previous) -> value``."""

FileRecord = dict[str, int]

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


def safetensors_chunks(shard: dict[str, torch.Tensor]) -> Iterator[bytes | memoryview]:
    """The bytes of one safetensors file: header, then each tensor's memory, zero-copy."""
    order = sorted(shard, key=lambda name: (DTYPE_RANK[shard[name].dtype], name))
    yield _safetensors_header(shard, order)
    for name in order:
        data = _tensor_bytes(shard[name])
        for start in range(0, len(data), CHUNK_BYTES):
            yield data[start : start + CHUNK_BYTES]


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
    """Checksums chunks in order on a helper thread while the caller writes them."""

    def __init__(self, crc: Checksum) -> None:
        self._crc = crc
        self._queue: queue.Queue[bytes | memoryview | None] = queue.Queue(maxsize=_QUEUE_DEPTH)
        self._value = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ckpteval-checksum", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._value = self._crc(chunk, self._value)
                except Exception as exc:  # any checksum failure: re-raised in the caller's thread
                    self._error = exc

    def feed(self, chunk: bytes | memoryview) -> None:
        self._queue.put(chunk)

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
        return self._value


def write_chunks(path: Path, chunks: Iterable[bytes | memoryview], crc: Checksum, fsync: bool) -> FileRecord:
    """Create ``path`` exclusively and write ``chunks``, checksumming them on the side.

    On failure the partial file is removed (a file that already existed is left alone).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    size = 0
    with open(path, "xb", buffering=0) as f:
        summer = _ChecksumThread(crc)
        try:
            for chunk in chunks:
                summer.feed(chunk)
                size += _write_all(f, chunk)
            if fsync:
                os.fsync(f.fileno())
            value = summer.result()
        except BaseException:
            summer.stop()
            path.unlink(missing_ok=True)
            raise
    return {"bytes": size, "crc32": value}


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
