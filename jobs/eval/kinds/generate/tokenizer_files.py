"""Which directory a snapshot's tokenizer is read from, when the snapshot has none of its own.

A checkpoint saved without its tokenizer (an HF ``Trainer`` built without ``processing_class``, a
trainer that saves weights only) is not a dead engine and not a corrupt snapshot: the weights are fine,
the tokenizer is elsewhere. :func:`tokenizer_dir` answers the snapshot itself when it holds tokenizer
files, else the run's own tokenizer (``RUN/base/``, written by ``start_eval``/``ckpteval train`` from
``base_model_dir``) when that holds them, else raises :class:`TokenizerMissing` — a skip written at once
(``no_tokenizer``), naming the files looked for and the fix, never an engine restart (restarting cannot
create files) and never ``EXIT_UNHEALTHY``. Once the fix is applied, the next worker re-evaluates the skip
(a result of the next generation, :mod:`ckpteval.coord.results.files`).

Guarantee: only names are read (one listing per directory). Limits: "has a tokenizer" means one of
:data:`TOKENIZER_FILES` is there; a present but broken tokenizer file still fails the load (as before).
An engine launched on a server (sglang, ``ckpteval serve``) keeps the tokenizer it was started with:
only an in-process engine that instantiates from the snapshot (``--engine hf``) reads this.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ckpteval.coord.snapshots.snapshot import SnapshotError
from ckpteval.jobs.eval.engines.base import ReadsRunTokenizer, members

# One of these makes a directory loadable by AutoTokenizer (fast tokenizer, or a slow one's vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
FIX = ("save the tokenizer with every checkpoint (HF Trainer: processing_class=tokenizer; else "
       "tokenizer.save_pretrained(dir)), or put the base model's tokenizer files in RUN/base/ "
       "(start_eval(base_model_dir=...) does); then run the worker again: it re-evaluates these skips")


class TokenizerMissing(SnapshotError):
    """The snapshot has no tokenizer files and the run knows no tokenizer either."""

    reason = "no_tokenizer"


def has_tokenizer(directory: Path | None) -> bool:
    """Whether ``directory`` holds at least one of :data:`TOKENIZER_FILES` (False if it is gone)."""
    if directory is None:
        return False
    try:
        names = set(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return False
    return any(n in names for n in TOKENIZER_FILES)


def tokenizer_dir(snapshot: Path, fallback: Path | None) -> Path:
    """Where to read ``snapshot``'s tokenizer: the snapshot, else ``fallback`` (the run's); else
    :class:`TokenizerMissing` with the files looked for and the fix."""
    if has_tokenizer(snapshot):
        return snapshot
    if has_tokenizer(fallback):
        return Path(fallback)  # type: ignore[arg-type]
    where = f" nor in the run's {fallback}" if fallback is not None else " and the run knows no tokenizer"
    raise TokenizerMissing(snapshot, f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in the checkpoint{where}: {FIX}")


def offer_run_tokenizer(engine: Any, run_base: Path) -> None:
    """Give every in-process engine (an HF engine, or each of a pool's) the run's tokenizer dir as the
    fallback for snapshots saved without one; engines that do not read tokenizers are left alone."""
    for e in members(engine):
        if isinstance(e, ReadsRunTokenizer):
            e.tokenizer_fallback = Path(run_base)


__all__ = ["FIX", "TOKENIZER_FILES", "TokenizerMissing", "has_tokenizer", "offer_run_tokenizer", "tokenizer_dir"]
