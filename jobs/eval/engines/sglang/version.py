"""The sglang versions ckpteval speaks: the floor every sglang client checks (:data:`SUPPORTED_SGLANG`).

Owns the version range (keep equal to pyproject's ``sglang`` extra) and its check, used on a server's
``/server_info`` ``"version"`` (``srt/entrypoints/http_server.py`` ``server_info``) and on the sglang an
engine would launch. Why the range: ``meta_info.weight_versions`` spans arrived in 0.5.19
(``srt/utils/weight_versions.py``); 0.6 may break the native API. Limits: release strings are parsed
loosely (``"0.5.19.post1"``, ``"0.5.21rc0"`` count as their base release).
"""

from __future__ import annotations

import re
from typing import Any

MIN_SGLANG = (0, 5, 19)  # first release with meta_info.weight_versions spans
NEXT_BREAKING_SGLANG = (0, 6)
SUPPORTED_SGLANG = ">=0.5.19,<0.6"  # keep equal to pyproject's sglang extra


class UnsupportedServer(ValueError):
    """The server (or the sglang install a launcher would start) is outside :data:`SUPPORTED_SGLANG`."""


def parse_version(text: str) -> tuple[int, ...]:
    """``"0.5.23"``/``"0.5.19.post1"``/``"0.5.21rc0"`` -> ``(0, 5, 23)``; ValueError if not a version."""
    match = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(g) for g in match.groups() if g is not None)


def check_sglang_version(version: Any, where: str) -> None:
    """Raise :class:`UnsupportedServer` unless ``version`` is in :data:`SUPPORTED_SGLANG`."""
    try:
        parsed = parse_version(version)
    except ValueError:
        raise UnsupportedServer(
            f"{where} reports sglang version {version!r}, not a version; ckpteval needs sglang{SUPPORTED_SGLANG}"
        ) from None
    if not MIN_SGLANG <= parsed < NEXT_BREAKING_SGLANG:
        raise UnsupportedServer(
            f"{where} runs sglang {version}; ckpteval needs sglang{SUPPORTED_SGLANG} (weight_versions spans "
            "arrived in 0.5.19): pip install 'ckpteval[sglang]'"
        )
