"""Tests for ckpteval.jobs.trainer.export.hf_files: a tiny real Llama round-trips bit-exactly through the snapshot files."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from ckpteval.jobs.trainer.export.hf_files import SAFE_WEIGHTS_INDEX_NAME, snapshot_host_copy, write_hf_files

SMALL_SHARD = 40_000  # bytes: forces several shards for the 2-layer, hidden-64 model


def _config(tied: bool) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def _model(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(1234)
    model = LlamaForCausalLM(_config(tied)).eval()
    with torch.no_grad():  # random norms too, so a mix-up of any two tensors shows in the logits
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def _write_tokenizer(base: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i + 3 for i in range(20)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(base / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
    }
    (base / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (base / "special_tokens_map.json").write_text(json.dumps({"unk_token": "<unk>", "eos_token": "</s>"}))
    (base / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.fixture
def base_dir(tmp_path: Path) -> Path:
    """A base model dir with metadata AND decoy weights that must never reach a snapshot."""
    base = tmp_path / "base"
    base.mkdir()
    cfg = _config(tied=False)
    cfg.max_position_embeddings = 4096  # differs from the explicit config, to see which one wins
    (base / "config.json").write_text(cfg.to_json_string())
    (base / "generation_config.json").write_text(json.dumps({"do_sample": False, "max_new_tokens": 7}))
    _write_tokenizer(base)
    st.save_file({"model.embed_tokens.weight": torch.zeros(128, 64)}, str(base / "model.safetensors"))
    (base / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    (base / "pytorch_model.bin").write_bytes(b"not a pickle, and never copied")
    return base


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 9, 33, 2, 127, 64, 3], [4, 4, 100, 7, 8, 0, 12, 90]])
    with torch.no_grad():
        return model(ids).logits


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_sharded_export_loads_bit_exact(tmp_path: Path, base_dir: Path, tied: bool) -> None:
    model = _model(tied)
    out = tmp_path / "snap"
    records = write_hf_files(
        out, snapshot_host_copy(model), base_dir, model.config, max_shard_bytes=SMALL_SHARD
    )

    index = json.loads((out / SAFE_WEIGHTS_INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size()
        for k, t in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    )
    assert ("lm_head.weight" in index["weight_map"]) is not tied

    loaded = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True).eval()
    assert torch.equal(_logits(loaded), _logits(model))

    # metadata only from the base; the explicit config wins over the base's config.json
    assert _files(out) == set(records)
    assert {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    } <= set(records)
    assert "model.safetensors" not in records and "pytorch_model.bin" not in records
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 64
    assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 7
    assert AutoTokenizer.from_pretrained(out)("w1 w2")["input_ids"][-2:] == [4, 5]

    for rel, rec in records.items():
        data = (out / rel).read_bytes()
        assert {k: rec[k] for k in ("bytes", "crc32")} == {"bytes": len(data), "crc32": zlib.crc32(data)}, rel
        assert ("tensors" in rec) is rel.endswith(".safetensors"), rel  # per-tensor digests (#19)


def test_single_shard_is_byte_identical_to_safetensors(tmp_path: Path) -> None:
    model = _model(tied=True)
    host = snapshot_host_copy(model)
    assert host["lm_head.weight"] is host["model.embed_tokens.weight"]  # the tie survives the copy
    records = write_hf_files(tmp_path / "o", host, None, model.config)
    assert set(records) == {"model.safetensors", "config.json"}
    expected = st.save({k: v for k, v in host.items() if k != "lm_head.weight"}, metadata={"format": "pt"})
    assert (tmp_path / "o" / "model.safetensors").read_bytes() == expected


def test_base_config_used_when_none_given(tmp_path: Path, base_dir: Path) -> None:
    model = _model(tied=False)
    write_hf_files(tmp_path / "o", model.state_dict(), base_dir)
    assert json.loads((tmp_path / "o" / "config.json").read_text())["max_position_embeddings"] == 4096


def test_refuses_bad_inputs(tmp_path: Path) -> None:
    model = _model(tied=True)
    sd = snapshot_host_copy(model)
    untied_head = dict(sd, **{"lm_head.weight": sd["lm_head.weight"] + 1})
    with pytest.raises(ValueError, match="lm_head.weight"):
        write_hf_files(tmp_path / "a", untied_head, None, model.config)
    with pytest.raises(ValueError, match="not contiguous"):
        write_hf_files(tmp_path / "b", {"w": torch.zeros(4, 3).t()}, None, model.config)
    with pytest.raises(ValueError, match="no config"):
        write_hf_files(tmp_path / "c", sd, None)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    with pytest.raises(FileExistsError):
        write_hf_files(tmp_path / "d", sd, None, model.config)
