"""prime-rl (PrimeIntellect-ai/prime-rl): its filesystem weight broadcasts, and the weight checkpoints of versions
before PR #3316 (both still written by the prime-rl releases in use). The layout is chosen by what is on disk.

Owns where a save is (``broadcasts/step_N/``, else ``weights/step_N/``), its completion signal (``.finished``,
else ``STABLE``) and that a broadcast is ephemeral: captured into ``RUN/captured/`` before use, re-checked, a
capture that raced the trainer's cleanup counted lost, never scored; ckpteval never writes into the trainer's
dir. Limits: a capture holds full weights until its point is final. See docs/USER_GUIDE.md "Checkpoint layouts".
Training data: the verifiers environments its config names, each ``id`` (with ``args``) under
``orchestrator.train.env`` or ``orchestrator.train.envs.envs`` (older: ``orchestrator.env``), read from
``configs/reverse_text/`` at prime-rl commits 729479d2 and f39ff22f.
Read from prime-rl at commit 559b44772e471d1538537b8805cc77f3824a5e64 (2026-08-21), and before #3316 at commit
f274fa312 (2026-02-11).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckpteval.coord.layouts.base import Layout, Located, as_list, config_at

STEP = re.compile(r"step_(\d+)")
STABLE = "STABLE"
FINISHED = ".finished"  # the handshake's last stage (#3357)
MARKERS = (FINISHED, STABLE)  # newest protocol first
ENV_KEYS = ("orchestrator.train.env", "orchestrator.train.envs.envs", "orchestrator.env")
BROADCASTS = "broadcasts"
WEIGHTS = "weights"


class PrimeRLLayout(Layout):
    name = "prime-rl"
    signal = (".finished in broadcasts/step_N/ (the handshake of #3357), STABLE there (#3316) or in weights/step_N/ "
              "(before #3316), written after the weights")
    no_weights_hint = ("checkpoints/step_N/ is torch DCP state, not HF weights: use the filesystem weight broadcast "
                       "(weight_broadcast.type='filesystem') or convert with scripts/dcp_to_hf.py")

    def containers(self, root: Path) -> list[Path]:
        for name in (BROADCASTS, WEIGHTS):
            if (root / name).is_dir():
                return [root / name]
        return [root]

    step_pattern = STEP
    train_data_keys = "the ids of orchestrator.train.env / orchestrator.train.envs.envs (its TOML)"

    def train_data(self, config: Mapping[str, Any]) -> list[str]:
        envs = [e for key in ENV_KEYS for e in as_list(config_at(config, key)) if isinstance(e, Mapping) and e.get("id")]
        return [verifiers_source(str(e["id"]), e.get("args")) for e in envs]

    def locate(self, entry: Path) -> Located | None:
        step = self.step_of(entry)
        if step is None:
            return None
        return Located(step, entry, self.signature(entry), ephemeral=is_broadcast(entry))

    def signature(self, entry: Path) -> bool:
        return self.completion_marker(entry) is not None

    def completion_marker(self, entry: Path) -> Path | None:
        for name in MARKERS:
            if (entry / name).is_file():
                return entry / name
        return None


def is_broadcast(entry: Path) -> bool:
    """A broadcast (deleted by the trainer within steps): under ``broadcasts/``, or a watched broadcasts dir
    itself (no ``config.json``: a weight checkpoint of older versions always has one)."""
    return entry.parent.name == BROADCASTS or not (entry / "config.json").is_file()


def verifiers_source(env_id: str, args: Any = None) -> str:
    """``verifiers:<id>`` (with ``?<json args>`` when it has any): a source the contamination gate reads."""
    import json

    return f"verifiers:{env_id}" + (f"?{json.dumps(args, sort_keys=True)}" if isinstance(args, Mapping) and args else "")
