"""One contamination check of a run: every eval row of its generate/env entries against the trainer's
prompts, once per run (a check whose inputs have not changed is not run again), its matches published in
``RUN/contamination.json`` (:mod:`ckpteval.coord.results.contamination`). docs/USER_GUIDE.md "Contamination gate".
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckpteval.coord.entries.env import EnvEntry
from ckpteval.coord.entries.rows import RowsEntry
from ckpteval.coord.results.contamination import read_matches, write_matches
from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.eval.contamination.index import TIERS, Hit, Settings
from ckpteval.jobs.eval.contamination.parallel import scanned
from ckpteval.jobs.eval.contamination.text import row_text
from ckpteval.jobs.eval.contamination.train_data import VERIFIERS, Batch, batches, data_files
from ckpteval.jobs.eval.kinds.env.verifiers_env import taskset_prompts
from ckpteval.jobs.eval.kinds.generate.evalsets import load_dataset

EXAMPLES = 3  # training rows kept per matched eval row (the count keeps them all)


@dataclass(frozen=True)
class EvalSet:
    name: str
    texts: list[str]


@dataclass
class Found:
    """What the training data holds of one eval row."""

    row: int
    tiers: dict[str, int] = field(default_factory=dict)  # tier -> training rows matching by it
    examples: list[dict[str, Any]] = field(default_factory=list)

    def add(self, hit: Hit, batch: Batch) -> None:
        self.tiers[hit.tier] = self.tiers.get(hit.tier, 0) + 1
        if len(self.examples) < EXAMPLES:
            self.examples.append({"tier": hit.tier, "file": str(batch.path), "train_row": batch.first + hit.train,
                                  "similarity": round(hit.similarity, 4), "evidence": hit.evidence})

    def record(self) -> dict[str, Any]:
        tier = min(self.tiers, key=TIERS.index)  # the strictest that found it
        return {"row": self.row, "tier": tier, "tiers": self.tiers, "examples": self.examples}


def entry_texts(run: RunDir, entry: RowsEntry) -> list[str]:
    """The prompt text of each row an entry evaluates (its loader's rows, ``subset`` applied); a verifiers
    entry's rows name tasks of its taskset: their prompts."""
    rows = load_dataset(run, entry)
    if not (isinstance(entry, EnvEntry) and entry.env == "verifiers"):
        return [row_text(r) for r in rows]
    options = entry.env_options
    prompts = taskset_prompts(options.get("taskset", ""), options.get("taskset_options"))
    bad = [r["task"] for r in rows if not 0 <= int(r.get("task", -1)) < len(prompts)]
    if bad:
        raise ValueError(f"{entry.path}: rows name tasks {bad[:5]} but the taskset has {len(prompts)}")
    return [row_text({"prompt": prompts[int(r["task"])]}) for r in rows]


def eval_sets(run: RunDir) -> tuple[list[EvalSet], list[str]]:
    """The prompt texts of every generate/env entry (:func:`entry_texts`), and the entries not checked, each
    with why."""
    sets, skipped = [], []
    for entry in run.manifest().eval.entries:
        if isinstance(entry, RowsEntry):
            sets.append(EvalSet(entry.name, entry_texts(run, entry)))
        else:
            skipped.append(f"{entry.name} ({entry.kind}: its rows are the library's)")
    return sets, skipped


def identity(sets: Sequence[EvalSet], files: Sequence[Path], settings: Settings, tiers: Sequence[str],
             text_field: str | None) -> str:
    """What a check's outcome depends on: the eval texts, each training file's path, size and mtime, the settings."""
    h = hashlib.blake2b(digest_size=16)
    for s in sets:
        h.update(json.dumps([s.name, s.texts]).encode())
    for f in files:
        if str(f).startswith(VERIFIERS):
            h.update(str(f).encode())  # an environment's tasks: its id and options
            continue
        st = f.stat()
        h.update(json.dumps([str(f.resolve()), st.st_size, st.st_mtime_ns]).encode())
    h.update(json.dumps([asdict(settings), list(tiers), text_field]).encode())
    return h.hexdigest()


def scan(sets: Sequence[EvalSet], files: Sequence[Path], settings: Settings, tiers: Sequence[str] = TIERS,
         text_field: str | None = None, procs: int = 1) -> tuple[dict[str, dict[int, Found]], list[dict[str, Any]]]:
    """Every eval row's matches in the training ``files`` (per dataset, by row) and each file's row count;
    ``procs`` > 1: scanned in that many worker processes (:mod:`~ckpteval.jobs.eval.contamination.parallel`)."""
    owners = [(s.name, row) for s in sets for row in range(len(s.texts))]
    found: dict[str, dict[int, Found]] = {s.name: {} for s in sets}
    rows = dict.fromkeys(files, 0)
    every = (batch for path in files for batch in batches(path, text_field))
    texts, groups = [t for s in sets for t in s.texts], [name for name, _row in owners]
    for batch, hits in scanned(texts, groups, settings, tiers, every, procs):
        rows[batch.path] += len(batch.texts)
        for hit in hits:
            name, row = owners[hit.eval_id]
            found[name].setdefault(row, Found(row)).add(hit, batch)
    return found, [{"path": str(path), "rows": n} for path, n in rows.items()]


def check(run: RunDir, sources: Sequence[Path | str], settings: Settings | None = None, tiers: Sequence[str] = TIERS,
          text_field: str | None = None, force: bool = False, procs: int = 1) -> dict[str, Any]:
    """The run's contamination record: the one already published when its inputs are unchanged (and not
    ``force``), else a new check (``procs``: worker processes), published. Errors name the file at fault
    before any scan."""
    settings = settings or Settings()
    unknown = [t for t in tiers if t not in TIERS]
    if unknown or not tiers:
        raise ValueError(f"contamination: tiers must be some of {', '.join(TIERS)}, got {list(tiers)}")
    if not sources:
        raise ValueError("contamination: no training data named (give --train PATH, or --trainer-config with --layout)")
    files = list(dict.fromkeys(f for s in sources for f in data_files(s)))
    sets, skipped = eval_sets(run)
    key = identity(sets, files, settings, tiers, text_field)
    if not force and (old := read_matches(run.path)) is not None and old.get("identity") == key:
        return old
    start = time.perf_counter()
    found, read = scan(sets, files, settings, tiers, text_field, procs)
    seconds = time.perf_counter() - start
    train_rows = sum(s["rows"] for s in read)
    record = {
        "identity": key, "checked_at": time.time(), "settings": asdict(settings), "tiers": list(tiers),
        "text_field": text_field, "sources": read, "train_rows": train_rows, "seconds": round(seconds, 3),
        "rows_per_s": round(train_rows / seconds, 1) if seconds > 0 else None, "skipped": skipped,
        "datasets": {s.name: {"rows": len(s.texts), "matched": [f.record() for _, f in sorted(found[s.name].items())]}
                     for s in sets},
    }
    write_matches(run.path, record)
    return record
