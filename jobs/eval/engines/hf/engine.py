"""``HFEngine``: the in-process transformers engine (CPU or CUDA) behind ``ckpteval serve``.

Owns building the model from a snapshot (safetensors only; ``dtype="auto"`` keeps the snapshot's dtype) and
reloading a same-config snapshot in place, under the lock every generation holds (a generation sees old weights
with the old version or new with new; a copy failing midway makes the version ``None``); batched generation,
greedy or seeded per row (:mod:`~ckpteval.jobs.eval.engines.hf.sampling`); prompts over the context refused as
sglang does. Limits: the tokenizer is read on (re-)instantiation only; ``generation_config.json`` is ignored.
See docs/USER_GUIDE.md "Dataset kinds and engines".
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessorList,
    PretrainedConfig,
    PreTrainedModel,
)

from ckpteval.coord.results.engine_identity import EngineIdentity
from ckpteval.jobs.eval.engines.base import EngineError, Generation, SamplingParams, WeightDigests
from ckpteval.jobs.eval.engines.hf.decode import Completion, completion, eos_ids, generation_config, pad_id
from ckpteval.jobs.eval.engines.hf.sampling import (
    SeededSampler,
    check_context,
    check_ids,
    left_pad,
    seeded_rng,
    validate_sampling,
    validate_seeds,
)
from ckpteval.jobs.eval.engines.hf.weights import (
    TensorIndex,
    arch_signature,
    copy_into_resident,
    index_tensors,
    param_digests,
    read_config,
    resident_targets,
    resolve_dtype,
    weight_files,
)
from ckpteval.jobs.eval.kinds.generate.tokenizer_files import tokenizer_dir
from ckpteval.jobs.eval.proof.logprobs import teacher_forced

# transformers builds models under process-global contexts (meta device, skipped init): two builds
# in different threads corrupt each other ("Cannot copy out of meta tensor"), so builds take turns.
_BUILD_LOCK = threading.Lock()
_DTYPES: dict[str, torch.dtype | str] = {
    "auto": "auto",
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


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
        self.tokenizer_fallback: Path | None = None  # the run's tokenizer, for snapshots saved without one

    # ------------------------------------------------------------------ introspection
    @property
    def model(self) -> PreTrainedModel | None:
        """The live model object (the same object across in-place reloads)."""
        return self._model

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def weight_version(self) -> str | None:
        with self._lock:
            return self._version

    @property
    def compute_dtype(self) -> str | None:
        """The dtype the held model computes in (``"float32"``, ``"bfloat16"``, ...); None before a load."""
        model = self._model
        return None if model is None else str(model.dtype).removeprefix("torch.")

    def engine_identity(self) -> EngineIdentity:
        """In-process transformers: its and torch's versions, the compute dtype, one device (named, on
        CUDA), ``max_batch_size`` prompts per forward; no batch-invariant mode (``deterministic`` False)."""
        import transformers

        device = str(self._device)
        if self._device.type == "cuda" and torch.cuda.is_available():
            device = f"cuda:{torch.cuda.get_device_name(self._device)}"
        return EngineIdentity("hf", version=f"transformers {transformers.__version__}, torch {torch.__version__}",
                              dtype=self.compute_dtype, device=device, concurrency=self._max_batch_size)

    @property
    def gpus(self) -> int:
        """GPUs this engine occupies: 1 on a CUDA device, else 0."""
        return 1 if self._device.type == "cuda" else 0

    @contextlib.contextmanager
    def held(self) -> Iterator[tuple[PreTrainedModel, Any]]:
        """The loaded model and tokenizer, for a caller that drives the model itself (lm-eval's HFLM).

        Holds the engine's lock for the block, so no load, restart or generation swaps the weights (or
        the version) underneath; :class:`EngineError` if nothing is loaded.
        """
        with self._lock:
            yield self._require_loaded()

    # ------------------------------------------------------------------ loading
    def load(self, snapshot_dir: str, weight_version: str) -> None:
        if not isinstance(weight_version, str):
            raise ValueError(f"weight_version must be a str, got {weight_version!r}")
        snapshot = Path(snapshot_dir)
        signature = self._signature_of(snapshot)
        with self._load_lock:
            if self._model is not None and signature == self._signature:
                self._reload_in_place(snapshot, weight_version)
            else:
                self._instantiate(snapshot, weight_version, signature)

    def _signature_of(self, snapshot: Path) -> dict[str, Any]:
        """What must equal the resident model's for ``snapshot`` to load in place: its architecture."""
        return arch_signature(read_config(snapshot))

    def _instantiate(self, snapshot: Path, version: str | None, signature: dict[str, Any]) -> None:
        model, tokenizer = self._build(snapshot)
        self._install(model, tokenizer, signature, version, snapshot)

    def _build(self, snapshot: Path) -> tuple[PreTrainedModel, Any]:
        """A model (in the resolved dtype, still on CPU) and its tokenizer from an HF model dir."""
        weight_files(snapshot)  # refuse pickle-only snapshots before transformers looks at them
        dtype = resolve_dtype(self._dtype, snapshot, read_config(snapshot), self._device)
        tokenizer_source = tokenizer_dir(snapshot, self.tokenizer_fallback)  # TokenizerMissing: a skip, not a restart
        try:
            with _BUILD_LOCK, _quiet_transformers():
                model = AutoModelForCausalLM.from_pretrained(
                    snapshot, dtype=dtype, use_safetensors=True, local_files_only=True
                )
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, local_files_only=True)
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

    def _targets(self, model: torch.nn.Module, snapshot: Path) -> tuple[dict[str, torch.Tensor], TensorIndex]:
        """The resident tensors ``snapshot``'s files overwrite in place, names and shapes checked."""
        index = index_tensors(weight_files(snapshot))
        return resident_targets(model, index), index

    def _reload_in_place(self, snapshot: Path, version: str) -> None:
        targets, index = self._targets(self._model, snapshot)  # nothing touched yet
        with self._lock:
            try:
                copy_into_resident(targets, index, self._device)
            except (RuntimeError, OSError, SafetensorError) as e:
                self._version = None  # some weights may already be overwritten
                raise EngineError(f"in-place load of {snapshot} failed midway: {e}") from e
            self._version, self._snapshot = version, snapshot

    def weight_digests(self, dtypes: dict[str, str], digest: str = "crc32") -> WeightDigests:
        """``digest`` of each weight held now, in the snapshot's dtypes and names
        (:func:`~ckpteval.jobs.eval.engines.hf.weights.param_digests`), under the lock (no load interleaves)."""
        with self._lock:
            model = self._require_loaded()[0]
            return param_digests(model, dtypes, digest)

    def teacher_forced(self, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """The canary's recomputation (:func:`ckpteval.jobs.eval.proof.logprobs.teacher_forced`) of each ``(prompt,
        continuation)`` with the held model and the tokenizer it generates with, under the lock."""
        with self._lock:
            model, tokenizer = self._require_loaded()
            return teacher_forced(model, tokenizer, pairs)

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompts: list[str], params: SamplingParams, seeds: list[int] | None = None
    ) -> list[Generation]:
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise ValueError("prompts must be a list of str")
        with self._lock:
            tokenizer = self._require_loaded()[1]
            rows = tokenizer(prompts)["input_ids"] if prompts else []
            return [c.generation() for c in self.generate_ids(rows, params, seeds)]

    def generate_ids(
        self, input_ids: list[list[int]], params: SamplingParams, seeds: list[int] | None = None
    ) -> list[Completion]:
        """Complete already-tokenized prompts (sglang's ``input_ids`` requests); ``seeds``: one per row."""
        validate_sampling(params)
        validate_seeds(seeds, len(input_ids) if isinstance(input_ids, list) else 0)
        per_row = seeds is not None and params.temperature > 0
        with self._lock:
            model, tokenizer = self._require_loaded()
            check_ids(input_ids, model.config.vocab_size)
            check_context(input_ids, params.max_new_tokens, model.config)
            results: list[Completion] = []
            with seeded_rng(None if per_row else params.seed, self._device):
                for start in range(0, len(input_ids), self._max_batch_size):
                    chunk = input_ids[start : start + self._max_batch_size]
                    row_seeds = seeds[start : start + len(chunk)] if per_row and seeds is not None else None
                    results.extend(self._generate_chunk(model, tokenizer, chunk, params, row_seeds))
            return results

    def _generate_chunk(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        rows: Sequence[list[int]],
        params: SamplingParams,
        seeds: Sequence[int] | None = None,
    ) -> list[Completion]:
        input_ids, attention_mask = left_pad(rows, pad_id(model.config, tokenizer))
        processors = LogitsProcessorList()
        if seeds is not None:  # per-row generators draw the token; the decoder itself is greedy
            processors.append(SeededSampler(seeds, params, self._device))
        decoding = params if seeds is None else SamplingParams(max_new_tokens=params.max_new_tokens)
        config = generation_config(decoding, model.config, tokenizer)
        try:
            with torch.inference_mode():
                out = model.generate(
                    input_ids=input_ids.to(self._device),
                    attention_mask=attention_mask.to(self._device),
                    generation_config=config,
                    logits_processor=processors,
                )
        except RuntimeError as e:
            raise EngineError(f"generation failed: {e}") from e
        new_tokens = out[:, input_ids.shape[1] :].tolist()
        eos = eos_ids(model.config, tokenizer)
        return [completion(tokenizer, row, new, eos, self._version) for row, new in zip(rows, new_tokens, strict=True)]

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
