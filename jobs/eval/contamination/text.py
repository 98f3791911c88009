"""The text a row is matched on and its normalized tokens (docs/USER_GUIDE.md "Contamination gate").

Normalization follows lm-evaluation-harness's decontamination janitor (``lm_eval/decontamination/janitor.py``,
``Janitor.normalize_string`` then ``word_ngrams``): lowercased, ASCII punctuation deleted, split on
whitespace; tests/test_contamination.py checks the n-grams agree with the janitor's own.
"""

from __future__ import annotations

import string
from typing import Any

PUNCTUATION = string.punctuation.encode()
PROMPT_FIELDS = ("prompt", "messages", "question", "problem", "query", "instruction", "input", "text", "content")
"""The fields a row's prompt is read from, first present wins (verl: ``prompt`` as chat messages; TRL:
``prompt``/``messages``/``text``; verifiers: ``question``/``prompt``); a row with none: all its strings."""


def tokens(text: str) -> list[bytes]:
    """``text`` lowercased, ASCII punctuation deleted, split on whitespace: UTF-8 words (bytes: deleting
    ASCII bytes never splits a multi-byte character, and it is twice as fast as ``str.translate``)."""
    return text.lower().encode("utf-8", "surrogatepass").translate(None, PUNCTUATION).split()


def _flatten(value: Any) -> str:
    """A prompt value as one text: a string as is, chat messages' contents joined (system turns too)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return _flatten(value.get("content", ""))
    if isinstance(value, list | tuple):
        return "\n".join(_flatten(v) for v in value)
    return ""


def row_text(row: Any, field: str | None = None) -> str:
    """The prompt text of one row: ``field`` when given, else the first of :data:`PROMPT_FIELDS` present,
    else every string value of the row; a bare string row is its own text."""
    if not isinstance(row, dict):
        return _flatten(row)
    if field is not None:
        return _flatten(row.get(field, ""))
    for name in PROMPT_FIELDS:
        if name in row and (text := _flatten(row[name])):
            return text
    return "\n".join(v for v in row.values() if isinstance(v, str))
