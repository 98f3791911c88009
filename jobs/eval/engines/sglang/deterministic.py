"""sglang's deterministic mode (``--enable-deterministic-inference``): what it covers, what it costs, and
which launch options it refuses or adjusts — as sglang 0.5.23 resolves them, so ckpteval's launch
(:class:`~ckpteval.jobs.eval.engines.sglang.engine.SGLangEngine`) and its stand-in (``ckpteval serve``) agree with it.

What the flag covers (paths inside the 0.5.23 wheel, ``sglang/srt/``):

- batch-invariant kernels: ``model_executor/model_runner.py`` ``maybe_enable_batch_invariant_mode``
  registers ``batch_invariant_ops/batch_invariant_ops.py`` for ``aten::mm``, ``addmm``, ``bmm``,
  ``_log_softmax``, ``mean.dim`` and ``rms_norm``: a row's result no longer depends on how many rows share
  the batch (greedy decoding included);
- attention: ``arg_groups/overrides.py`` ``_deterministic_attention_backend`` accepts only
  :data:`DETERMINISTIC_ATTENTION_BACKENDS` (``arg_groups/choices.py``) — any other explicit
  ``--attention-backend`` is a ``ValueError`` at start — and, given none, picks ``fa3`` on Hopper and
  older, ``flashinfer`` on Blackwell (``triton`` for DeepSeek-style models there): the kernels depend on
  the GPU generation, which is why a result records the backend;
- prefix cache: ``arg_groups/attention_hook.py`` ``handle_deterministic_inference`` disables the radix
  cache for a backend outside :data:`RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKENDS` (flashinfer);
- chunked prefill: ``managers/scheduler.py`` ``init_deterministic_inference_config`` truncates chunks to
  the flashinfer prefill split tile (``SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE``, 4096);
- sampling: ``arg_groups/overrides.py`` ``_deterministic_sampling_backend`` forces ``--sampling-backend
  pytorch``; ``sampling/sampling_batch_info.py`` applies ``sampling_seed`` only in this mode (unseeded
  requests use 42); ``layers/sampler.py`` reads the flag;
- tensor parallelism: at ``--tp-size`` > 1 on CUDA, NCCL's tree all-reduce with a pinned channel count,
  custom and symmetric-memory all-reduce off (``attention_hook.py``); so a completion repeats only at one
  TP size, and on ROCm above TP 2 ``--disable-custom-all-reduce`` is refused (``overrides.py``
  ``_deterministic_rocm_rccl_check``);
- not covered: LoRA (``lora/backend/`` is outside it); UNO speculative decoding refuses the flag
  (``arg_groups/speculative_hook.py``).

What it costs: throughput, never correctness — fixed-split kernels instead of the fastest per shape,
the pytorch sampler, no prefix reuse on flashinfer, shorter prefill chunks, a slower all-reduce at TP > 1.
Its size depends on the model and GPU and is not measured here (no GPU in CI).

Limits: only ``--attention-backend``'s check is reproduced (the DeepSeek/MLA and ROCm checks need the
model's config and the platform, which only the launched server knows; sglang still refuses those at
start, and the worker then stops with the log's path).
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
