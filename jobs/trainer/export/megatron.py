"""Direct conversion of a megatron-core ``GPTModel`` state dict to the HF Llama / Qwen2 layout.

Guarantee: never exports wrong or zero weights silently (an unmapped or missing entry is a ValueError naming it).
Limits: a full (gathered) state dict; no MoE, MTP or RoPE scaling; vocab padding rows dropped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig, Qwen2Config, Qwen2ForCausalLM

Arch = Literal["llama", "qwen2"]

IGNORED_SUFFIXES: tuple[str, ...] = ("_extra_state", ".inv_freq")
"""Megatron state-dict entries that are not weights: TE/megatron extra state, rotary buffers."""

_HF_CLASSES: dict[str, tuple[type[PretrainedConfig], type[torch.nn.Module]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}

# Megatron options that change the computation, with the only value HF Llama/Qwen2 can express.
_MUST_BE_DEFAULT: dict[str, Any] = {
    "apply_residual_connection_post_layernorm": False,
    "layernorm_zero_centered_gamma": False,
    "glu_linear_offset": 0.0,
    "activation_func_clamp_value": None,
    "num_moe_experts": None,
    "multi_latent_attention": False,
    "qk_layernorm": False,
    "rotary_interleaved": False,
    "window_size": None,
    "softmax_scale": None,
    "softmax_type": "vanilla",
    "attention_output_gate": False,
    "no_rope_freq": None,
    "experimental_attention_variant": None,
    "is_hybrid_model": False,
    "heterogeneous_block_specs": False,
    "mrope_section": None,
}


# --------------------------------------------------------------------------------------------------
# Megatron config


@dataclass(frozen=True)
class _Dims:
    """What the conversion needs from a megatron TransformerConfig, validated."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    eps: float
    bias_linear: bool
    qkv_bias: bool


def _field(tcfg: Any, name: str, default: Any = ...) -> Any:
    """Read a field from a TransformerConfig, any object with its attributes, or a mapping."""
    if isinstance(tcfg, Mapping):
        value = tcfg.get(name, default)
    else:
        value = getattr(tcfg, name, default)
    if value is ...:
        raise ValueError(f"megatron config lacks required field {name!r}")
    return value


def _is_silu(fn: Any) -> bool:
    return fn is F.silu or isinstance(fn, torch.nn.SiLU) or (isinstance(fn, str) and fn == "silu")


def _dims(tcfg: Any) -> _Dims:
    problems = [
        f"{name}={_field(tcfg, name, default)!r} (need {default!r})"
        for name, default in _MUST_BE_DEFAULT.items()
        if _field(tcfg, name, default) != default
    ]
    if _field(tcfg, "normalization") != "RMSNorm":
        problems.append(f"normalization={_field(tcfg, 'normalization')!r} (need 'RMSNorm')")
    if not _field(tcfg, "gated_linear_unit"):
        problems.append("gated_linear_unit=False (need SwiGLU: True)")
    if not _is_silu(_field(tcfg, "activation_func")):
        problems.append(f"activation_func={_field(tcfg, 'activation_func')!r} (need silu)")
    if problems:
        raise ValueError("megatron config not expressible as HF Llama/Qwen2: " + "; ".join(problems))
    hidden = int(_field(tcfg, "hidden_size"))
    heads = int(_field(tcfg, "num_attention_heads"))
    kv_heads = int(_field(tcfg, "num_query_groups", None) or heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_query_groups={kv_heads}")
    return _Dims(
        num_layers=int(_field(tcfg, "num_layers")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(_field(tcfg, "kv_channels", None) or hidden // heads),
        ffn_hidden_size=int(_field(tcfg, "ffn_hidden_size")),
        eps=float(_field(tcfg, "layernorm_epsilon")),
        bias_linear=bool(_field(tcfg, "add_bias_linear")),
        qkv_bias=bool(_field(tcfg, "add_qkv_bias", False)),
    )


def megatron_to_hf_config(
    tcfg: Any,
    arch: Arch,
    vocab_size: int,
    tie_embeddings: bool,
    *,
    rotary_base: float = 10000.0,
    max_position_embeddings: int = 4096,
    dtype: torch.dtype | None = None,
    **hf_overrides: Any,
) -> PretrainedConfig:
    """The HF ``LlamaConfig`` / ``Qwen2Config`` of a megatron GPT model.

    ``tcfg``: a megatron ``TransformerConfig`` (or an object/mapping with its field names).
    ``rotary_base`` and ``max_position_embeddings`` are ``GPTModel`` arguments, not TransformerConfig
    fields, hence separate. ``vocab_size`` is the true (unpadded) vocabulary. ``hf_overrides`` go to
    the config constructor as they are (e.g. ``bos_token_id``, ``eos_token_id``).
    Raises ``ValueError`` when the model cannot be expressed exactly in ``arch``.
    """
    dims = _dims(tcfg)
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.ffn_hidden_size,
        "num_hidden_layers": dims.num_layers,
        "num_attention_heads": dims.num_heads,
        "num_key_value_heads": dims.num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": dims.eps,
        "tie_word_embeddings": tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(rotary_base)},
    }
    if dtype is not None:
        common["dtype"] = dtype
    if arch == "llama":
        if dims.qkv_bias and not dims.bias_linear:
            raise ValueError(
                "qkv-only bias (add_qkv_bias without add_bias_linear) is Qwen2-style: use arch='qwen2'"
            )
        extra = {"head_dim": dims.head_dim, "attention_bias": dims.bias_linear, "mlp_bias": dims.bias_linear}
        return LlamaConfig(**common, **extra, **hf_overrides)
    if arch == "qwen2":
        if dims.bias_linear or not dims.qkv_bias:
            raise ValueError("qwen2 needs add_qkv_bias=True and add_bias_linear=False (qkv bias only)")
        if dims.head_dim * dims.num_heads != dims.hidden_size:
            raise ValueError(
                f"qwen2 needs kv_channels == hidden_size / num_attention_heads, got {dims.head_dim}"
            )
        return Qwen2Config(**common, **hf_overrides)
    raise ValueError(f"arch must be 'llama' or 'qwen2', not {arch!r}")


# --------------------------------------------------------------------------------------------------
# Layout helpers (module level so tests can swap a convention and watch the logits disagree)


def split_qkv(
    fused: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split megatron's grouped ``linear_qkv`` weight ``[rows, hidden]`` or bias ``[rows]`` into q, k, v."""
    q_per_group = num_heads // num_kv_heads
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    if fused.shape[0] != rows:
        raise ValueError(f"linear_qkv has {fused.shape[0]} rows, expected {rows}")
    grouped = fused.reshape(num_kv_heads, q_per_group + 2, head_dim, *fused.shape[1:])
    q = grouped[:, :q_per_group].reshape(num_heads * head_dim, *fused.shape[1:])
    k = grouped[:, q_per_group].reshape(num_kv_heads * head_dim, *fused.shape[1:])
    v = grouped[:, q_per_group + 1].reshape(num_kv_heads * head_dim, *fused.shape[1:])
    return q, k, v


def split_fc1(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split megatron's ``linear_fc1`` (weight or bias) ``[gate; up]`` into ``(gate, up)``."""
    if fused.shape[0] % 2:
        raise ValueError(f"linear_fc1 has an odd number of rows ({fused.shape[0]})")
    gate, up = fused.chunk(2, dim=0)
    return gate, up


# --------------------------------------------------------------------------------------------------
# Conversion

Emit = list[tuple[str, torch.Tensor]]
_Rule = tuple[re.Pattern[str], Callable[[re.Match[str], torch.Tensor, _Dims, int], Emit]]

_LAYER = r"decoder\.layers\.(?P<layer>\d+)\."


def _hf_layer(m: re.Match[str], leaf: str) -> str:
    return f"model.layers.{int(m['layer'])}.{leaf}"


def _qkv(m: re.Match[str], t: torch.Tensor, d: _Dims, _: int) -> Emit:
    kind = m["kind"]  # weight | bias
    q, k, v = split_qkv(t, d.num_heads, d.num_kv_heads, d.head_dim)
    return [(_hf_layer(m, f"self_attn.{p}_proj.{kind}"), x) for p, x in zip("qkv", (q, k, v), strict=True)]


def _fc1(m: re.Match[str], t: torch.Tensor, d: _Dims, _: int) -> Emit:
    kind = m["kind"]
    gate, up = split_fc1(t)
    return [(_hf_layer(m, f"mlp.gate_proj.{kind}"), gate), (_hf_layer(m, f"mlp.up_proj.{kind}"), up)]


def _rename(leaf: str) -> Callable[[re.Match[str], torch.Tensor, _Dims, int], Emit]:
    def emit(m: re.Match[str], t: torch.Tensor, d: _Dims, _: int) -> Emit:
        return [(_hf_layer(m, leaf.format(kind=m.groupdict().get("kind"))), t)]

    return emit


def _vocab_rows(name: str) -> Callable[[re.Match[str], torch.Tensor, _Dims, int], Emit]:
    def emit(m: re.Match[str], t: torch.Tensor, d: _Dims, vocab_size: int) -> Emit:
        return [(name, t[:vocab_size] if t.shape[0] > vocab_size else t)]

    return emit


def _plain(name: str) -> Callable[[re.Match[str], torch.Tensor, _Dims, int], Emit]:
    return lambda m, t, d, v: [(name, t)]


_RULES: list[_Rule] = [
    (re.compile(r"embedding\.word_embeddings\.weight"), _vocab_rows("model.embed_tokens.weight")),
    (re.compile(r"output_layer\.weight"), _vocab_rows("lm_head.weight")),
    (re.compile(r"decoder\.final_layernorm\.weight"), _plain("model.norm.weight")),
    (re.compile(_LAYER + r"input_layernorm\.weight"), _rename("input_layernorm.weight")),
    (
        re.compile(_LAYER + r"self_attention\.linear_qkv\.layer_norm_weight"),
        _rename("input_layernorm.weight"),
    ),
    (re.compile(_LAYER + r"self_attention\.linear_qkv\.(?P<kind>weight|bias)"), _qkv),
    (
        re.compile(_LAYER + r"self_attention\.linear_proj\.(?P<kind>weight|bias)"),
        _rename("self_attn.o_proj.{kind}"),
    ),
    (re.compile(_LAYER + r"pre_mlp_layernorm\.weight"), _rename("post_attention_layernorm.weight")),
    (re.compile(_LAYER + r"mlp\.linear_fc1\.layer_norm_weight"), _rename("post_attention_layernorm.weight")),
    (re.compile(_LAYER + r"mlp\.linear_fc1\.(?P<kind>weight|bias)"), _fc1),
    (re.compile(_LAYER + r"mlp\.linear_fc2\.(?P<kind>weight|bias)"), _rename("mlp.down_proj.{kind}")),
]


def expected_hf_shapes(hf_config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """The HF model's state-dict keys and shapes (built on the meta device; no memory, no init)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _HF_CLASSES:
        raise ValueError(f"unsupported HF model_type {model_type!r}")
    with torch.device("meta"):
        model = _HF_CLASSES[model_type][1](hf_config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(hf_config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def convert_megatron_state_dict(
    state_dict: Mapping[str, Any],
    tcfg: Any,
    arch: Arch,
    vocab_size: int,
    tie_embeddings: bool,
    *,
    hf_config: PretrainedConfig | None = None,
) -> dict[str, torch.Tensor]:
    """Convert a full megatron-core GPTModel state dict to HF Llama/Qwen2 names and layouts.

    Returns ``{hf_name: tensor}`` with exactly the HF model's expected keys (``lm_head.weight``
    omitted when ``tie_embeddings``), ready for :func:`ckpteval.jobs.trainer.export.hf_files.write_hf_files` together
    with :func:`megatron_to_hf_config`'s config. ``hf_config`` defaults to that config (weights do
    not depend on RoPE base or context length). Raises ``ValueError`` as the module docstring says.
    """
    dims = _dims(tcfg)
    cfg = hf_config or megatron_to_hf_config(tcfg, arch, vocab_size, tie_embeddings)
    out: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    unknown: list[str] = []
    for name, tensor in state_dict.items():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "output_layer.weight" and tie_embeddings:
            _check_tied_output(state_dict, tensor, vocab_size)
            continue
        emitted = _apply_rules(name, tensor, dims, vocab_size)
        if emitted is None:
            unknown.append(name)
            continue
        for hf_name, value in emitted:
            if hf_name in out:
                raise ValueError(f"{hf_name} filled twice: from {source[hf_name]} and from {name}")
            out[hf_name], source[hf_name] = value.contiguous(), name
    if unknown:
        raise ValueError(f"no HF mapping for megatron parameters: {sorted(unknown)}")
    _check_against_hf(out, source, expected_hf_shapes(cfg))
    return out


def _apply_rules(name: str, tensor: Any, dims: _Dims, vocab_size: int) -> Emit | None:
    for pattern, emit in _RULES:
        m = pattern.fullmatch(name)
        if m is not None:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"megatron parameter {name} is a {type(tensor).__name__}, not a tensor")
            return emit(m, tensor, dims, vocab_size)
    return None


def _check_tied_output(state_dict: Mapping[str, Any], output: torch.Tensor, vocab_size: int) -> None:
    embedding = state_dict.get("embedding.word_embeddings.weight")
    if not isinstance(embedding, torch.Tensor) or not torch.equal(
        output[:vocab_size], embedding[:vocab_size]
    ):
        raise ValueError(
            "tie_embeddings=True but output_layer.weight differs from embedding.word_embeddings.weight"
        )


def _check_against_hf(
    out: dict[str, torch.Tensor], source: dict[str, str], expected: dict[str, tuple[int, ...]]
) -> None:
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ValueError(f"HF parameters left unfilled by the megatron state dict: {missing}")
    unexpected = sorted(f"{k} (from {source[k]})" for k in set(out) - set(expected))
    if unexpected:
        raise ValueError(f"converted parameters the HF model does not have: {unexpected}")
    wrong = sorted(
        f"{k}: {tuple(out[k].shape)} != {expected[k]} (from {source[k]})"
        for k in out
        if tuple(out[k].shape) != expected[k]
    )
    if wrong:
        raise ValueError(f"converted parameters with the wrong shape: {wrong}")
