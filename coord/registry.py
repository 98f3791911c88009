"""Named registries: a name -> a value naming ``module:attr`` targets, imported on first use.

Every registry of ckpteval is one (entry kinds, layouts, engines, scorers, environments); adding to one is one
line ``("name", value)`` where it is built. Guarantee: a name is registered once (a second is refused); an
unknown name is refused in one message naming the closest known one; a target's module is imported only when
:meth:`Registry.load` asks for it, and a target that cannot be imported is refused naming name and target.
Limits: a registry is per process and not locked (registered at import, read afterwards); a target is checked
only when loaded.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterator, MutableMapping
from typing import Any, Generic, TypeVar

from ckpteval.coord.run.fields import FieldError

V = TypeVar("V")


def load_target(target: str) -> Any:
    """The attribute a ``module:attr`` string names (ImportError/AttributeError when it is not there)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


class Registry(MutableMapping[str, V], Generic[V]):
    """``what``'s registry. ``unknown`` is the refusal of an unknown name, formatted with ``name``, ``hint``
    ("did you mean 'x'? " or "") and ``known`` (the names); ``key``: refusals are a
    :class:`~ckpteval.coord.run.fields.FieldError` of that run.json field, else a ValueError."""

    def __init__(self, what: str, *lines: tuple[str, V], unknown: str = "", key: str = "") -> None:
        self.what, self.key = what, key
        self.unknown = unknown or "{name!r} is not " + what + " ({hint}known: {known})"
        self._values: dict[str, V] = {}
        for name, value in lines:
            self[name] = value

    def __setitem__(self, name: str, value: V) -> None:
        if name in self._values:
            raise ValueError(f"{self.what} {name!r} is registered twice")
        self._values[name] = value

    def __getitem__(self, name: str) -> V:
        return self._values[name]

    def __delitem__(self, name: str) -> None:
        del self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def refusal(self, name: str, also: tuple[str, ...] = ()) -> str:
        """The message refusing unknown ``name`` (``also``: other accepted words, for the hint)."""
        close = difflib.get_close_matches(name, [*self._values, *also], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return self.unknown.format(name=name, hint=hint, known=", ".join(self._values))

    def error(self, why: str) -> ValueError:
        return FieldError(self.key, why) if self.key else ValueError(why)

    def entry(self, name: str) -> V:
        """The value registered as ``name``; an unknown name is refused (:meth:`refusal`)."""
        if name not in self._values:
            raise self.error(self.refusal(name))
        return self._values[name]

    def load(self, name: str, target: str | None = None) -> Any:
        """What ``target`` (default: the value registered as ``name``, a ``module:attr`` string) names, imported now."""
        target = target if target is not None else str(self.entry(name))
        try:
            return load_target(target)
        except ImportError as e:
            raise self.error(f"{name!r} is registered as {target}, whose module cannot be imported ({e})") from None
        except AttributeError:
            raise self.error(f"{name!r} is registered as {target}, which does not exist") from None
