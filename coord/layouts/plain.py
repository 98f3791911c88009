"""Plain step directories (``step_N``, ``step-N``, ``iter_0000N``, ``checkpoint-N``, a slime ``--save-hf``
template dir): the layout of any trainer that gives no completion signal — and the fallback of ``auto``.

The step is the name's trailing digits, else ``trainer_state.json``'s ``global_step``; the entry itself
holds the HF weights. Complete: no signal, so quiescence (no file's size or mtime changed for
``--quiescence`` seconds, subdirectories included) and every shard the index names present.

slime (THUDM/slime ``slime/backends/megatron_utils/hf_checkpoint_saver.py``): ``--save-hf`` is a
template formatted with ``rollout_id``; the direct saver writes ``model-<i>.safetensors`` shards, renames
them to ``model-<i>-of-<n>.safetensors`` and writes ``model.safetensors.index.json`` last, with no
marker — so a slime dir is admitted here once quiet with every indexed shard present.
"""

from __future__ import annotations

from pathlib import Path

from ckpteval.coord.layouts.base import Layout, Located, json_int
from ckpteval.coord.snapshots.snapshot import step_from_name


class PlainLayout(Layout):
    name = "plain"
    signal = "none: quiescence (no change for --quiescence seconds) and every indexed shard present"
    no_weights_hint = "the dir holds no model.safetensors / index / adapter_model.safetensors"

    def locate(self, entry: Path) -> Located | None:
        step = step_from_dir(entry)
        return None if step is None else Located(step, entry, None)

    def looks_like(self, root: Path) -> bool:
        return False  # never chosen by detection: it is what auto falls back to


def step_from_dir(path: Path) -> int | None:
    """Step of a checkpoint dir from its name's trailing digits, else ``trainer_state.json``'s ``global_step``."""
    step = step_from_name(path)
    return json_int(path / "trainer_state.json", "global_step") if step is None else step
