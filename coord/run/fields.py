"""Typed run.json fields: the one JSON -> dataclass parser, with errors that name the file and the field.

Guarantee: :func:`parse_dataclass` builds a dataclass from a JSON object whose accepted keys, types and
defaults are the dataclass's own fields (declared once, there); an unknown key is refused naming the closest
valid one, and every error — a missing field, a wrong type, a :class:`FieldError` from the class's
``__post_init__`` — is one ``ValueError`` naming the file and the field path (``eval.datasets[0].top_p``).
Limits: the types understood are those run.json uses (str, int, float, bool, None-unions, tuple, list, dict, Any).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class FieldError(ValueError):
    """A dataclass's own check (``__post_init__``) failing on field ``key``; the parser names the file
    and the field path (``run.json: field eval.datasets[0].top_p must be ...``)."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key} {why}")
        self.key, self.why = key, why



class Fields:
    """Typed field access that names the file and the field path in every error.

    What a scorer's ``parse_options`` receives (its settings block, ``...scorer_options``): use
    :meth:`get`/:meth:`sub`/:meth:`error`, :meth:`reject_unknown`, or :func:`parse_dataclass`.
    """

    def __init__(self, source: Path, obj: Any, where: str) -> None:
        if not isinstance(obj, dict):
            raise ValueError(f"{source}: field {where or '<top>'} must be an object")
        self.source, self.obj, self.where = source, obj, where

    def _path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def error(self, key: str, why: str) -> ValueError:
        return ValueError(f"{self.source}: field {self._path(key)} {why}")

    def get(self, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        if key not in self.obj:
            if default is ...:
                raise self.error(key, "is missing")
            return default
        return self.check(key, self.obj[key], kind)

    def check(self, key: str, value: Any, kind: type | tuple[type, ...]) -> Any:
        """``value`` (of field ``key``) if it is of ``kind`` (a bool is not an int); else ValueError."""
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise self.error(key, f"must be {_kind_name(kind)}, got a boolean")
        if not isinstance(value, kind):
            raise self.error(key, f"must be {_kind_name(kind)}, got {type(value).__name__}")
        return value

    def sub(self, key: str, default: Any = ...) -> Fields:
        return Fields(self.source, self.get(key, dict, default), self._path(key))

    def reject_unknown(self, allowed: Iterable[str], what: str = "") -> None:
        """ValueError naming the first key not in ``allowed`` and the closest valid one (a typo such as
        ``temprature`` must not run silently with the default)."""
        allowed = sorted(allowed)
        for key in sorted(self.obj):
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise self.error(key, f"is not a setting{' of ' + what if what else ''} ({hint}valid: "
                                      f"{', '.join(allowed) or 'none'})")


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _convert(f: Fields, key: str, value: Any, hint: Any) -> Any:
    """``value`` checked (and converted: int -> float, list -> tuple) against the type hint ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"parse_dataclass: unsupported type {hint} for {key}")
        return _convert(f, key, value, rest[0])
    if origin is tuple:
        items = f.check(key, value, (list, tuple))
        return tuple(_convert(f, f"{key}[{i}]", v, args[0]) for i, v in enumerate(items))
    if origin is list:
        items = f.check(key, value, list)
        return [_convert(f, f"{key}[{i}]", v, args[0]) for i, v in enumerate(items)]
    if origin is dict or hint is dict:
        return dict(f.check(key, value, dict))
    if hint is float:
        return float(f.check(key, value, (int, float)))
    if hint in (int, str, bool):
        return f.check(key, value, hint)
    raise TypeError(f"parse_dataclass: unsupported type {hint} for {key}")


T = typing.TypeVar("T")


@functools.lru_cache(maxsize=64)
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def parse_dataclass(f: Fields, cls: type[T], *, what: str = "", exclude: Iterable[str] = ()) -> T:
    """An instance of dataclass ``cls`` from the object ``f``: the keys, their types and defaults are
    the dataclass's fields (declared once, there); unknown keys are refused naming the closest valid
    one; a missing required field, a wrong type or a :class:`FieldError` from the class's
    ``__post_init__`` is a ValueError naming the file and the field path. ``exclude``: fields the
    object may not set (left at their defaults)."""
    hints = _type_hints(cls)
    settable = [fl for fl in dataclasses.fields(cls) if fl.init and fl.name not in set(exclude)]  # type: ignore[arg-type]
    f.reject_unknown([fl.name for fl in settable], what)
    kwargs = {}
    for fl in settable:
        if fl.name in f.obj:
            kwargs[fl.name] = _convert(f, fl.name, f.obj[fl.name], hints[fl.name])
        elif fl.default is dataclasses.MISSING and fl.default_factory is dataclasses.MISSING:
            raise f.error(fl.name, "is missing")
    try:
        return cls(**kwargs)
    except FieldError as e:
        raise f.error(e.key, e.why) from None
