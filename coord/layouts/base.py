"""What a checkpoint layout is: the contract every module in :mod:`ckpteval.coord.layouts` implements.

A layout answers three questions about one entry of a watched directory (a trainer's save): its step,
the directory holding its Hugging Face weights (what eval loads: ``config.json``, tokenizer,
``*.safetensors`` + index, or a PEFT adapter), and whether the trainer has said the save is finished.
Guarantee: :meth:`Layout.locate` only reads (names, small JSON/text files); it never writes, never
raises for a vanished or half-written entry (it answers None or "not finished"). Limits: a layout
does not check the weights themselves — discovery checks every indexed shard is present and the
worker verifies headers before use.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ckpteval.coord.atomic import read_json_object


@dataclass(frozen=True)
class Located:
    """One trainer save, as its layout reads it."""

    step: int  # the training step the save holds
    weights: Path  # the directory eval loads (HF config + weights, or a PEFT adapter)
    complete: bool | None  # the trainer's own signal: True finished, False not yet, None the trainer gives none
    ephemeral: bool = False  # the trainer deletes it within steps (prime-rl broadcasts): captured before use


class Layout:
    """Base class: set the class attributes (``step_pattern`` or :meth:`step_of`), override :meth:`locate`
    and :meth:`signature` (what makes auto-detection pick this layout)."""

    name: ClassVar[str] = ""
    signal: ClassVar[str] = ""  # the trainer's completion signal, in words (docs, `ckpteval worker --help`)
    no_weights_hint: ClassVar[str] = ""  # what to do when a finished save holds no HF weights
    owns_marker_name: ClassVar[bool] = False  # the trainer itself writes a file named like our .complete
    step_pattern: ClassVar[re.Pattern[str] | None] = None  # a save's whole name; one group: the step
    train_data_keys: ClassVar[str] = ""  # where the trainer's config names its training data ("": nowhere known)
    config_names: ClassVar[tuple[str, ...]] = ()  # files in a save holding the trainer's config (NeMo-RL's)

    def saved_config(self, root: Path) -> Path | None:
        """The trainer's config as its newest save under ``root`` holds it (:attr:`config_names`), None if none does."""
        saves = sorted(((step, e) for c in self.containers(root) for e in entries(c)
                        if (step := self.step_of(e)) is not None), reverse=True)
        return next((e / name for _step, e in saves for name in self.config_names if (e / name).is_file()), None)

    def train_data(self, config: Mapping[str, Any]) -> list[str]:
        """The training data the trainer's ``config`` (its parsed YAML/TOML/JSON) names, as it names them: data
        files or directories (relative: to the config's directory) or ``verifiers:<id>`` (a verifiers
        environment's tasks); [] where it names none (the contamination gate, docs/USER_GUIDE.md)."""
        return []

    def containers(self, root: Path) -> list[Path]:
        """The directories whose entries are saves (default: the watched dir itself)."""
        return [root]

    def step_of(self, entry: Path) -> int | None:
        """The step a save's name holds (default: :attr:`step_pattern`), None if the name is not a save's."""
        return None if self.step_pattern is None else name_step(self.step_pattern, entry)

    def locate(self, entry: Path) -> Located | None:
        """The save in ``entry`` (a directory inside a container), or None if it is not one of this layout."""
        raise NotImplementedError

    def signature(self, entry: Path) -> bool:
        """Whether a save-named ``entry`` holds what only this trainer writes (default: nothing does)."""
        return False

    def completion_marker(self, entry: Path) -> Path | None:
        """The file whose presence says the save in ``entry`` is finished, where the trainer writes one (its
        identity is re-checked after an ephemeral save is captured); None: no such file (default)."""
        return None

    def looks_like(self, root: Path) -> bool:
        """Whether ``root`` holds at least one save that only this trainer writes (auto-detection)."""
        return any(any_entry(c, lambda e: self.step_of(e) is not None and self.signature(e))
                   for c in self.containers(root))


def entries(directory: Path) -> list[Path]:
    """Real (non-symlink, non-dot) subdirectories of ``directory``; empty if it is gone."""
    try:
        return [Path(e.path) for e in os.scandir(directory)
                if not e.name.startswith(".") and not e.is_symlink() and e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def name_step(pattern: re.Pattern[str], entry: Path) -> int | None:
    """The step in ``entry``'s name when the whole name matches ``pattern`` (one group: the digits)."""
    m = pattern.fullmatch(entry.name)
    return int(m.group(1)) if m else None


def json_int(path: Path, key: str) -> int | None:
    """``key`` of the JSON object in ``path`` when it is an int; None if absent, torn or not an int."""
    try:
        value = read_json_object(path).get(key)
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def text_int(path: Path) -> int | None:
    """The integer a small text file holds (a tracker file); None if absent or not an integer."""
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def any_entry(root: Path, test: object) -> bool:
    """Whether some entry of ``root`` passes ``test`` (a callable on the entry path)."""
    return any(test(e) for e in entries(root))  # type: ignore[operator]


def config_at(config: Mapping[str, Any], dotted: str) -> Any:
    """The value at ``dotted`` (``data.train_files``) of a nested config; None where a part is missing."""
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def as_list(value: Any) -> list[Any]:
    """A config value that may be one item or a list of them (hydra ``ListConfig``s arrive as lists)."""
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]
