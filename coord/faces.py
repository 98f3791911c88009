"""A package's face: ``__all__`` and a lazy ``__getattr__`` (PEP 562) re-exporting its public names.

A name's module is imported on first use, never when the package is: a face adds no import edge (no
cycle, no torch in light modules).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def face(package: str, names: dict[str, str]) -> tuple[list[str], Callable[[str], Any]]:
    """``(__all__, __getattr__)`` for ``package``; ``names`` maps each public name to its submodule."""

    def __getattr__(attr: str) -> Any:
        if attr not in names:
            raise AttributeError(f"module {package!r} has no attribute {attr!r}")
        return getattr(importlib.import_module(f"{package}.{names[attr]}"), attr)

    return list(names), __getattr__
