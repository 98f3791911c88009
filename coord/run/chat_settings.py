"""run.json checks of an entry's chat settings: ``chat_template_kwargs`` (``generate``, ``env``, ``lm_eval``) and
``reasoning`` (``generate``, ``env``).

Guarantee: a malformed setting is refused when run.json is parsed (a :class:`~ckpteval.coord.run.fields.FieldError`
naming the field), never at the first unit. Limits: the shape only — whether a template reads a kwarg, or a
``tokenizer`` reasoning end resolves, is known only on a snapshot (:mod:`ckpteval.jobs.eval.kinds.generate.reasoning`).
"""

from __future__ import annotations

from typing import Any

from ckpteval.coord.run.fields import FieldError

RENDER_ARGS = frozenset({"conversation", "messages", "tools", "tokenize", "add_generation_prompt", "continue_final_message",
                         "return_dict", "documents", "chat_template"})  # apply_chat_template's own arguments
REASONING_KEYS = frozenset({"end", "start", "always", "parser"})
# sglang 0.5.23's --reasoning-parser names whose rule the split reproduces (srt/parser/reasoning_parser.py)
REASONING_PARSERS = ("deepseek-r1", "qwen3", "glm45", "kimi_k2")


def check_template_kwargs(kwargs: dict[str, Any], prompt_format: str) -> None:
    """``chat_template_kwargs``: only with ``chat`` prompts, and none of the arguments rendering sets itself."""
    check_rendered_kwargs(kwargs, prompt_format == "chat", "needs prompt_format 'chat' (a raw prompt renders no template)")


def check_rendered_kwargs(kwargs: dict[str, Any], renders_chat: bool, needs: str) -> None:
    """``chat_template_kwargs`` of an entry that renders a chat template only when ``renders_chat`` (else the
    FieldError says what it ``needs``), and none of the arguments rendering sets itself."""
    if not kwargs:
        return
    if not renders_chat:
        raise FieldError("chat_template_kwargs", needs)
    taken = sorted(set(kwargs) & RENDER_ARGS)
    if taken:
        raise FieldError("chat_template_kwargs", f"sets {', '.join(taken)}, which rendering sets itself")


def check_reasoning(value: dict[str, Any] | None) -> None:
    """``reasoning``: ``{"end": str[, "start": str][, "always": bool]}`` (``end`` may be ``"tokenizer"``), or
    ``{"parser": NAME}``: sglang's reasoning parser of that name (:data:`REASONING_PARSERS`)."""
    if value is None:
        return
    unknown = sorted(set(value) - REASONING_KEYS)
    if unknown:
        raise FieldError("reasoning", f"has {', '.join(unknown)}; its keys are end, start, always, parser")
    if "parser" in value:
        if value["parser"] not in REASONING_PARSERS or set(value) != {"parser"}:
            raise FieldError("reasoning", f"parser must be one of {', '.join(REASONING_PARSERS)}, alone (it names "
                             f"sglang's rule, delimiters included), got {value}")
        return
    for key in ("end", "start"):
        if (key in value or key == "end") and not (isinstance(value.get(key), str) and value[key]):
            raise FieldError("reasoning", f"{key} must be a non-empty string (end: the delimiter, or 'tokenizer')")
    if not isinstance(value.get("always", False), bool):
        raise FieldError("reasoning", "always must be true or false")
