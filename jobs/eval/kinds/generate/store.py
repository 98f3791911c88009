"""The completion store: a directory shared across runs that answers a unit whose completions are already known.

Guarantee: entries are first-writer-wins and checked on read (a bad entry is a logged miss, never a hit).
Limits: the store trusts its writers; units on an ``http:URL`` engine are neither stored nor answered; only
``generate`` units; nothing is deleted. See docs/USER_GUIDE.md "Kept completions, re-scoring, and the completion
store".
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sys
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import publish_exclusive
from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.results.completions import (
    SUFFIX,
    Completions,
    encode,
    read_completions,
    replace_completions,
    rows_digest,
)
from ckpteval.coord.snapshots.discovery import SnapshotRef
from ckpteval.coord.snapshots.snapshot import Marker, is_eval_file
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.kinds.evaluate import Evaluation
from ckpteval.jobs.eval.kinds.generate.answering import resolve_reasoning
from ckpteval.jobs.eval.kinds.generate.scoring import (
    DatasetCache,
    UnitInput,
    kept_generations,
    sampling_params,
    unit_input,
    unit_scores,
)

KEY_VERSION = 1
VERSIONED_PACKAGES = ("ckpteval", "torch", "transformers", "sglang")  # whose versions change completions
UNKNOWN_ENGINES = ("http",)  # kinds whose engine this worker did not build: no identity to vouch for


def package_versions(names: tuple[str, ...] = VERSIONED_PACKAGES) -> dict[str, str | None]:
    """The installed version of each package (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def engine_identity(kind: str, model_config: str | None, dtype: str | None, versions: Mapping[str, str | None],
                    extra: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The engine part of a unit's key — the one seam where an engine's identity enters the store: its kind
    (``hf``, ``sglang``; a pool ``hf+hf``), the model config's SHA-256, the dtype it computes in, the versions
    of the packages that generate, and ``extra`` (the rest of run.json's settings for the kind, the device, the
    pool's size). None: an engine with no identity this worker can vouch for (the store is not used)."""
    if any(part.split(":", 1)[0] in UNKNOWN_ENGINES for part in kind.split("+")):
        return None
    return {"kind": kind, "model_config": model_config, "dtype": dtype, "versions": dict(sorted(versions.items())),
            "extra": json.loads(json.dumps(dict(extra or {}), sort_keys=True, default=str))}


def weights_identity(marker: Marker) -> dict[str, Any] | None:
    """The snapshot's weights as the key sees them (module docstring); None without per-tensor digests."""
    tensors = marker.tensors
    if not tensors:
        return None
    files = {name: info.get("crc32") for name, info in marker.files.items()
             if is_eval_file(name) and not name.endswith((".safetensors", ".safetensors.index.json"))}
    digests = {name: {k: v for k, v in d.items() if k != "file"} for name, d in tensors.items()}
    return {"tensors": dict(sorted(digests.items())), "files": dict(sorted(files.items()))}


def unit_key(weights: Mapping[str, Any], engine: Mapping[str, Any], work: UnitInput) -> str:
    """The content key of a unit's completions (module docstring): hex SHA-256 of the canonical JSON."""
    spec = work.spec
    params = {k: v for k, v in asdict(sampling_params(spec)).items() if k != "timeout_s"}
    per_prompt = len(work.samples)
    parts = {
        "v": KEY_VERSION,
        "weights": weights,
        "engine": engine,
        "rows": rows_digest(work.rows[::per_prompt]),
        "prompts": hashlib.sha256(json.dumps(work.prompts).encode()).hexdigest(),
        "render": {"prompt_format": spec.prompt_format, "system_prompt": spec.system_prompt,
                   "chat_template_kwargs": spec.chat_template_kwargs},
        "sampling": params,
        "seeds": work.seeds,
        "samples": [work.samples.start, work.samples.stop],
    }
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class CompletionStore:
    """One store directory: look a key up, file a unit's completions under it."""

    def __init__(self, root: Path, engine: Mapping[str, Any] | None) -> None:
        self.root = Path(root)
        self.engine = engine
        self._weights: dict[str, dict[str, Any] | None] = {}  # snapshot path -> weights identity
        self._bad: set[str] = set()  # keys whose entry failed to read here: replaced on put

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{SUFFIX}"

    def key(self, cache: DatasetCache, unit: WorkUnit, ref: SnapshotRef) -> tuple[str, UnitInput] | None:
        """The unit's key and rendered input; None when the store cannot serve it (not a ``generate`` unit,
        an engine without identity, a snapshot without tensor digests)."""
        spec = cache.manifest.entry(unit.dataset)
        if self.engine is None or not isinstance(spec, GenerateEntry):
            return None
        where = str(ref.path)
        if where not in self._weights:
            self._weights[where] = weights_identity(ref.marker)
        weights = self._weights[where]
        if weights is None:
            return None
        work = unit_input(cache, unit, where)
        return unit_key(weights, self.engine, work), work

    def get(self, key: str, work: UnitInput) -> Completions | None:
        """The entry filed under ``key`` when it is whole and fits ``work``; None (a miss) otherwise."""
        path = self.path(key)
        try:
            entry = read_completions(path)
        except FileNotFoundError:
            return None
        except (ValueError, OSError) as e:
            return self._miss(key, f"{e}")
        if entry.store_key != key:
            return self._miss(key, f"{path}: filed under key {entry.store_key}, not its name's")
        per_prompt = len(work.samples)
        if len(entry.text) != len(work.prompts) or list(entry.sample_prompts()) != work.prompts \
                or entry.rows_sha256 != rows_digest(work.rows[::per_prompt]):
            return self._miss(key, f"{path}: does not fit the unit (samples, prompts or rows differ)")
        return entry

    def _miss(self, key: str, why: str) -> None:
        self._bad.add(key)
        print(f"ckpteval completion store: {why}; treated as a miss (regenerated, then replaced)", file=sys.stderr,
              flush=True)
        return None

    def put(self, key: str, record: Completions) -> bool:
        """File ``record`` under ``key`` (first writer wins; an entry that failed to read is replaced whole).
        A disk failure is one line on stderr, never the unit's failure."""
        entry = replace(record, store_key=key, lease_token=None, generation=0)
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if key in self._bad:
                replace_completions(path, entry)
                self._bad.discard(key)
                return True
            return publish_exclusive(path, encode(entry))
        except (OSError, ValueError) as e:
            print(f"ckpteval completion store: {path}: not stored ({e})", file=sys.stderr, flush=True)
            return False


def answer_from_store(cache: DatasetCache, unit: WorkUnit, work: UnitInput, entry: Completions, want: str,
                      where: Path, snapshot_dir: str | None = None) -> Evaluation:
    """The evaluation of a unit answered from a store entry: scored by this run's scorer, each sample stamped
    ``want`` (the key proved the weights), no engine or GPU seconds spent."""
    n = len(entry.text)
    kept = replace(entry, unit=unit, weight_version=(want,) * n, store_key=None, lease_token=None)
    scored = unit_scores(cache.scorer(work.spec), work.spec, kept_generations(kept), work.rows, work.prompts,
                         resolve_reasoning(work.spec, snapshot_dir), kept=kept)
    generated = [v for v in dict.fromkeys(entry.weight_version) if v is not None]
    attest = {"attested": False, "how": "completion_store", "state": "store",
              "detail": f"answered from {where} (generated on equal weights by {', '.join(generated) or '?'}); "
                        "no engine held these weights", "seconds": 0.0}
    cost = {"generated_tokens": 0.0, "prompt_tokens": 0.0, "score_s": scored.score_s, "engine_s": 0.0,
            "gpus": 0.0, "gpu_s": 0.0, "load_s": 0.0, "attest_s": 0.0, "canary_s": 0.0,
            "store_hits": 1.0, "store_tokens": float(sum(entry.n_tokens))}
    return Evaluation(scored.scores, scored.weight_versions, answers=scored.answers, scored=scored.result_fields(),
                      attest=attest, cost=cost, kept=kept)


def open_store(root: Path | None, manifest: Any, specs: list[str], settings: Mapping[str, Mapping[str, Any]],
               device: str, replicas: int) -> CompletionStore | None:
    """The worker's store (``--completion-store``), keyed by what the worker knows of its engines today: their
    kinds, run.json's settings for them (dtype and the rest), the device type, the pool's size and the
    generating packages' versions. None without ``root``; a store that serves nothing (with one line on
    stderr) for an engine without identity or a LoRA run (the adapter's digests do not cover its base)."""
    if root is None:
        return None
    kind = "+".join(specs)
    merged = {k: v for spec in specs for k, v in settings.get(spec.split(":", 1)[0], {}).items()}
    identity = engine_identity(kind, None, merged.pop("dtype", None), package_versions(),
                               {"settings": merged, "device": device.split(":", 1)[0], "replicas": replicas})
    if manifest.eval.base_model is not None:
        identity = None
        why = "a LoRA run (its snapshots' digests do not cover the base model)"
    else:
        why = f"engine {kind} (a server this worker did not launch: no identity to vouch for)"
    if identity is None:
        print(f"ckpteval completion store {root}: not used for {why}", file=sys.stderr, flush=True)
    Path(root).mkdir(parents=True, exist_ok=True)
    return CompletionStore(Path(root), identity)
