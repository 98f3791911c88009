"""``HFEngine``: the in-process transformers engine (CPU or CUDA) behind ``ckpteval serve``.

What it owns and promises:

- The first :meth:`HFEngine.load` builds the model from the snapshot
  (``AutoModelForCausalLM.from_pretrained(dir, use_safetensors=True, local_files_only=True)``) and its
  tokenizer. A later load whose ``config.json`` matches the loaded one (every key except bookkeeping
  such as ``transformers_version``/``dtype``) copies the snapshot's safetensors shards into the *same*
  model object; anything else re-instantiates.
- ``dtype="auto"`` (the default) builds the model in the snapshot's own dtype (config.json's
  ``dtype``/``torch_dtype``, else the first shard's tensor dtype): a bf16 checkpoint stays bf16 (half
  the memory of an upcast). On CPU a dtype whose matmul kernels this torch build lacks (probed once
  with a 4x4 matmul) falls back to float32; torch 2.13's CPU build runs bf16 and fp16, so there a
  bf16 snapshot is served in bf16 (measured on the tiny model: same speed as float32 on this CPU).
  ``"float32"``/``"bfloat16"``/``"float16"`` force a dtype.
- In-place reloads read straight into the resident parameters: the safetensors headers are indexed
  first (names and shapes checked against the model, tied partners absent from the file covered by
  the tensor they share storage with) so a bad snapshot leaves the old weights and version in place;
  then each tensor's bytes are read from the file straight into its parameter (``readinto`` the
  parameter's memory when it is a CPU tensor of the file's dtype, else through one reused host buffer
  and one ``copy_``; no intermediate state dict: peak extra memory is one tensor), under the lock every
  generation holds, so a generation sees either the old weights with the old version or the new with
  the new (a reload therefore pauses generation for the read; the worker never overlaps them). Should
  a copy fail midway (a file truncated after verification), the version becomes ``None`` (weights
  undefined) and :class:`EngineError` is raised. ``make bench`` reports the reload's GB/s next to a
  plain read of the same bytes (``bench/bench_reload.py``).
- Generation: batched, left-padded, KV cache, greedy when ``temperature == 0`` else sampled with
  ``top_p``/``top_k``; ``seed`` makes a sampled call reproducible (same prompts, batch and seed) via
  a forked RNG that leaves the global RNG untouched. Only new tokens are decoded, cut at the first
  ``eos``; ``n_tokens`` counts generated tokens including that ``eos``.
- Only safetensors are ever read; a snapshot with only pickled ``*.bin`` weights is refused.
- Several engines in one process (a pool) are safe: model builds, which transformers runs under
  process-global contexts, take turns on a module lock; in-place reloads and generation do not.

- :meth:`HFEngine.restart` rebuilds the model object from the last snapshot (version kept) or, when
  that snapshot is gone (GC'd), from the remembered config with version ``None``; a later load then
  reloads in place as usual.

Limits: the tokenizer is read on (re-)instantiation only, not on in-place reloads (training does not
change it); the snapshot's ``generation_config.json`` is ignored (every request states its sampling);
an architecture change holds the old and the new model in memory until the swap.
"""

from __future__ import annotations

import contextlib
import gc
import json
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from jobs.eval.engines.base import EngineError, Generation, SamplingParams

# config.json keys that say nothing about the weights' layout: a change here still reloads in place.
_BOOKKEEPING_KEYS = frozenset({"transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache"})
# transformers builds models under process-global contexts (meta device, skipped init): two builds
# in different threads corrupt each other ("Cannot copy out of meta tensor"), so builds take turns.
_BUILD_LOCK = threading.Lock()
_DTYPES: dict[str, torch.dtype | str] = {
    "auto": "auto",
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class Completion:
    """One completion with what a server reports about it (sglang's ``meta_info`` fields)."""

    text: str
    output_ids: list[int]  # generated ids, including the eos that stopped it, if any
    finish_reason: dict[str, Any]  # {"type": "stop", "matched": id} | {"type": "length", "length": n}
    prompt_tokens: int
    weight_version: str | None

    def generation(self) -> Generation:
        return Generation(text=self.text, weight_version=self.weight_version, n_tokens=len(self.output_ids))


def validate_sampling(params: SamplingParams) -> None:
    """Raise ``ValueError`` for settings no engine can honour."""
    if not isinstance(params.max_new_tokens, int) or params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {params.max_new_tokens!r}")
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if not isinstance(params.top_k, int) or params.top_k < -1:
        raise ValueError(f"top_k must be an int >= -1 (-1 or 0: off), got {params.top_k!r}")
    if params.seed is not None and not isinstance(params.seed, int):
        raise ValueError(f"seed must be an int or None, got {params.seed!r}")


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
        raise EngineError(f"no safetensors weights in {snapshot} (pickled *.bin checkpoints are refused)")
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


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` with every row right-aligned (padding on the left)."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, width - len(row) :] = 1
    return input_ids, attention_mask


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Fix the RNG for the block when ``seed`` is set, restoring the caller's RNG state afterwards."""
    if seed is None:
        yield
        return
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No per-load progress bar or load report in fleet logs (a tied ``lm_head`` is reported "missing"
    although it is tied correctly); errors still raise."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


class HFEngine:
    """In-process transformers engine; see the module docstring for its guarantees."""

    def __init__(
        self, device: str = "cpu", dtype: str | torch.dtype = "auto", max_batch_size: int = 256
    ) -> None:
        if isinstance(dtype, str) and dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._device = torch.device(device)
        self._dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
        self._max_batch_size = max_batch_size
        self._lock = threading.RLock()  # model, tokenizer, version: held by every generation
        self._load_lock = threading.Lock()  # one load/restart/close at a time
        self._model: PreTrainedModel | None = None
        self._tokenizer: Any = None
        self._config: PretrainedConfig | None = None  # kept across release, for restart
        self._model_dtype: torch.dtype = torch.float32  # what "auto" resolved to, for restart
        self._signature: dict[str, Any] | None = None
        self._version: str | None = None
        self._snapshot: Path | None = None

    # ------------------------------------------------------------------ introspection
    @property
    def model(self) -> PreTrainedModel | None:
        """The live model object (the same object across in-place reloads)."""
        return self._model

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def snapshot_dir(self) -> str | None:
        """The snapshot the current weights came from."""
        return None if self._snapshot is None else str(self._snapshot)

    def weight_version(self) -> str | None:
        with self._lock:
            return self._version

    # ------------------------------------------------------------------ loading
    def load(self, snapshot_dir: str, weight_version: str) -> None:
        if not isinstance(weight_version, str):
            raise ValueError(f"weight_version must be a str, got {weight_version!r}")
        snapshot = Path(snapshot_dir)
        signature = arch_signature(read_config(snapshot))
        with self._load_lock:
            if self._model is not None and signature == self._signature:
                self._reload_in_place(snapshot, weight_version)
            else:
                self._instantiate(snapshot, weight_version, signature)

    def _instantiate(self, snapshot: Path, version: str | None, signature: dict[str, Any]) -> None:
        model, tokenizer = self._build(snapshot)
        self._install(model, tokenizer, signature, version, snapshot)

    def _build(self, snapshot: Path) -> tuple[PreTrainedModel, Any]:
        """A model (in the resolved dtype, still on CPU) and its tokenizer from an HF model dir."""
        weight_files(snapshot)  # refuse pickle-only snapshots before transformers looks at them
        dtype = resolve_dtype(self._dtype, snapshot, read_config(snapshot), self._device)
        try:
            with _BUILD_LOCK, _quiet_transformers():
                model = AutoModelForCausalLM.from_pretrained(
                    snapshot, dtype=dtype, use_safetensors=True, local_files_only=True
                )
            tokenizer = AutoTokenizer.from_pretrained(snapshot, local_files_only=True)
        except (OSError, ValueError, RuntimeError, SafetensorError) as e:
            raise EngineError(f"cannot build a model from {snapshot}: {e}") from e
        tokenizer.padding_side = "left"
        return model, tokenizer

    def _install(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        signature: dict[str, Any],
        version: str | None,
        snapshot: Path | None,
    ) -> None:
        model = model.to(self._device).eval()
        # Requests state their own sampling; neutralise the snapshot's defaults so none leak in.
        model.generation_config = GenerationConfig(
            bos_token_id=model.config.bos_token_id,
            eos_token_id=model.config.eos_token_id,
            pad_token_id=model.config.pad_token_id,
        )
        with self._lock:
            self._release_model()
            self._model, self._tokenizer, self._config = model, tokenizer, model.config
            self._model_dtype = model.dtype
            self._signature, self._version, self._snapshot = signature, version, snapshot

    def _reload_in_place(self, snapshot: Path, version: str) -> None:
        model = self._model
        index = index_tensors(weight_files(snapshot))
        targets = resident_targets(model, index)  # names and shapes checked: nothing touched yet
        with self._lock:
            try:
                copy_into_resident(targets, index, self._device)
            except (RuntimeError, OSError, SafetensorError) as e:
                self._version = None  # some weights may already be overwritten
                raise EngineError(f"in-place load of {snapshot} failed midway: {e}") from e
            self._version, self._snapshot = version, snapshot

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[str], params: SamplingParams) -> list[Generation]:
        return [c.generation() for c in self.complete(prompts, params)]

    def complete(self, prompts: list[str], params: SamplingParams) -> list[Completion]:
        """Like :meth:`generate`, with output ids, finish reason and prompt length."""
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise ValueError("prompts must be a list of str")
        with self._lock:
            tokenizer = self._require_loaded()[1]
            rows = tokenizer(prompts)["input_ids"] if prompts else []
            return self.generate_ids(rows, params)

    def generate_ids(self, input_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Complete already-tokenized prompts (sglang's ``input_ids`` requests)."""
        validate_sampling(params)
        with self._lock:
            model, tokenizer = self._require_loaded()
            self._check_ids(input_ids, model.config.vocab_size)
            results: list[Completion] = []
            with _seeded(params.seed, self._device):
                for chunk in _chunks(input_ids, self._max_batch_size):
                    results.extend(self._generate_chunk(model, tokenizer, chunk, params))
            return results

    def _generate_chunk(
        self, model: PreTrainedModel, tokenizer: Any, rows: Sequence[list[int]], params: SamplingParams
    ) -> list[Completion]:
        input_ids, attention_mask = left_pad(rows, self._pad_id(tokenizer))
        try:
            with torch.inference_mode():
                out = model.generate(
                    input_ids=input_ids.to(self._device),
                    attention_mask=attention_mask.to(self._device),
                    generation_config=self._generation_config(params, tokenizer),
                )
        except RuntimeError as e:
            raise EngineError(f"generation failed: {e}") from e
        new_tokens = out[:, input_ids.shape[1] :].tolist()
        eos_ids = self._eos_ids(tokenizer)
        return [
            self._completion(tokenizer, row, new, eos_ids) for row, new in zip(rows, new_tokens, strict=True)
        ]

    def _completion(self, tokenizer: Any, prompt: list[int], new: list[int], eos_ids: set[int]) -> Completion:
        stop = next((i for i, t in enumerate(new) if t in eos_ids), None)
        if stop is None:
            output_ids, finish = new, {"type": "length", "length": len(new)}
        else:
            output_ids, finish = new[: stop + 1], {"type": "stop", "matched": new[stop]}
        text_ids = output_ids if stop is None else output_ids[:-1]
        return Completion(
            text=tokenizer.decode(text_ids, skip_special_tokens=True),
            output_ids=output_ids,
            finish_reason=finish,
            prompt_tokens=len(prompt),
            weight_version=self._version,
        )

    def _generation_config(self, params: SamplingParams, tokenizer: Any) -> GenerationConfig:
        common = dict(
            max_new_tokens=params.max_new_tokens,
            pad_token_id=self._pad_id(tokenizer),
            eos_token_id=sorted(self._eos_ids(tokenizer)),
            use_cache=True,
        )
        if params.temperature == 0:
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(
            do_sample=True,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0,  # 0 disables transformers' top-k filter
            **common,
        )

    def _eos_ids(self, tokenizer: Any) -> set[int]:
        ids = self._model.config.eos_token_id if self._model is not None else None
        found = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if tokenizer.eos_token_id is not None:
            found.add(tokenizer.eos_token_id)
        return found

    def _pad_id(self, tokenizer: Any) -> int:
        if tokenizer.pad_token_id is not None:
            return tokenizer.pad_token_id
        return min(self._eos_ids(tokenizer), default=0)

    @staticmethod
    def _check_ids(input_ids: list[list[int]], vocab_size: int) -> None:
        if not isinstance(input_ids, list):
            raise ValueError("input_ids must be a list of lists of int")
        for row in input_ids:
            if not isinstance(row, list) or not row:
                raise ValueError("every prompt needs at least one token id")
            if not all(isinstance(t, int) and 0 <= t < vocab_size for t in row):
                raise ValueError(f"token ids must be ints in [0, {vocab_size})")

    def _require_loaded(self) -> tuple[PreTrainedModel, Any]:
        if self._model is None:
            raise EngineError("no model loaded: call load() first")
        return self._model, self._tokenizer

    # ------------------------------------------------------------------ health and lifecycle
    def healthy(self) -> bool:
        try:
            tokenizer = self._require_loaded()[1]
            probe = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0
            self.generate_ids([[probe]], SamplingParams(max_new_tokens=1))
        except (EngineError, RuntimeError, ValueError):
            return False
        return True

    def restart(self) -> None:
        """Rebuild the model object.

        From the last loaded snapshot when it is still on disk (its version kept: weights match it);
        otherwise from the remembered config with fresh weights and version ``None`` (the next
        :meth:`load` then reloads in place). A no-op before the first load (nothing to rebuild).
        """
        with self._load_lock:
            snapshot, version, signature = self._snapshot, self._version, self._signature
            config, tokenizer = self._config, self._tokenizer
            with self._lock:
                self._release_model()
            if config is None or signature is None:
                return  # never loaded: the next load builds the model
            if snapshot is not None and snapshot.is_dir():
                with contextlib.suppress(EngineError):
                    self._instantiate(snapshot, version, signature)
                    return
            with _BUILD_LOCK:
                model = AutoModelForCausalLM.from_config(config, dtype=self._model_dtype)
            self._install(model, tokenizer, signature, None, None)

    def close(self) -> None:
        with self._load_lock, self._lock:
            self._release_model()

    def _release_model(self) -> None:
        """Drop the model and its version (caller holds ``_lock``); config and tokenizer stay for restart."""
        self._version = None
        if self._model is None:
            return
        self._model = None
        gc.collect()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
