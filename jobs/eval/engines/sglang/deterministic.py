"""sglang's deterministic mode (``--enable-deterministic-inference``): what it covers, what it costs, and which launch
options it refuses or adjusts, as sglang 0.5.23 resolves them, so the launch and ``ckpteval serve`` agree with it.

Limits: only ``--attention-backend``'s check and its fallback (chosen per GPU and model) are reproduced. See docs/USER_GUIDE.md "sglang: what the worker relies
on".
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DETERMINISTIC_FLAG = "--enable-deterministic-inference"  # srt/arg_groups/fields/exec_.py
ATTENTION_FLAG = "--attention-backend"
# srt/arg_groups/choices.py DETERMINISTIC_ATTENTION_BACKEND_CHOICES, RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND
DETERMINISTIC_ATTENTION_BACKENDS = ("ascend", "fa3", "fa4", "flashinfer", "intel_xpu", "triton")
RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKENDS = ("ascend", "fa3", "fa4", "triton")
ATTENTION_BACKENDS = ("triton", "torch_native", "flex_attention", "dsa", "nsa", "qsa", "dsv4", "compressed", "fa3",
                      "fa4", "flashinfer", "llada2_cfg_flashinfer", "flashmla", "trtllm_mla", "cutedsl_mla",
                      "tokenspeed_mla", "trtllm_mha", "hpc_ops", "minicpm_flashattn", "minicpm_flashinfer", "aiter",
                      "wave", "intel_amx", "ascend", "intel_xpu")  # choices.py ATTENTION_BACKEND_CHOICES
FALLBACK_ATTENTION_BACKEND = "fa3"  # overrides.py: no backend given, Hopper (SM90) and older
# overrides.py _deterministic_is_deepseek_model: on SM100/SM120 these fall back to triton, others to flashinfer
DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                          "MistralLarge3ForCausalLM", "PixtralForConditionalGeneration", "GlmMoeDsaForCausalLM",
                          "Glm4MoeLiteForCausalLM")
# srt/configs/model_config.py sets AttentionArch.MLA for these (and others, all carrying kv_lora_rank)
MLA_ARCHITECTURES = (*DEEPSEEK_ARCHITECTURES, "DeepseekV3ForCausalLMNextN", "MiniCPM3ForCausalLM",
                     "DeepseekVL2ForCausalLM", "KimiVLForConditionalGeneration", "KimiK25ForConditionalGeneration",
                     "LongcatFlashForCausalLM")
SAFE_ATTENTION_BACKEND = "triton"  # deterministic, radix-capable, no SM floor (attention_registry.py)


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in an argv (``--flag V`` or ``--flag=V``; the last one wins, as argparse)."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(f"{flag}="):
            value = arg.partition("=")[2]
    return value


def attention_problem(attention_backend: str | None) -> str | None:
    """sglang's refusal of an explicit ``--attention-backend`` in deterministic mode (``overrides.py``
    ``_deterministic_attention_backend``), word for word; None when it is accepted."""
    if attention_backend is None or attention_backend in DETERMINISTIC_ATTENTION_BACKENDS:
        return None
    return (f"Currently only {list(DETERMINISTIC_ATTENTION_BACKENDS)} attention backends are supported for "
            f"deterministic inference, but you explicitly specified '{attention_backend}'.")


@dataclass(frozen=True)
class Resolved:
    """The server args the deterministic mode decides (as ``/server_info`` reports them once resolved)."""

    attention_backend: str | None
    sampling_backend: str | None
    disable_radix_cache: bool


def resolve(deterministic: bool, attention_backend: str | None, sampling_backend: str | None = None,
            disable_radix_cache: bool = False) -> Resolved:
    """What sglang resolves for these launch options on a Hopper-or-older GPU; ValueError (sglang's
    message) for an attention backend the mode refuses."""
    if not deterministic:
        return Resolved(attention_backend, sampling_backend, disable_radix_cache)
    if (problem := attention_problem(attention_backend)) is not None:
        raise ValueError(problem)
    backend = attention_backend or FALLBACK_ATTENTION_BACKEND
    return Resolved(backend, "pytorch" if sampling_backend != "ascend" else sampling_backend,
                    disable_radix_cache or backend not in RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKENDS)


def _architectures(config: Mapping[str, Any]) -> list[str]:
    return [str(a) for a in config.get("architectures") or ()]


def uses_mla(config: Mapping[str, Any]) -> bool:
    """Whether sglang runs ``config`` (a ``config.json``) with MLA attention (model_config.py): one of its MLA
    architectures, or a config whose (text) part carries ``kv_lora_rank``."""
    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
    return (any(a in MLA_ARCHITECTURES for a in _architectures(config))
            or config.get("kv_lora_rank") is not None or text.get("kv_lora_rank") is not None)


def fallback_backend(capability: tuple[int, int], config: Mapping[str, Any]) -> str:
    """The backend deterministic mode falls back to with no ``--attention-backend`` (overrides.py
    ``_deterministic_attention_backend``): SM100/SM120 flashinfer (triton for DeepSeek-like models), else fa3."""
    if capability[0] in (10, 12):
        return "triton" if any(a in DEEPSEEK_ARCHITECTURES for a in _architectures(config)) else "flashinfer"
    return FALLBACK_ATTENTION_BACKEND


def fa3_runs(capability: tuple[int, int], mla: bool) -> bool:
    """sglang's fa3 asserts at model init unless SM90, or SM80-89 without MLA (attention_registry.py
    ``create_flashattention_v3_backend``)."""
    return capability[0] == 9 or (capability[0] == 8 and not mla)


def attention_choice(extra_args: Sequence[str], capability: tuple[int, int] | None,
                     config: Mapping[str, Any]) -> list[str]:
    """Flags choosing the deterministic attention backend for this GPU and model where sglang's own fallback
    (fa3) would die at model init (pre-Ampere GPUs; MLA models below SM90): ``--attention-backend triton``.
    Nothing when the mode is off, a backend is given, the capability is unknown or the fallback runs."""
    if DETERMINISTIC_FLAG not in extra_args or flag_value(extra_args, ATTENTION_FLAG) is not None:
        return []
    if capability is None or fallback_backend(capability, config) != "fa3" or fa3_runs(capability, uses_mla(config)):
        return []
    return [ATTENTION_FLAG, SAFE_ATTENTION_BACKEND]


def model_config(model_path: str) -> dict[str, Any]:
    """The snapshot's ``config.json`` ({} when it has none or it is not an object: nothing known)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def gpu_capability(env: Mapping[str, str], base_gpu: int = 0) -> tuple[int, int] | None:
    """The compute capability of the GPU a launch runs on (NVML through ``nvidia-smi``, as sglang's platform
    probe: the first of ``CUDA_VISIBLE_DEVICES`` past ``--base-gpu-id``; found on the launch ``env``'s PATH);
    None when it cannot be read."""
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    device = visible[base_gpu] if base_gpu < len(visible) else str(base_gpu)
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader", "-i", device],
                              capture_output=True, text=True, timeout=30, check=False, env=dict(env))
        major, _, minor = done.stdout.strip().splitlines()[0].partition(".")
        return int(major), int(minor or 0)
    except (OSError, subprocess.TimeoutExpired, IndexError, ValueError):
        return None


def launch_flags(deterministic: bool, extra_args: Sequence[str]) -> list[str]:
    """The flags ckpteval adds to an sglang launch for ``deterministic``: :data:`DETERMINISTIC_FLAG` unless
    ``extra_args`` has it already. ValueError (naming the option) when ``extra_args`` would make sglang
    refuse to start in that mode — found at worker start, not after a minutes-long failed launch."""
    on = deterministic or DETERMINISTIC_FLAG in extra_args
    if on and (problem := attention_problem(flag_value(extra_args, ATTENTION_FLAG))) is not None:
        raise ValueError(f"sglang would refuse to start with {DETERMINISTIC_FLAG}: {problem} Drop "
                         f"{ATTENTION_FLAG} from eval.engine.sglang.extra_args, or opt every dataset out "
                         "(\"deterministic\": false)")
    return [DETERMINISTIC_FLAG] if deterministic and DETERMINISTIC_FLAG not in extra_args else []
