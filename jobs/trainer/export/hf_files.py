"""Write the *files* of a Hugging Face snapshot into a directory, and copy weights off the trainer.

Guarantee: the directory loads with ``AutoModelForCausalLM.from_pretrained(dir, use_safetensors=True)``. Limits:
publishing (marker, rename) is :mod:`ckpteval.coord.snapshots.snapshot`'s; tensors must be dense CPU tensors nobody
mutates while written (:func:`snapshot_host_copy`); no DTensor. See docs/PROTOCOL.md §4.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from ckpteval.jobs.trainer.export.safetensors_io import (
    DTYPES,
    Checksum,
    FileRecord,
    copy_file,
    nbytes,
    write_chunks,
    write_safetensors,
)

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"

# Metadata files copied from the base model directory (top level only). Anything else — weights,
# weight indexes, optimizer states, pickles — is never copied.
METADATA_FILES: frozenset[str] = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "tokenizer.model",
        "spiece.model",
        "sentencepiece.bpe.model",
        "chat_template.jinja",
        "chat_template.json",
        "preprocessor_config.json",
        "processor_config.json",
    }
)
METADATA_SUFFIXES: tuple[str, ...] = (".tiktoken",)
CHAT_TEMPLATES_DIR = "additional_chat_templates"  # holds ``*.jinja`` files, copied as well

# --------------------------------------------------------------------------------------------------
# Host copy (the part that blocks the trainer)


def snapshot_host_copy(model_or_state_dict: torch.nn.Module | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Copy every tensor of a model or state dict into fresh, contiguous host memory.

    Host memory use: one full copy of the weights — the sum of the tensors' bytes, with tensors that
    alias each other (tied embeddings) copied once and still aliased in the result, so
    :func:`write_hf_files` recognises the tie. When a source tensor is on CUDA its copy is page-locked
    (pinned) and made with ``non_blocking`` on the current stream, followed by one synchronize per
    device; torch's caching host allocator keeps freed pinned blocks, so repeated snapshots of the
    same model reuse them instead of paying ``cudaHostAlloc`` again (that pinned memory stays
    reserved by the process until ``torch.cuda.empty_cache``-style release or exit).

    Non-tensor entries (e.g. Transformer Engine ``_extra_state`` blobs) are skipped. Meta tensors
    and DTensors are refused (``ValueError``): gather distributed weights first.
    """
    if isinstance(model_or_state_dict, torch.nn.Module):
        source: Mapping[str, Any] = model_or_state_dict.state_dict()
    else:
        source = model_or_state_dict
    copies: dict[tuple[Any, ...], torch.Tensor] = {}
    cuda_devices: set[torch.device] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in source.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        _check_copyable(name, tensor)
        key = _alias_key(tensor)
        if key not in copies:
            copies[key] = _copy_to_host(tensor)
            if tensor.is_cuda:
                cuda_devices.add(tensor.device)
        out[name] = copies[key]
    for device in cuda_devices:
        torch.cuda.current_stream(device).synchronize()
    return out


def _check_copyable(name: str, tensor: torch.Tensor) -> None:
    if tensor.is_meta:
        raise ValueError(f"{name}: is a meta tensor (no data to copy)")
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        raise ValueError(f"{name}: is a {type(tensor).__name__}; gather distributed tensors before export")
    if tensor.layout != torch.strided:
        raise ValueError(f"{name}: layout {tensor.layout} is not supported (dense tensors only)")


def _alias_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Identity of the *view*: two entries with the same key hold the very same values."""
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    on_cuda = tensor.is_cuda
    dst = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=on_cuda)
    dst.copy_(tensor.detach(), non_blocking=on_cuda)
    return dst


# --------------------------------------------------------------------------------------------------
# Writing files


def write_hf_files(
    out_dir: Path,
    state_dict: Mapping[str, torch.Tensor],
    base_model_dir: Path | None,
    config: PretrainedConfig | dict[str, Any] | None = None,
    max_shard_bytes: int = 2 * 1024**3,
    checksum: Checksum | None = None,
    *,
    fsync: bool = False,
) -> dict[str, FileRecord]:
    """Write an HF snapshot's files into ``out_dir`` (created if missing); see the module docstring.

    ``config`` overrides the base's ``config.json``; one of them must exist. ``checksum`` replaces
    ``zlib.crc32`` (same running signature; the result is still reported under ``"crc32"``).
    ``fsync`` flushes each file to stable storage before returning (not needed on tmpfs).
    Returns ``{path relative to out_dir: {"bytes": n, "crc32": c}}`` for every file written.
    """
    out_dir = Path(out_dir)
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    crc: Checksum = checksum or zlib.crc32
    config_json = _resolve_config_json(config, base_model_dir)
    tensors = _drop_tied_lm_head(_validated(state_dict), _ties_word_embeddings(config_json))
    out_dir.mkdir(parents=True, exist_ok=True)
    records: dict[str, FileRecord] = {}
    records.update(_write_weights(out_dir, tensors, max_shard_bytes, crc, fsync))
    records[CONFIG_NAME] = write_chunks(out_dir / CONFIG_NAME, [config_json.encode()], crc, fsync)
    if base_model_dir is not None:
        for rel in _metadata_files(Path(base_model_dir)):
            if rel != CONFIG_NAME:
                records[rel] = copy_file(Path(base_model_dir) / rel, out_dir / rel, crc, fsync)
    return records


def _validated(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not state_dict:
        raise ValueError("state_dict is empty")
    bad: list[str] = []
    for name, tensor in state_dict.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            bad.append(f"{name!r}: not a str -> Tensor entry")
        elif tensor.device.type != "cpu" or tensor.layout != torch.strided:
            bad.append(f"{name}: on {tensor.device} ({tensor.layout}); need a dense CPU tensor")
        elif not tensor.is_contiguous():
            bad.append(f"{name}: not contiguous")
        elif tensor.dtype not in DTYPES:
            bad.append(f"{name}: dtype {tensor.dtype} not supported by safetensors here")
    if bad:
        raise ValueError("state_dict cannot be written: " + "; ".join(bad))
    return dict(state_dict)


# ---- config and ties


def _resolve_config_json(config: PretrainedConfig | dict[str, Any] | None, base: Path | None) -> str:
    if isinstance(config, PretrainedConfig):
        return config.to_json_string()
    if isinstance(config, dict):
        return json.dumps(config, indent=2, sort_keys=True) + "\n"
    if config is not None:
        raise ValueError(f"config must be a PretrainedConfig, a dict or None, not {type(config).__name__}")
    if base is not None and (Path(base) / CONFIG_NAME).is_file():
        return (Path(base) / CONFIG_NAME).read_text(encoding="utf-8")
    raise ValueError("no config: pass config= or a base_model_dir holding config.json")


def _ties_word_embeddings(config_json: str) -> bool:
    """Whether the config ties ``lm_head`` to the input embeddings; ``False`` when unknowable.

    ``False`` is the safe default: ``lm_head.weight`` is then written, never dropped.
    """
    data = json.loads(config_json)
    if "tie_word_embeddings" in data:
        return bool(data["tie_word_embeddings"])
    model_type = data.get("model_type")
    if not model_type:
        return False
    try:
        resolved = AutoConfig.for_model(**data)
    except (ValueError, KeyError, TypeError):
        return False
    return bool(getattr(resolved, "tie_word_embeddings", False))


def _drop_tied_lm_head(tensors: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    head = tensors.get("lm_head.weight")
    if not tied or head is None:
        return tensors
    for name, other in tensors.items():
        if name != "lm_head.weight" and _same_values(head, other):
            return {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    raise ValueError(
        "config ties word embeddings but lm_head.weight neither shares storage with nor equals any "
        "other tensor (e.g. model.embed_tokens.weight); refusing to drop it"
    )


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return torch.equal(a, b)


# ---- safetensors shards


def _write_weights(
    out_dir: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int, crc: Checksum, fsync: bool
) -> dict[str, FileRecord]:
    shards = _plan_shards(tensors, max_shard_bytes)
    names = _shard_names(len(shards))
    records: dict[str, FileRecord] = {}
    weight_map: dict[str, str] = {}
    for file_name, shard in zip(names, shards, strict=True):
        records[file_name] = write_safetensors(out_dir / file_name, shard, crc, fsync)
        weight_map.update(dict.fromkeys(shard, file_name))
    if len(shards) > 1:
        total = sum(nbytes(t) for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        body = (json.dumps(index, indent=2) + "\n").encode()
        records[SAFE_WEIGHTS_INDEX_NAME] = write_chunks(
            out_dir / SAFE_WEIGHTS_INDEX_NAME, [body], crc, fsync
        )
    return records


def _plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy, in state-dict order (as transformers does): a new shard when the next would overflow."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        n = nbytes(tensor)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += n
    return shards


def _shard_names(count: int) -> list[str]:
    if count == 1:
        return [SAFE_WEIGHTS_NAME]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


# ---- file writing with on-the-fly checksums


def _metadata_files(base: Path) -> list[str]:
    """Relative paths of the base model's metadata files (see :data:`METADATA_FILES`)."""
    if not base.is_dir():
        raise ValueError(f"base_model_dir {base} is not a directory")
    found = [p.name for p in base.iterdir() if p.is_file() and _is_metadata(p.name)]
    templates = base / CHAT_TEMPLATES_DIR
    if templates.is_dir():
        found += [
            f"{CHAT_TEMPLATES_DIR}/{p.name}"
            for p in templates.iterdir()
            if p.is_file() and p.suffix == ".jinja"
        ]
    return sorted(found)


def _is_metadata(name: str) -> bool:
    return name in METADATA_FILES or name.endswith(METADATA_SUFFIXES)


# --------------------------------------------------------------------------------------------------
# LoRA adapter snapshots


def write_adapter_files(
    out_dir: Path,
    state_dict: Mapping[str, torch.Tensor],
    adapter_config: Mapping[str, Any],
    checksum: Checksum | None = None,
    *,
    fsync: bool = False,
) -> dict[str, FileRecord]:
    """Write a LoRA adapter snapshot's files: ``adapter_model.safetensors`` (PEFT's key names, e.g.
    ``base_model.model.<module>.lora_A.weight``) and ``adapter_config.json``, with the same writer,
    on-the-fly checksums and exclusive creation as :func:`write_hf_files`; returns their records.

    ``adapter_config`` must be JSON-serialisable and say ``"peft_type": "LORA"``; its ``r`` and
    ``target_modules`` are what an sglang server sizes its LoRA memory pool from.
    """
    from ckpteval.coord.snapshots.snapshot import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    if adapter_config.get("peft_type") != "LORA":
        raise ValueError(f"adapter_config must have peft_type 'LORA', got {adapter_config.get('peft_type')!r}")
    crc: Checksum = checksum or zlib.crc32
    tensors = _validated(state_dict)
    body = (json.dumps(dict(adapter_config), indent=2, sort_keys=True) + "\n").encode()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return {
        ADAPTER_WEIGHTS: write_safetensors(out_dir / ADAPTER_WEIGHTS, tensors, crc, fsync),
        ADAPTER_CONFIG: write_chunks(out_dir / ADAPTER_CONFIG, [body], crc, fsync),
    }
