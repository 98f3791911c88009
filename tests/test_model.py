"""The reference model and task: tokenizer files, model building, examples, training tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ckpteval.jobs.reference.model import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB,
    ModelConfig,
    batch_for_training,
    build_model,
    build_tokenizer,
    count_parameters,
    exact_match,
    make_addition_examples,
    save_base_model_dir,
    save_tokenizer,
)


def test_tokenizer_round_trips_through_autotokenizer_from_saved_files(tmp_path: Path) -> None:
    save_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = "07+35=042\n 9 + 1 = 10"
    ids = tok(text)["input_ids"]
    assert ids[0] == BOS_ID
    assert ids[1:] == [VOCAB[c] for c in text]
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert tok.decode([VOCAB["4"], VOCAB["2"], EOS_ID, PAD_ID], skip_special_tokens=True) == "42"
    assert (
        json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"]
        == "PreTrainedTokenizerFast"
    )


def test_tokenizer_pads_on_the_left() -> None:
    batch = build_tokenizer()(["1+2=", "11+22="], padding=True)
    assert batch["input_ids"][0][:2] == [PAD_ID, PAD_ID]
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1, 1]


def test_base_model_dir_has_metadata_and_weights_only_when_asked(tmp_path: Path) -> None:
    cfg = ModelConfig()
    meta_only = save_base_model_dir(tmp_path / "meta", cfg, "qwen2")
    names = {p.name for p in meta_only.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(n.endswith((".safetensors", ".bin")) for n in names)
    config = AutoConfig.from_pretrained(meta_only, local_files_only=True)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen2", 128, 2)

    model = build_model(cfg, "llama", seed=3)
    with_weights = save_base_model_dir(tmp_path / "full", cfg, "llama", model=model)
    assert (with_weights / "model.safetensors").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(with_weights, use_safetensors=True, local_files_only=True)
    x = torch.tensor([[BOS_ID, VOCAB["1"], VOCAB["+"]]])
    assert torch.equal(reloaded(x).logits, model(x).logits)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_build_model_is_tiny_and_deterministic_in_seed(arch: str) -> None:
    a, b, c = build_model(arch=arch, seed=0), build_model(arch=arch, seed=0), build_model(arch=arch, seed=1)
    assert 0.45e6 < count_parameters(a) < 0.6e6
    assert a.config.num_hidden_layers == 2 and a.config.hidden_size == 128
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_build_model_rejects_unknown_arch_and_bad_shapes() -> None:
    with pytest.raises(ValueError, match="unknown arch"):
        build_model(arch="gpt2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="multiple of num_heads"):
        ModelConfig(hidden_size=130, num_heads=4)


def test_addition_examples_are_fixed_width_correct_and_seeded() -> None:
    examples = make_addition_examples(200, seed=7)
    assert examples == make_addition_examples(200, seed=7)
    assert examples != make_addition_examples(200, seed=8)
    for ex in examples:
        prompt, answer = ex["prompt"], ex["answer"]
        assert len(prompt) == 6 and prompt[2] == "+" and prompt[5] == "="
        assert len(answer) == 3
        assert int(prompt[:2]) + int(prompt[3:5]) == int(answer)
    assert exact_match(" 042\n", "042") == 1.0 and exact_match("42", "042") == 0.0


def test_batch_for_training_puts_loss_on_answer_and_eos_only() -> None:
    tok = build_tokenizer()
    batch = batch_for_training([{"prompt": "07+35=", "answer": "042"}], tok)
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    assert ids == [BOS_ID] + [VOCAB[c] for c in "07+35=042"] + [EOS_ID]
    assert labels == [-100] * 7 + [VOCAB["0"], VOCAB["4"], VOCAB["2"], EOS_ID]
    assert batch["attention_mask"].tolist() == [[1] * 11]


def test_training_lowers_the_answer_loss() -> None:
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = build_model(seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        loss = model(**batch_for_training(make_addition_examples(64, seed=step), tok)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0]
