"""The reference model and task: a tiny causal LM that learns 2-digit addition on CPU.

What this module owns, top to bottom:

1. A character-level tokenizer, saved as real Hugging Face tokenizer files (``tokenizer.json`` +
   ``tokenizer_config.json``) so ``AutoTokenizer.from_pretrained(dir)`` works offline, in
   transformers 5 and (via ``tokenizer_class = PreTrainedTokenizerFast``) in 4.x-based servers.
   Vocabulary: ``<pad> <bos> <eos> <unk>``, the digits, ``+``, ``=``, space and newline. Encoding
   prepends ``<bos>``; decoding concatenates characters (no spaces inserted). By default the
   tokenizer has **no chat template** (so a ``chat`` dataset is a ``no_chat_template`` skip);
   ``chat=True`` adds :data:`CHAT_TEMPLATE`, which writes each turn's content on its own line after
   a role marker (``=`` system, ``+`` user, space assistant), all characters of the vocabulary.
2. :class:`ModelConfig` and :func:`build_model`: a tiny ``LlamaForCausalLM`` or ``Qwen2ForCausalLM``
   built from a config (never downloaded). Default: 2 layers, hidden 128, ~0.53 M parameters, tied
   input/output embeddings.
3. :func:`save_base_model_dir`: the "base model dir" (config.json, generation_config.json,
   tokenizer files, weights only when a model is passed) that exporters copy metadata from, and
   :func:`save_hf_checkpoint`: a trainer's periodic HF checkpoint ``checkpoint-<step>/`` (what reuse
   mode marks ``.complete`` in place).
4. The task: ``"07+35="`` -> ``"042"``. Operands are zero-padded to 2 digits and the answer to 3, so
   every example has the same shape and the answer digit at each position is a fixed function of the
   operand digits (without fixed width the tiny model does not learn it). :func:`make_addition_examples`
   makes examples; :func:`batch_for_training` makes tensors with the loss on answer tokens + ``<eos>``
   only; :func:`exact_match` scores a completion.

Limits: the tokenizer maps any other character to ``<unk>``; the model is a toy for exercising the
eval machinery, not a benchmark.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from ckpteval.coord.atomic import fsync_dir, tmp_name
from ckpteval.coord.snapshots.snapshot import MARKER, checkpoint_dirname

# --------------------------------------------------------------------------------------------------
# 1. Tokenizer
# --------------------------------------------------------------------------------------------------

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
CHARACTERS: tuple[str, ...] = tuple("0123456789+= \n")
VOCAB: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
PAD_ID, BOS_ID, EOS_ID = VOCAB[PAD], VOCAB[BOS], VOCAB[EOS]
IGNORE_INDEX = -100  # label value the HF loss ignores


# role markers from the vocabulary, so a rendered conversation tokenizes without <unk>
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}={% elif m['role'] == 'user' %}+{% else %} {% endif %}"
    "{{ m['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %} {% endif %}"
)


def tokenizer_vocab(extra_chars: str = "") -> dict[str, int]:
    """:data:`VOCAB`, then each character of ``extra_chars`` it lacks (ids from ``len(VOCAB)`` on)."""
    vocab = dict(VOCAB)
    for c in extra_chars:
        vocab.setdefault(c, len(vocab))
    return vocab


def build_tokenizer(model_max_length: int = 64, chat: bool = False, extra_chars: str = "") -> PreTrainedTokenizerFast:
    """The character-level tokenizer: one token per character, ``<bos>`` prepended on encode.

    ``chat``: with :data:`CHAT_TEMPLATE` as its chat template (default: none). ``extra_chars``: more
    characters (:func:`tokenizer_vocab`; e.g. a judge model that must write JSON), the model's vocab to match.
    """
    core = Tokenizer(models.WordLevel(vocab=tokenizer_vocab(extra_chars), unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char
    core.decoder = decoders.Fuse()  # join characters back without separators
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",  # generation pads on the left
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
    if chat:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(path: str | Path, model_max_length: int = 64, chat: bool = False, extra_chars: str = "") -> None:
    """Write the tokenizer files into ``path`` (created if missing); ``chat``: with a chat template."""
    path = Path(path)
    build_tokenizer(model_max_length, chat, extra_chars).save_pretrained(path)
    # transformers 5 records its own backend class name; 4.x (what sglang runs on) knows this one.
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2) + "\n")


# --------------------------------------------------------------------------------------------------
# 2. Model
# --------------------------------------------------------------------------------------------------

Arch = Literal["llama", "qwen2"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the reference model; ``vocab_size`` is the tokenizer's."""

    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 64
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    vocab_size: int = len(VOCAB)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.vocab_size < len(VOCAB):
            raise ValueError(f"vocab_size {self.vocab_size} is smaller than the tokenizer's {len(VOCAB)}")


def hf_config(cfg: ModelConfig, arch: Arch = "llama") -> PretrainedConfig:
    """The transformers config for ``cfg`` (token ids match the tokenizer)."""
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(f"unknown arch {arch!r}: expected 'llama' or 'qwen2'")


def build_model(cfg: ModelConfig | None = None, arch: Arch = "llama", seed: int = 0) -> PreTrainedModel:
    """A freshly initialised model (float32, eval mode); same ``seed`` -> same weights."""
    config = hf_config(cfg or ModelConfig(), arch)
    model_cls = LlamaForCausalLM if arch == "llama" else Qwen2ForCausalLM
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left untouched
        torch.manual_seed(seed)
        return model_cls(config).eval()


def generation_config() -> GenerationConfig:
    """Greedy decoding that stops at ``<eos>``, the default every eval engine overrides per request."""
    return GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False, max_new_tokens=8
    )


def save_base_model_dir(
    path: str | Path,
    cfg: ModelConfig | None = None,
    arch: Arch = "llama",
    model: PreTrainedModel | None = None,
) -> Path:
    """Write a model dir: config.json, generation_config.json, tokenizer files.

    Weights (safetensors) are written only when ``model`` is given; its config must match
    ``cfg``/``arch``. Returns the path.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = cfg or ModelConfig()
    if model is None:
        hf_config(cfg, arch).save_pretrained(path)
    else:
        expected = hf_config(cfg, arch)
        if model.config.model_type != expected.model_type or model.config.hidden_size != cfg.hidden_size:
            raise ValueError(f"model ({model.config.model_type}) does not match cfg/arch ({arch}, {cfg})")
        model.save_pretrained(path, safe_serialization=True)
    generation_config().save_pretrained(path)
    save_tokenizer(path, cfg.max_position_embeddings)
    return path


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def save_hf_checkpoint(save_dir: str | Path, step: int, model: PreTrainedModel) -> Path:
    """``save_pretrained`` + tokenizer into ``<save_dir>/checkpoint-<step>`` (atomic rename).

    A checkpoint already marked complete (a resumed run re-running the step) is left alone: the
    fleet may be reading it.
    """
    final = Path(save_dir) / checkpoint_dirname(step)
    if (final / MARKER).is_file():
        return final
    if final.exists():
        shutil.rmtree(final)  # our own unmarked leftover of a killed save
    tmp = tmp_name(final)
    model.save_pretrained(tmp, safe_serialization=True)
    save_tokenizer(tmp, model.config.max_position_embeddings)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    return final


# --------------------------------------------------------------------------------------------------
# 3. Task: fixed-width 2-digit addition
# --------------------------------------------------------------------------------------------------


def format_prompt(a: int, b: int) -> str:
    """``"07+35="``: operands zero-padded to 2 digits."""
    if not (0 <= a <= 99 and 0 <= b <= 99):
        raise ValueError(f"operands must be in 0..99, got {a}, {b}")
    return f"{a:02d}+{b:02d}="


def format_answer(a: int, b: int) -> str:
    """``"042"``: the sum zero-padded to 3 digits."""
    return f"{a + b:03d}"


def make_addition_examples(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` examples ``{"prompt": "07+35=", "answer": "042"}``, deterministic in ``seed``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        examples.append({"prompt": format_prompt(a, b), "answer": format_answer(a, b)})
    return examples


def exact_match(completion: str, answer: str) -> float:
    """1.0 when the completion (surrounding whitespace ignored) is exactly the answer, else 0.0."""
    return float(completion.strip() == answer)


def batch_for_training(
    examples: list[dict[str, str]], tokenizer: PreTrainedTokenizerFast
) -> dict[str, torch.Tensor]:
    """``input_ids``/``attention_mask``/``labels`` for a causal LM, right-padded.

    Each row is ``<bos> prompt answer <eos>``; labels are ``-100`` everywhere except the answer
    tokens and ``<eos>`` (the model shifts labels itself), so the loss is on the answer only.
    """
    if not examples:
        raise ValueError("batch_for_training needs at least one example")
    prompts = tokenizer([ex["prompt"] for ex in examples])["input_ids"]
    answers = tokenizer([ex["answer"] for ex in examples], add_special_tokens=False)["input_ids"]
    rows = [(p + a + [EOS_ID], len(p)) for p, a in zip(prompts, answers, strict=True)]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
        attention_mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
