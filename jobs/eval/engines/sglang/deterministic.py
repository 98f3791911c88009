"""sglang's deterministic mode (``--enable-deterministic-inference``): what it covers, what it costs, and which launch
options it refuses or adjusts, as sglang 0.5.23 resolves them, so the launch and ``ckpteval serve`` agree with it.

Limits: only ``--attention-backend``'s check is reproduced. See docs/USER_GUIDE.md "sglang: what the worker relies
on".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
