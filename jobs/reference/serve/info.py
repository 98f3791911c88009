"""What ``ckpteval serve`` reports about itself, as sglang 0.5.23 does: ``/model_info``, ``/server_info`` and
``/weights_checker``'s checksum, from the state :class:`~ckpteval.jobs.reference.serve.engine.EngineService`
holds (its served label and path, its launch settings).

Limits (stand-in, not sglang): one GPU's worth of server (tp, dp, pp 1); of ``/weights_checker``'s actions
only ``checksum`` is answered, the others are refused.
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any

from ckpteval.jobs.reference.serve.requests import Refused

if TYPE_CHECKING:
    from ckpteval.jobs.reference.serve.engine import EngineService

# sglang 0.5.23 srt/utils/weight_checker.py: buffers recomputed from shapes, never checksummed
NON_PERSISTENT_BUFFER_PATTERNS = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")
EMULATED_SGLANG_VERSION = "0.5.23"


def weights_checker(model: Any, action: str) -> dict[str, Any]:
    """``/weights_checker`` as sglang 0.5.23 answers ``action: "checksum"`` on one GPU
    (``srt/utils/weight_checker.py`` ``_compute_checksum``, ``srt/managers/tokenizer_control_mixin.py``
    ``check_weights``): per tensor (parameters, then buffers; non-persistent ones skipped) the first
    8 bytes of SHA-256 of its bytes as 16 hex digits, ``per_gpu_checksum`` the SHA-256 over the
    sorted names and checksums, ``per_engine_checksum`` the SHA-256 of the ranks' per-GPU checksums.
    Other actions (``snapshot``, ``compare``, ``reset_tensors``) and no model are refused (:class:`Refused`)."""
    if action != "checksum":
        raise Refused(f"Unsupported action={action!r} (the stand-in answers 'checksum' only)")
    if model is None:
        raise Refused("no model loaded")
    checksums = {
        name: hashlib.sha256(_raw_bytes(t)).digest()[:8].hex()
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if not any(p in name for p in NON_PERSISTENT_BUFFER_PATTERNS)
    }
    overall = hashlib.sha256()
    for name in sorted(checksums):
        overall.update(name.encode())
        overall.update(checksums[name].encode())
    per_gpu = overall.hexdigest()
    placement = dict(tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, rank=0, size=1)
    rank = {"checksums": checksums, "per_gpu_checksum": per_gpu,
            "parallelism_info": [{"role": "target", **placement}]}
    return {"success": True, "message": "Success.", "ranks": [rank],
            "per_engine_checksum": hashlib.sha256(per_gpu.encode()).hexdigest()}


def model_info(service: EngineService) -> dict[str, Any]:
    """``/model_info``: the served path and label (both change on a successful load only)."""
    model = service.engine.model
    config = model.config if model is not None else None
    return {
        "model_path": service.model_path,
        "served_model_name": service.model_path,
        "tokenizer_path": service.launch_model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": service.label,
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(config, "model_type", None),
        "architectures": getattr(config, "architectures", None),
    }


def model_card(service: EngineService) -> dict[str, Any]:
    """The base model's card as sglang 0.5.23 answers ``GET /v1/models`` (``http_server.py``
    ``available_models``, ``protocol.py`` ``ModelCard``): the served name (the launch path; no
    ``--served-model-name`` here) and the model's context length. No LoRA: no adapter cards."""
    name = service.launch_model_path
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": name,
            "parent": None, "max_model_len": service.context_length()}


def models(service: EngineService) -> dict[str, Any]:
    """``GET /v1/models``: sglang's ``ModelList`` of one card."""
    return {"object": "list", "data": [model_card(service)]}


def server_info(service: EngineService) -> dict[str, Any]:
    """``/server_info`` as 0.5.23 builds it (``http_server.py`` ``server_info``: the server args, one
    ``internal_states`` entry per DP rank with ``effective_max_running_requests_per_dp``,
    ``scheduler_components/internal_state.py``): one GPU's worth (tp, dp, pp 1)."""
    return {
        "tp_size": 1, "dp_size": 1, "pp_size": 1, "enable_dp_attention": False,
        "max_running_requests": service.max_running, "max_queued_requests": service.max_queued,
        "max_total_tokens": service.max_total_tokens,
        "model_path": service.launch_model_path,
        "served_model_name": service.launch_model_path,
        "weight_version": service.launch_label,
        "enable_deterministic_inference": service.deterministic,
        "attention_backend": service.resolved.attention_backend,
        "sampling_backend": service.resolved.sampling_backend,
        "disable_radix_cache": service.resolved.disable_radix_cache,
        "enable_lora": False,
        "load_format": "auto",
        "context_length": None,
        "internal_states": [{"effective_max_running_requests_per_dp": service.max_running, "dp_rank": 0}],
        # resolved server args that change /weights_checker's checksum (srt/utils/common.py build_server_info)
        "dtype": service.launch_dtype,
        "quantization": None,
        "device": "cuda" if service.engine.gpus else "cpu",
        "startup_time": service.startup_time,
        "version": EMULATED_SGLANG_VERSION,
        "frontend": "python",
    }


def _raw_bytes(tensor: Any) -> bytes:
    import torch  # the engine already imported it; kept out of this module's import time

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
