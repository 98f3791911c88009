"""The catalog's sets, read from ``data/<set>/set.json`` and ``data/templates.json`` (see the package docstring)."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

DATA = Path(__file__).with_name("data")


@dataclass(frozen=True)
class Template:
    """A prompt template: the system turn and the user turn (``{prompt}``: the row's problem)."""

    name: str
    system_prompt: str | None
    user: str
    few_shot: int
    source: str

    def user_turn(self, prompt: str) -> str:
        return self.user.replace("{prompt}", prompt)


@dataclass(frozen=True)
class CatalogSet:
    """One set: its rows file, the harness it follows, its templates and its default entry settings."""

    name: str
    title: str
    rows_path: Path
    harness: dict[str, Any]
    templates: tuple[str, ...]
    entry: dict[str, Any]


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the catalog file ({e})") from None


@cache
def templates() -> dict[str, Template]:
    """Every template of the catalog, by name."""
    return {name: Template(name, t["system_prompt"], t["user"], int(t["few_shot"]), t["source"])
            for name, t in _read(DATA / "templates.json").items()}


def set_names() -> list[str]:
    """The catalog's sets (a folder of ``data/`` with a ``set.json``), sorted."""
    return sorted(p.parent.name for p in DATA.glob("*/set.json"))


@cache
def load_set(name: str) -> CatalogSet:
    """The set ``name``; ValueError naming the closest set when there is none."""
    folder = DATA / name
    if not (folder / "set.json").is_file():
        close = difflib.get_close_matches(name, set_names(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"{name!r} is not a catalog set ({hint}known: {', '.join(set_names())})")
    raw = _read(folder / "set.json")
    return CatalogSet(name, raw["title"], folder / "rows.jsonl", raw["harness"], tuple(raw["templates"]), raw["entry"])


def template_of(catalog_set: CatalogSet, name: str) -> Template:
    """Template ``name`` of ``catalog_set`` (ValueError naming the set's templates)."""
    if name not in catalog_set.templates:
        raise ValueError(f"catalog set {catalog_set.name!r} has no template {name!r} "
                         f"(its templates: {', '.join(catalog_set.templates)})")
    return templates()[name]


TEMPLATES = templates
