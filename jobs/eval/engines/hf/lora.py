"""``HFLoRAEngine``: the in-process transformers engine for runs whose snapshots are LoRA adapters.

A run with ``eval.base_model`` in ``run.json`` publishes adapter snapshots (``adapter_config.json`` +
``adapter_model.safetensors``) trained on one fixed base model. This engine holds the base resident and
swaps only the adapter per snapshot.

What it owns and promises:

- The first :meth:`HFLoRAEngine.load` builds the base from ``base_model`` (``from_pretrained``, dtype as
  :class:`~ckpteval.jobs.eval.engines.hf.engine.HFEngine` resolves it) and its tokenizer, injects the adapter's LoRA
  layers with ``peft.inject_adapter_in_model`` (the model stays a plain transformers model), and copies
  the adapter's tensors into them.
- A later load whose ``adapter_config.json`` matches the resident one (every key except bookkeeping such
  as ``base_model_name_or_path``/``peft_version``) copies the new adapter tensors into the same LoRA
  parameters, one tensor at a time, under the lock every generation holds: the base is never reloaded.
  Names and shapes are checked against the file headers before anything is touched (a bad snapshot
  leaves the old adapter and version in place); a copy that still fails midway leaves version ``None``.
  A different adapter config (rank, target modules, alpha) rebuilds base + adapter.
- File names are PEFT's (``base_model.model.<module>.lora_A.weight``), what ``PeftModel.save_pretrained``
  and :func:`ckpteval.jobs.trainer.export.hf_files.write_adapter_files` write; only safetensors are read (no
  pickled ``adapter_model.bin``).

Limits: LoRA only (``peft_type == "LORA"``), no ``modules_to_save`` (fully trained extra modules) and
no DoRA; the base is read once and assumed unchanged for the engine's life (run.json promises it).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from ckpteval.coord.snapshots.snapshot import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from ckpteval.jobs.eval.engines.base import EngineError, UnsupportedSnapshot
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.engines.hf.weights import TensorIndex, copy_into_resident, index_tensors

# adapter_config.json keys that do not change the adapter's layout or scaling.
_ADAPTER_BOOKKEEPING = frozenset({"base_model_name_or_path", "peft_version", "revision", "inference_mode", "auto_mapping"})
PEFT_PREFIX = "base_model.model."  # PeftModel's wrapper prefix on every saved key
ADAPTER = "default"  # the injected adapter's name inside the model


def read_adapter_config(snapshot: Path) -> dict[str, Any]:
    """The snapshot's ``adapter_config.json``; :class:`EngineError` if absent, not JSON or not LoRA."""
    path = snapshot / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EngineError(f"not a LoRA adapter snapshot: cannot read {path}: {e}") from e
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise UnsupportedSnapshot(f"{path}: peft_type must be 'LORA' (got {config.get('peft_type')!r})")
    if config.get("modules_to_save") or config.get("use_dora"):
        raise UnsupportedSnapshot(f"{path}: modules_to_save / DoRA adapters are not supported")
    return config


def adapter_signature(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in _ADAPTER_BOOKKEEPING}


def lora_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The injected LoRA parameters under the names a PEFT adapter file uses for them."""
    marker = f".{ADAPTER}."
    return {
        PEFT_PREFIX + name.replace(marker, "."): p for name, p in model.named_parameters() if marker in name
    }


class HFLoRAEngine(HFEngine):
    """Base model resident, LoRA adapter swapped per snapshot; see the module docstring."""

    def __init__(self, base_model: str, device: str = "cpu", dtype: str | torch.dtype = "auto",
                 max_batch_size: int = 256) -> None:
        super().__init__(device=device, dtype=dtype, max_batch_size=max_batch_size)
        self._base = Path(base_model)

    @property
    def base_model(self) -> str:
        return str(self._base)

    def _signature_of(self, snapshot: Path) -> dict[str, Any]:
        """The adapter's layout and scaling (the base is fixed): a new one rebuilds base + adapter."""
        return adapter_signature(read_adapter_config(snapshot))

    def _instantiate(self, snapshot: Path, version: str | None, signature: dict[str, Any]) -> None:
        """Base from disk + the snapshot's LoRA layers and tensors; installed only when all succeeded."""
        from peft import LoraConfig, inject_adapter_in_model

        config = read_adapter_config(snapshot)
        model, tokenizer = self._build(self._base)
        fields = set(LoraConfig.__dataclass_fields__)
        try:
            lora = LoraConfig(**{k: v for k, v in config.items() if k in fields})
            inject_adapter_in_model(lora, model, adapter_name=ADAPTER)
        except (ValueError, TypeError, KeyError) as e:
            raise EngineError(f"cannot apply {snapshot / ADAPTER_CONFIG} to {self._base}: {e}") from e
        model.to(self._device)
        self._copy_adapter(model, snapshot)
        self._install(model, tokenizer, signature, version, snapshot)

    def _targets(self, model: torch.nn.Module, snapshot: Path) -> tuple[dict[str, torch.Tensor], TensorIndex]:
        """LoRA parameters by file name, checked against the adapter file's names and shapes (in-place
        reloads of :class:`HFEngine` copy into these)."""
        index = index_tensors([snapshot / ADAPTER_WEIGHTS])
        params = lora_parameters(model)
        missing, unexpected = sorted(params.keys() - index.keys()), sorted(index.keys() - params.keys())
        wrong = [f"{k}: {index[k].shape} != {tuple(params[k].shape)}" for k in index.keys() & params.keys()
                 if index[k].shape != tuple(params[k].shape)]
        if missing or unexpected or wrong:
            raise EngineError(
                f"{snapshot / ADAPTER_WEIGHTS} does not fit the injected adapter: missing={missing[:5]} "
                f"unexpected={unexpected[:5]} wrong_shape={wrong[:5]}"
            )
        return dict(params), index

    def _copy_adapter(self, model: torch.nn.Module, snapshot: Path) -> None:
        targets, index = self._targets(model, snapshot)
        copy_into_resident(targets, index, self._device)

    def restart(self) -> None:
        """Rebuild base + adapter from the last snapshot (version kept); if that snapshot is gone, drop
        the model (version ``None``): the next :meth:`load` rebuilds it."""
        with self._load_lock:
            snapshot, version, signature = self._snapshot, self._version, self._signature
            with self._lock:
                self._release_model()
            if snapshot is not None and snapshot.is_dir() and signature is not None:
                with contextlib.suppress(EngineError):
                    self._instantiate(snapshot, version, signature)
