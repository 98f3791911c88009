"""Reading a snapshot's weights for :class:`ckpteval.jobs.eval.engines.hf.engine.HFEngine`: config, shards, checks.

What it owns: which files are a snapshot's weights (:func:`weight_files`: the safetensors index or
``model.safetensors``; pickled ``*.bin`` weights are refused), reading them onto a device
(:func:`read_state_dict`), whether a new snapshot can be copied into the loaded model in place
(:func:`arch_signature`: ``config.json`` minus bookkeeping keys), tied parameters the file left out
(:func:`complete_tied`), and the key/shape check done before any weight is touched
(:func:`check_state_dict`), the dtype a snapshot holds (:func:`snapshot_dtype`, :func:`resolve_dtype` for
``dtype: auto``), and the in-place reload: :func:`index_tensors` reads only the safetensors headers,
:func:`resident_targets` checks every key and shape before anything is touched, and
:func:`copy_into_resident` reads each tensor's bytes straight into its resident parameter (no state
dict). Every failure is an :class:`~ckpteval.jobs.eval.engines.base.EngineError` naming the file.

Limits: only safetensors are ever read; :func:`read_state_dict` (the first build and the bench's
baseline) holds the whole state dict in memory at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ckpteval.coord.snapshots.digests import tensor_digest
from ckpteval.jobs.eval.engines.base import EngineError, UnsupportedSnapshot, WeightDigests

# config.json keys that say nothing about the weights' layout: a change here still reloads in place.
_BOOKKEEPING_KEYS = frozenset({"transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache"})


def read_config(snapshot: Path) -> dict[str, Any]:
    """The snapshot's ``config.json`` as a dict; :class:`EngineError` if missing or not JSON."""
    path = snapshot / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EngineError(f"cannot read {path}: {e}") from e


def arch_signature(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a config.json that decides whether weights can be copied in place."""
    return {k: v for k, v in config.items() if k not in _BOOKKEEPING_KEYS}


_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
}
_CONFIG_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64,
}


def snapshot_dtype(snapshot: Path, config: dict[str, Any]) -> torch.dtype:
    """The dtype a snapshot holds: ``config.json``'s ``dtype``/``torch_dtype``, else the dtype of the first
    floating-point tensor of its first shard, else float32."""
    for key in ("dtype", "torch_dtype"):
        if isinstance(config.get(key), str) and config[key] in _CONFIG_DTYPES:
            return _CONFIG_DTYPES[config[key]]
    with contextlib.suppress(EngineError, OSError, ValueError):
        header = read_safetensors_header(weight_files(snapshot)[0])
        for name, meta in header.items():
            if name != "__metadata__" and isinstance(meta, dict) and meta.get("dtype") in _SAFETENSORS_DTYPES:
                return _SAFETENSORS_DTYPES[meta["dtype"]]
    return torch.float32


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (no tensor data read)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


_CPU_DTYPE_OK: dict[torch.dtype, bool] = {}


def cpu_supports(dtype: torch.dtype) -> bool:
    """Whether this CPU build runs a matmul in ``dtype`` (cached probe; float32/float64 always do)."""
    if dtype in (torch.float32, torch.float64):
        return True
    if dtype not in _CPU_DTYPE_OK:
        try:
            x = torch.ones(4, 4, dtype=dtype)
            _CPU_DTYPE_OK[dtype] = bool(torch.isfinite((x @ x).float()).all())
        except RuntimeError:
            _CPU_DTYPE_OK[dtype] = False
    return _CPU_DTYPE_OK[dtype]


def resolve_dtype(requested: torch.dtype | str, snapshot: Path, config: dict[str, Any], device: torch.device) -> torch.dtype:
    """``requested`` as a dtype: ``"auto"`` is the snapshot's own dtype, float32 on a CPU whose torch
    cannot run that dtype's kernels."""
    if requested != "auto":
        return requested  # type: ignore[return-value]
    dtype = snapshot_dtype(snapshot, config)
    if device.type == "cpu" and not cpu_supports(dtype):
        return torch.float32
    return dtype


def weight_files(snapshot: Path) -> list[Path]:
    """The snapshot's safetensors shards (from the index when sharded); refuses pickled weights."""
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise EngineError(f"unreadable safetensors index {index}: {e}") from e
    elif (snapshot / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        raise UnsupportedSnapshot(f"no safetensors weights in {snapshot} (pickled *.bin checkpoints are refused): "
                                  "save with safetensors (HF Trainer: save_safetensors=True)")
    files = [snapshot / name for name in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise EngineError(f"shards named by the index are missing: {missing}")
    return files


def read_state_dict(snapshot: Path, device: str) -> dict[str, torch.Tensor]:
    """Every tensor of every shard, loaded straight onto ``device`` (the bench's whole-file baseline)."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(snapshot):
        try:
            state.update(load_file(path, device=device))
        except (OSError, SafetensorError) as e:
            raise EngineError(f"cannot read {path}: {e}") from e
    return state


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file (absolute byte offsets) and what it is."""

    path: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    begin: int
    end: int


TensorIndex = dict[str, TensorEntry]


def index_tensors(files: Sequence[Path]) -> TensorIndex:
    """Every tensor of ``files`` from the safetensors headers only (no tensor data read).

    :class:`EngineError` for an unreadable header, a dtype this engine does not load, or a byte range
    that does not match the shape (the file is never trusted beyond its header)."""
    index: TensorIndex = {}
    for path in files:
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error) as e:
            raise EngineError(f"cannot read the safetensors header of {path}: {e}") from e
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = _LOADABLE_DTYPES[meta["dtype"]]
                shape = tuple(int(d) for d in meta["shape"])
                begin, end = (8 + n + int(o) for o in meta["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise EngineError(f"{path}: tensor {name!r} has an unusable header entry ({e})") from e
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * dtype.itemsize or end > size:
                raise EngineError(f"{path}: tensor {name!r} bytes [{begin}, {end}) do not hold shape {shape}")
            index[name] = TensorEntry(path, shape, dtype, begin, end)
    return index


def resident_targets(model: torch.nn.Module, index: TensorIndex) -> dict[str, torch.Tensor]:
    """The model's parameters/buffers by the file's names, checked before anything is touched.

    Every resident tensor must be covered by a file tensor of the same shape (a tied partner absent
    from the file is covered through the tensor it shares storage with); file tensors the model lacks
    are an error. :class:`EngineError` otherwise, naming up to five offenders of each kind.
    """
    resident = model.state_dict(keep_vars=True)
    shapes = {name: entry.shape for name, entry in index.items()}
    check_state_dict(model, complete_tied(model, shapes))
    return {name: resident[name] for name in index}


def copy_into_resident(targets: dict[str, torch.Tensor], index: TensorIndex, device: torch.device) -> None:
    """Read each tensor's bytes from its file into its resident parameter, in file order.

    A CPU parameter of the file's dtype is filled by ``readinto`` straight into its memory (one copy,
    page cache -> parameter, as a plain file read); otherwise the bytes go through a reused host buffer
    (page-locked for CUDA) and one ``copy_`` (dtype conversion and/or host-to-device). No state dict is
    built: peak extra memory is one tensor. ``OSError``/``RuntimeError`` escape (the caller marks the
    weights undefined)."""
    by_file: dict[Path, list[str]] = {}
    for name in sorted(index, key=lambda k: (str(index[k].path), index[k].begin)):
        by_file.setdefault(index[name].path, []).append(name)
    buffer = _HostBuffer(pinned=device.type == "cuda")
    with torch.no_grad():
        for path, names in by_file.items():
            with open(path, "rb", buffering=0) as f:
                for name in names:
                    entry, target = index[name], targets[name]
                    f.seek(entry.begin)
                    direct = target.device.type == "cpu" and target.dtype == entry.dtype and target.is_contiguous()
                    if direct:
                        _read_exact(f, _byte_view(target.data), path)
                    else:
                        staged = buffer.get(entry.end - entry.begin)
                        _read_exact(f, _byte_view(staged), path)
                        source = staged.view(entry.dtype).view(entry.shape)
                        target.data.copy_(source, non_blocking=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


DIGEST_THREADS = max(1, min(8, os.cpu_count() or 1))


def param_digests(model: torch.nn.Module, dtypes: dict[str, str], digest: str = "crc32") -> WeightDigests:
    """Digests of every tensor the model holds (its state dict), each cast to the snapshot's dtype
    ``dtypes[name]`` (a safetensors dtype name; names absent keep their own dtype): ``digest`` (``xxh3``
    or ``crc32``, :func:`ckpteval.coord.snapshots.digests.tensor_digest`) of the bytes. Tensors sharing storage are digested once and reported as aliases of
    the first of them that ``dtypes`` names. A tensor held in a dtype that cannot hold the snapshot's
    values exactly (bf16 held for an F32 file) is listed in ``lossy``. Tensors are digested on
    :data:`DIGEST_THREADS` threads (one tensor each at a time: at most that many host copies exist)."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    state = model.state_dict(keep_vars=True)
    for name, tensor in state.items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        groups.setdefault(key, []).append(name)
    heads = {next((n for n in names if n in dtypes), names[0]): names for names in groups.values()}
    targets = {h: _LOADABLE_DTYPES.get(dtypes.get(h, ""), state[h].dtype) for h in heads}
    lossy = [h for h in heads if not _holds_exactly(state[h].dtype, targets[h])]

    def one(head: str) -> int:
        with torch.no_grad():
            return tensor_digest(_byte_view(state[head].detach().to(device="cpu", dtype=targets[head]).contiguous()), digest)

    with ThreadPoolExecutor(DIGEST_THREADS, thread_name_prefix="ckpteval-digest") as pool:
        values = dict(zip(heads, pool.map(one, heads), strict=True))  # hashes and copies release the GIL
    digests = {name: values[head] for head, names in heads.items() for name in names}
    aliases = {name: head for head, names in heads.items() for name in names if name != head}
    return WeightDigests(digests, aliases, tuple(sorted(lossy)))


def _holds_exactly(held: torch.dtype, file: torch.dtype) -> bool:
    """Whether every value of ``file``'s dtype survives a round trip through ``held``."""
    wider = {torch.float64: {torch.float32, torch.bfloat16, torch.float16}, torch.float32: {torch.bfloat16, torch.float16}}
    return held == file or file in wider.get(held, set())


_LOADABLE_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class _HostBuffer:
    """One growable host byte buffer reused for every staged tensor."""

    def __init__(self, pinned: bool) -> None:
        self.pinned, self._buf = pinned, torch.empty(0, dtype=torch.uint8)

    def get(self, nbytes: int) -> torch.Tensor:
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        return self._buf[:nbytes]


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")


def _read_exact(f: Any, view: memoryview, path: Path) -> None:
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise OSError(f"{path}: file ended {len(view) - done} bytes early")
        done += n


def complete_tied(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` plus entries for tied parameters the file left out (e.g. ``lm_head.weight``)."""
    names_by_param: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names_by_param.setdefault(id(tensor), []).append(name)
    completed = dict(state)
    for names in names_by_param.values():
        present = [n for n in names if n in state]
        for name in names:
            if name not in completed and present:
                completed[name] = state[present[0]]
    return completed


def check_state_dict(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Raise :class:`EngineError` unless ``state`` has exactly the model's keys and shapes (values may
    be tensors or shapes)."""
    expected = model.state_dict(keep_vars=True)
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    wrong_shape = [
        f"{k}: {tuple(_shape(state[k]))} != {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and _shape(state[k]) != v.shape
    ]
    if missing or unexpected or wrong_shape:
        raise EngineError(
            f"snapshot weights do not fit the loaded model: missing={missing[:5]} "
            f"unexpected={unexpected[:5]} wrong_shape={wrong_shape[:5]}"
        )

def _shape(value: Any) -> torch.Size:
    return value.shape if isinstance(value, torch.Tensor) else torch.Size(value)
