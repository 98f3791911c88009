"""Turning eval-set rows into the exact prompt text every engine receives — the one place that does it.

A dataset's ``prompt_format`` (run.json) decides:

- ``raw``: a row's ``prompt`` string is sent as is (rows with ``messages`` are refused when loaded).
- ``chat``: the row's ``messages`` (a list of ``{"role", "content"}``; a ``prompt`` string is one user
  message) are rendered with the **snapshot's own tokenizer** chat template,
  ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **chat_template_kwargs)``
  (the dataset's ``chat_template_kwargs``: ``enable_thinking``, ``reasoning_effort``, ...); a dataset
  ``system_prompt`` is put first unless the row starts with its own system message.

The worker's engines (hf, http, sglang, pools), the trainer's shared posture and the ``fn`` backends'
input all get their text from :func:`render_prompts`, so the same row of the same snapshot is the
same text everywhere. A ``chat`` dataset on a snapshot whose tokenizer has no chat template raises
:class:`NoChatTemplate` (a ``no_chat_template`` skip), never a silently raw prompt.

Limits: the tokenizer is read from the snapshot directory (``local_files_only``) and cached per
snapshot path (a few per process); transformers is imported only for ``chat`` datasets.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from ckpteval.coord.entries.generate import GenerateEntry

_CACHE_SIZE = 4


class NoChatTemplate(RuntimeError):
    """A ``chat`` dataset met a snapshot whose tokenizer has no chat template."""

    reason = "no_chat_template"


class TokenizerCache:
    """Snapshot tokenizers by path, the most recent few kept."""

    def __init__(self, size: int = _CACHE_SIZE) -> None:
        self.size = size
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, snapshot_dir: str) -> Any:
        with self._lock:
            if snapshot_dir in self._items:
                self._items.move_to_end(snapshot_dir)
                return self._items[snapshot_dir]
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(snapshot_dir, local_files_only=True)
        except (OSError, ValueError) as e:
            raise RuntimeError(f"cannot read the tokenizer of {snapshot_dir}: {e}") from e
        with self._lock:
            self._items[snapshot_dir] = tokenizer
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return tokenizer


_TOKENIZERS = TokenizerCache()


def snapshot_tokenizer(snapshot_dir: str) -> Any:
    """The snapshot's tokenizer (cached per process)."""
    return _TOKENIZERS.get(snapshot_dir)


def row_messages(spec: GenerateEntry, row: dict[str, Any]) -> list[dict[str, str]]:
    """The chat messages of a row: its ``messages`` or its ``prompt`` as a user turn, system prompt first."""
    messages = [dict(m) for m in row["messages"]] if "messages" in row else [{"role": "user", "content": row["prompt"]}]
    if spec.system_prompt is not None and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": spec.system_prompt})
    return messages


def render_chat(tokenizer: Any, messages: list[dict[str, str]], where: str,
                tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
    """``messages`` in the tokenizer's chat template, ready for the assistant's turn (``tools``: the
    OpenAI-style tool schemas of a tool-using episode, rendered by the template's own ``tools`` support;
    ``template_kwargs``: the dataset's ``chat_template_kwargs``, variables of the template such as
    ``enable_thinking``, as sglang passes a request's ``chat_template_kwargs``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate(f"{where}: the tokenizer has no chat template, and the dataset is prompt_format 'chat'")
    extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    if not isinstance(text, str):
        raise RuntimeError(f"{where}: apply_chat_template returned {type(text).__name__}, not text")
    return text


def render_prompts(
    spec: GenerateEntry, rows: list[dict[str, Any]], snapshot_dir: str | None, tokenizers: TokenizerCache | None = None
) -> list[str]:
    """The prompt text of each row, for the snapshot at ``snapshot_dir`` (see the module doc)."""
    if spec.prompt_format == "raw":
        return [row["prompt"] for row in rows]
    if snapshot_dir is None:
        raise ValueError(f"dataset {spec.name!r} is prompt_format 'chat': rendering needs the snapshot's tokenizer")
    tokenizer = (tokenizers or _TOKENIZERS).get(snapshot_dir)
    return [render_chat(tokenizer, row_messages(spec, row), snapshot_dir, template_kwargs=spec.chat_template_kwargs)
            for row in rows]
