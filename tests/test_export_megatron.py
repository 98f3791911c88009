"""Tests for ckpteval.jobs.trainer.export.megatron: a real megatron-core GPTModel (CPU, gloo, TP=PP=1) and its HF
conversion give the same logits; wrong or incomplete mappings are refused.

Megatron on CPU needs three things (see :func:`_cpu_current_device` and :func:`megatron_env`): a
CUDA-free RNG tracker, ``torch.cuda.current_device`` answering "cpu" while the model builds and runs
(the rotary embedding moves ``inv_freq`` to it), and an explicit causal attention mask.
"""

from __future__ import annotations

import contextlib
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from ckpteval.jobs.trainer.export import megatron as conv
from ckpteval.jobs.trainer.export.hf_files import write_hf_files

SEQ = 12
IDS = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(7))  # < every case's vocab
COMMON: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 64,
    "normalization": "RMSNorm",
    "gated_linear_unit": True,
    "activation_func": F.silu,
    "layernorm_epsilon": 1e-5,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "use_cpu_initialization": True,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "masked_softmax_fusion": False,
    "persist_layer_norm": False,
}
# name -> (TransformerConfig overrides, padded megatron vocab, true vocab, tied, rotary base, arch)
CASES: dict[str, tuple[dict[str, Any], int, int, bool, float, conv.Arch]] = {
    # GQA 4 heads / 2 groups, head_dim 32 != hidden/heads, untied, no bias, padded vocab
    "llama": (
        {"num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 32, "ffn_hidden_size": 96,
         "add_bias_linear": False, "add_qkv_bias": False},
        128, 120, False, 500000.0, "llama",
    ),
    # GQA 8 heads / 2 groups, qkv bias, tied embeddings
    "qwen2": (
        {"num_attention_heads": 8, "num_query_groups": 2, "ffn_hidden_size": 128,
         "add_bias_linear": False, "add_qkv_bias": True},
        96, 96, True, 1000000.0, "qwen2",
    ),
}  # fmt: skip
TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


@contextlib.contextmanager
def _cpu_current_device() -> Iterator[None]:
    """Megatron asks CUDA for the current device (rotary ``inv_freq``, global memory buffer): say cpu."""
    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        yield


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def megatron_env() -> Iterator[dict[str, Any]]:
    """World size 1 under gloo with TP=PP=1; yields the megatron classes the tests need."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        pytest.importorskip("megatron.core", reason="megatron-core is not importable")
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.tensor_parallel.random import initialize_rng_tracker
        from megatron.core.transformer.transformer_config import TransformerConfig
    started_pg = not torch.distributed.is_initialized()
    if started_pg:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    started_mp = not parallel_state.model_parallel_is_initialized()
    if started_mp:
        parallel_state.initialize_model_parallel(1, 1)
    yield {
        "GPTModel": GPTModel,
        "TransformerConfig": TransformerConfig,
        "spec": get_gpt_layer_local_spec,
        "rng": initialize_rng_tracker,
    }
    if started_mp:
        parallel_state.destroy_model_parallel()
    if started_pg:
        torch.distributed.destroy_process_group()


def _perturb(model: torch.nn.Module) -> None:
    """Random init leaves norms at 1 and biases at 0, hiding mapping mistakes: randomise everything."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
            else:
                param.add_(0.05 * torch.randn_like(param))


@pytest.fixture(scope="module")
def built(megatron_env: dict[str, Any]) -> dict[str, tuple[Any, torch.nn.Module, torch.Tensor]]:
    """Per case: (TransformerConfig, perturbed GPTModel, megatron logits over the true vocab)."""
    out = {}
    for seed, (name, (kw, padded, vocab, tied, base, _)) in enumerate(CASES.items()):
        torch.manual_seed(100 + seed)
        megatron_env["rng"](inference_rng_tracker=True, force_reset=True)
        tcfg = megatron_env["TransformerConfig"](**COMMON, **kw)
        with _cpu_current_device():
            model = megatron_env["GPTModel"](
                tcfg, megatron_env["spec"](normalization="RMSNorm"), vocab_size=padded, max_sequence_length=64,
                position_embedding_type="rope", rotary_base=base, share_embeddings_and_output_weights=tied,
            )  # fmt: skip
            model.eval()
            _perturb(model)
            mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)  # True = masked
            with torch.no_grad():
                logits = model(IDS, torch.arange(SEQ)[None].expand(2, -1), attention_mask=mask)
        out[name] = (tcfg, model, logits[..., :vocab])
    return out


def _convert(name: str, tcfg: Any, sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    _, _, vocab, tied, _, arch = CASES[name]
    return conv.convert_megatron_state_dict(sd, tcfg, arch, vocab, tied)


def _hf_config(name: str, tcfg: Any) -> Any:
    _, _, vocab, tied, base, arch = CASES[name]
    return conv.megatron_to_hf_config(tcfg, arch, vocab, tied, rotary_base=base, max_position_embeddings=64)


def _hf_logits(name: str, tcfg: Any, hf_sd: dict[str, torch.Tensor]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_config(_hf_config(name, tcfg)).eval()
    result = model.load_state_dict(hf_sd, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise AssertionError(f"load mismatch: {result}")
    model.tie_weights()
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_through_snapshot_files(name: str, built: dict[str, Any], tmp_path: Path) -> None:
    tcfg, model, mg_logits = built[name]
    hf_sd = _convert(name, tcfg, model.state_dict())
    assert ("lm_head.weight" in hf_sd) is not CASES[name][3]
    write_hf_files(tmp_path / "snap", hf_sd, None, _hf_config(name, tcfg))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "snap", use_safetensors=True).eval()
    with torch.no_grad():
        hf_logits = hf(IDS).logits
    assert hf_logits.shape == mg_logits.shape
    torch.testing.assert_close(hf_logits, mg_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(CASES))
def test_transformer_engine_names_convert_the_same(name: str, built: dict[str, Any]) -> None:
    tcfg, model, _ = built[name]
    local = model.state_dict()
    te = {}
    for key, value in local.items():
        for old, new in TE_NAMES.items():
            key = key.replace(old, new)
        te[key] = value
    assert any(k.endswith("linear_qkv.layer_norm_weight") for k in te)
    expected, got = _convert(name, tcfg, local), _convert(name, tcfg, te)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_unknown_megatron_parameter_is_refused(built: dict[str, Any]) -> None:
    tcfg, model, _ = built["llama"]
    sd = dict(model.state_dict())
    sd["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.ones(32)
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.self_attention\.q_layernorm\.weight"):
        _convert("llama", tcfg, sd)


def test_missing_parameter_names_the_unfilled_hf_parameter(built: dict[str, Any]) -> None:
    tcfg, model, _ = built["qwen2"]
    sd = dict(model.state_dict())
    del sd["decoder.layers.1.mlp.linear_fc2.weight"]
    with pytest.raises(ValueError, match=r"unfilled.*model\.layers\.1\.mlp\.down_proj\.weight"):
        _convert("qwen2", tcfg, sd)


def test_both_norm_spellings_are_refused(built: dict[str, Any]) -> None:
    tcfg, model, _ = built["llama"]
    sd = dict(model.state_dict())
    sd["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"] = sd[
        "decoder.layers.0.input_layernorm.weight"
    ]
    with pytest.raises(ValueError, match="filled twice"):
        _convert("llama", tcfg, sd)


def test_wrong_layout_conventions_change_the_logits(
    built: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The logits comparison catches a swapped [up; gate] split and an ungrouped [q; k; v] split."""
    tcfg, model, mg_logits = built["llama"]
    sd = model.state_dict()
    torch.testing.assert_close(
        _hf_logits("llama", tcfg, _convert("llama", tcfg, sd)), mg_logits, atol=1e-4, rtol=1e-4
    )

    right_fc1 = conv.split_fc1
    monkeypatch.setattr(conv, "split_fc1", lambda t: tuple(reversed(right_fc1(t))))
    assert not torch.allclose(_hf_logits("llama", tcfg, _convert("llama", tcfg, sd)), mg_logits, atol=1e-2)
    monkeypatch.setattr(conv, "split_fc1", right_fc1)

    def ungrouped(t: torch.Tensor, heads: int, kv: int, dim: int) -> tuple[torch.Tensor, ...]:
        return tuple(t.split([heads * dim, kv * dim, kv * dim]))

    monkeypatch.setattr(conv, "split_qkv", ungrouped)
    assert not torch.allclose(_hf_logits("llama", tcfg, _convert("llama", tcfg, sd)), mg_logits, atol=1e-2)


def test_tied_output_must_equal_embedding(built: dict[str, Any]) -> None:
    tcfg, model, _ = built["qwen2"]
    sd = dict(model.state_dict())
    sd["output_layer.weight"] = sd["embedding.word_embeddings.weight"] + 1
    with pytest.raises(ValueError, match="output_layer.weight differs"):
        _convert("qwen2", tcfg, sd)


def test_inexpressible_configs_are_refused() -> None:
    base = dict(COMMON, num_attention_heads=4, ffn_hidden_size=96, add_bias_linear=False, add_qkv_bias=False)
    with pytest.raises(ValueError, match="normalization"):
        conv.megatron_to_hf_config(dict(base, normalization="LayerNorm"), "llama", 100, False)
    with pytest.raises(ValueError, match="layernorm_zero_centered_gamma"):
        conv.megatron_to_hf_config(dict(base, layernorm_zero_centered_gamma=True), "llama", 100, False)
    with pytest.raises(ValueError, match="activation_func"):
        conv.megatron_to_hf_config(dict(base, activation_func=F.gelu), "llama", 100, False)
    with pytest.raises(ValueError, match="qwen2"):
        conv.megatron_to_hf_config(base, "qwen2", 100, True)  # Qwen2 always has a qkv bias
    with pytest.raises(ValueError, match="arch='qwen2'"):
        conv.megatron_to_hf_config(dict(base, add_qkv_bias=True), "llama", 100, False)
