"""miles (radixark/miles), slime's successor: ``--save-hf`` HF exports of the Megatron actor.

Checked at radixark/miles commit 31f1ca961a94cb860cec3b2dea34ec332bfa8f76 (2026-08-21).

Read in ``miles/backends/megatron_utils/hf_export.py`` (``save_hf_model``) and ``miles/utils/hf_config.py``:
the export path is ``args.save_hf.format(rollout_id=...)`` (a user template, e.g. ``/ckpt/hf/iter_{rollout_id}``);
shards and ``model.safetensors.index.json`` are written, then global rank 0 touches an empty ``.complete``
(``HF_EXPORT_COMPLETE_MARKER``) "so consumers can tell finished from partial". Newer versions write into
``_tmp_<name>/`` and move it into place (``training_utils/checkpoint_io.py``), keeping the previous one as
``_old_<name>/`` until then — never looked at here.

Completion signal: ``.complete`` (an empty file; ckpteval's own ``.complete`` is a JSON marker, so under
this layout a non-JSON ``.complete`` is the trainer's). A template dir without one (slime, an export
still running) waits for quiescence. The step is the dir name's trailing digits.
"""

from __future__ import annotations

from pathlib import Path

from ckpteval.coord.layouts.base import Layout, Located
from ckpteval.coord.snapshots.snapshot import MARKER, step_from_name

STAGING = ("_tmp_", "_old_")


class MilesLayout(Layout):
    name = "miles"
    signal = "an empty .complete touched by rank 0 after the export (slime: none, quiescence)"
    no_weights_hint = ("the Megatron torch_dist save (--save) is not HF: pass --save-hf TEMPLATE, or convert "
                       "with tools/convert_torch_dist_to_hf.py")
    owns_marker_name = True

    def step_of(self, entry: Path) -> int | None:
        return None if entry.name.startswith(STAGING) else step_from_name(entry)

    def locate(self, entry: Path) -> Located | None:
        step = self.step_of(entry)
        return None if step is None else Located(step, entry, True if (entry / MARKER).is_file() else None)

    def signature(self, entry: Path) -> bool:
        return _trainer_marker(entry / MARKER)


def _trainer_marker(path: Path) -> bool:
    """An empty ``.complete`` (miles'), not a ckpteval marker (a JSON object)."""
    try:
        return path.is_file() and path.stat().st_size == 0
    except OSError:
        return False
