"""The run manifest, ``run.json``: the single source of eval config for every consumer.

Owns the schema of ``run.json`` and its validation. Trainer, fleet workers, the service and backfill
all read the eval config (datasets, sampling, engine settings, adapters, lease settings) from here
and nowhere else, so they score exactly the same thing — a hand-copied default once made LoRA evals
silently score bare base weights.

Guarantee: :func:`load_manifest` returns a fully validated :class:`RunManifest` or raises
``ValueError`` naming the file and the offending field path (``eval.datasets[0].top_p``): sampling
settings must be finite and in range (temperature >= 0, top_p in (0, 1], top_k >= 1 or -1 for off,
max_new_tokens >= 1), so a run.json that every engine would refuse is refused before anything runs;
an unknown key of a dataset entry (``temprature``) is refused naming the closest valid one. Each
entry setting and its default is declared once, on its kind's settings dataclass
(:mod:`ckpteval.coord.entries`); the parser (:func:`ckpteval.coord.run.fields.parse_dataclass`) derives from them.

Scorers: coord knows no scorer (it imports nothing from ``jobs/``). The scorer registry
(:mod:`ckpteval.jobs.eval.scorers`) installs a pure function with :func:`set_scorer_check` when it is imported
(``import jobs`` imports it, so every ckpteval program has it before it reads a run.json); the parser
calls it with a dataset's ``scorer`` name and its ``scorer_options`` block, so a scorer added to the
registry is accepted — and its settings validated, unknown keys refused — wherever run.json is parsed.
Limits: a process that imports only ``coord`` (no ``jobs``) checks scorer names and options
structurally only (a non-empty name, an object); the manifest is written once at run creation;
changing it under running workers is not detected (workers read it at start).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckpteval.coord import PROTOCOL_VERSION
from ckpteval.coord.atomic import read_json_object, write_json_atomic
from ckpteval.coord.entries import KINDS, DatasetSpec, Entry, EnvSpec, HarnessSpec, entry_class, subset_rows
from ckpteval.coord.results.replays import ReplaySettings
from ckpteval.coord.run.fields import NAME_RE, FieldError, Fields, parse_dataclass

CANARY_ON_FAIL = ("skip", "flag")

# Their home is coord.entries / coord.fields; readers import them from here too.
__all__ = ["DatasetSpec", "Entry", "EnvSpec", "HarnessSpec", "FieldError", "Fields", "parse_dataclass", "subset_rows"]


@dataclass(frozen=True)
class LeaseSettings:
    """Lease timing every participant of a run must share (a lease file with another duration is refused:
    :class:`ckpteval.coord.work.lease.LeaseMismatch`)."""

    duration_s: float = 60.0
    """Seconds a claim stays a contender's to wait out after its marker last changed."""
    heartbeat_s: float = 10.0
    """Seconds between the holder's refreshes of its marker (> 0, below ``duration_s``)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.duration_s) and 0 < self.heartbeat_s < self.duration_s):
            raise FieldError("heartbeat_s", "must be > 0 and below lease.duration_s")


@dataclass(frozen=True)
class CanarySettings:
    """``eval.canary`` in run.json: what a unit whose engine disagrees with the trainer on the canary
    (teacher-forced log-probs of a probe stored with the snapshot, :mod:`ckpteval.jobs.eval.proof.canary`) becomes."""

    max_abs_logprob_diff: float | None = None
    """The largest max |Δ log-prob| over the probe tokens a unit may show; None: the measured default
    for the engine's dtype against the trainer's (0.001 same dtype, 0.05 a narrower one such as bf16 vs
    an fp32 trainer: bench/RESULTS.md "Canary"); 0: compare and record only, never fail."""
    on_fail: str = "skip"
    """``skip``: the unit is skipped ``canary_failed`` (never a scored point); ``flag``: it is scored and
    the failure only logged (``eval/fidelity/flagged``, a line on the worker's stderr)."""

    def __post_init__(self) -> None:
        if self.max_abs_logprob_diff is not None and not (
            math.isfinite(self.max_abs_logprob_diff) and self.max_abs_logprob_diff >= 0
        ):
            raise FieldError("max_abs_logprob_diff", f"must be a number >= 0 (or null), got {self.max_abs_logprob_diff}")
        if self.on_fail not in CANARY_ON_FAIL:
            raise FieldError("on_fail", f"{self.on_fail!r} must be one of {', '.join(CANARY_ON_FAIL)}")


@dataclass(frozen=True)
class EvalSpec:
    entries: tuple[Entry, ...]  # run.json's ``eval.datasets``, every kind, in file order
    engine: dict[str, Any] = field(default_factory=dict)
    adapters: tuple[dict[str, Any], ...] = ()
    # Absolute path of the fixed base model (an HF model dir) when every snapshot of the run is a LoRA
    # adapter (``adapter_config.json`` + ``adapter_model.safetensors``); None: snapshots are full models.
    base_model: str | None = None
    canary: CanarySettings = CanarySettings()
    replay: ReplaySettings = ReplaySettings()  # ``eval.replay``: steps evaluated again (ckpteval.coord.results.replays)

    @property
    def datasets(self) -> tuple[DatasetSpec, ...]:
        """The entries scored per sample (point rule ``samples``: JSONL rows, per-sample scores), in order."""
        return tuple(e for e in self.entries if e.POINT_RULE == "samples")  # type: ignore[misc]


@dataclass(frozen=True)
class RunManifest:
    run_id: str
    eval: EvalSpec
    snapshot_roots: tuple[str, ...]  # absolute dirs where this run's snapshots appear
    trainer: dict[str, Any] = field(default_factory=dict)
    lease: LeaseSettings = LeaseSettings()
    created: float = 0.0
    protocol: int = PROTOCOL_VERSION

    def entry(self, name: str) -> Any:
        """The entry of ``eval.datasets`` named ``name``, of any kind (KeyError naming the run if none)."""
        for spec in self.eval.entries:
            if spec.name == name:
                return spec
        raise KeyError(f"run {self.run_id}: no dataset named {name!r}")

    def to_json(self) -> dict[str, Any]:
        obj = json.loads(json.dumps(asdict(self)))  # tuples become lists, as on disk
        obj["eval"]["datasets"] = obj["eval"].pop("entries")  # run.json's name for them
        return obj


# -- the registries' hooks (coord knows no scorer and no environment; see the module docstring) -----------
ScorerCheck = Callable[[str, Fields], None]
_checks: dict[str, ScorerCheck] = {}  # an entry's name field ("scorer", "env") -> its registry's check


def set_scorer_check(check: ScorerCheck) -> None:
    """Install the scorer registry's check of a dataset's ``scorer`` and ``scorer_options``
    (``check(name, options_fields)`` raises ValueError). :mod:`ckpteval.jobs.eval.scorers` installs its own when
    it is imported (``import jobs`` does that)."""
    _checks["scorer"] = check


def set_env_check(check: ScorerCheck) -> None:
    """Install the environment registry's check of an ``env`` entry's ``env`` name and ``env_options``
    (:mod:`ckpteval.jobs.eval.kinds.env` installs it when imported, as the scorer registry does its own)."""
    _checks["env"] = check


def parse_entry(f: Fields) -> Entry:
    """One entry of ``eval.datasets``, validated by its kind's settings class and the registry hooks it names."""
    kind = f.get("kind", str, "generate")
    if kind not in KINDS:
        close = difflib.get_close_matches(kind, list(KINDS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise f.error("kind", f"{kind!r} must be one of {', '.join(KINDS)} ({hint}default generate)")
    cls = entry_class(kind)
    spec = parse_dataclass(f, cls, what=f"a dataset of kind {kind!r}")
    for name_field, options_field in cls.CHECKED:
        if name_field in _checks:
            try:
                _checks[name_field](getattr(spec, name_field), f.sub(options_field, {}))
            except FieldError as e:  # the registry's verdict on the name itself (key "scorer")
                raise f.error(e.key, e.why) from None
    return spec  # type: ignore[no-any-return]


def _parse_eval(f: Fields) -> EvalSpec:
    f.reject_unknown(["datasets", "engine", "adapters", "base_model", "canary", "replay"], "the eval section")
    raw_datasets = f.get("datasets", list)
    if not raw_datasets:
        raise f.error("datasets", "must list at least one dataset")
    entries = tuple(parse_entry(Fields(f.source, d, f"{f._path('datasets')}[{i}]")) for i, d in enumerate(raw_datasets))
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise f.error("datasets", f"has duplicate names: {names}")
    adapters = f.get("adapters", list, [])
    for i, a in enumerate(adapters):
        if not isinstance(a, dict):
            raise f.error(f"adapters[{i}]", "must be an object")
    base_model = f.get("base_model", (str, type(None)), None)
    if base_model is not None and not Path(base_model).is_absolute():
        raise f.error("base_model", f"must be an absolute path (the base model dir), got {base_model!r}")
    return EvalSpec(
        entries=entries, engine=f.get("engine", dict, {}), adapters=tuple(adapters),
        base_model=base_model, canary=parse_dataclass(f.sub("canary", {}), CanarySettings, what="eval.canary"),
        replay=parse_dataclass(f.sub("replay", {}), ReplaySettings, what="eval.replay"),
    )


def parse_manifest(obj: Any, source: Path) -> RunManifest:
    """Validate a decoded ``run.json``; every error names ``source`` and the field."""
    f = Fields(source, obj, "")
    f.reject_unknown([fl.name for fl in dataclasses.fields(RunManifest)], "run.json")
    protocol = f.get("protocol", int, PROTOCOL_VERSION)  # every run.json ckpteval writes names it
    if protocol != PROTOCOL_VERSION:
        raise f.error("protocol", f"is {protocol}; this ckpteval reads only protocol {PROTOCOL_VERSION} run dirs "
                                  f"(protocol {protocol} was never released: create the run again)")
    run_id = f.get("run_id", str)
    if not NAME_RE.match(run_id):
        raise f.error("run_id", f"{run_id!r} must match {NAME_RE.pattern}")
    roots = f.get("snapshot_roots", list)
    for i, r in enumerate(roots):
        if not isinstance(r, str) or not Path(r).is_absolute():
            raise f.error(f"snapshot_roots[{i}]", f"must be an absolute path, got {r!r}")
    lease = parse_dataclass(f.sub("lease", {}), LeaseSettings, what="lease")
    return RunManifest(
        run_id=run_id,
        eval=_parse_eval(f.sub("eval")),
        snapshot_roots=tuple(roots),
        trainer=f.get("trainer", dict, {}),
        lease=lease,
        created=float(f.get("created", (int, float), 0.0)),
        protocol=protocol,
    )


def load_manifest(path: Path) -> RunManifest:
    """Read and validate ``run.json`` (FileNotFoundError / ValueError name the file)."""
    return parse_manifest(read_json_object(path), Path(path))


def save_manifest(path: Path, manifest: RunManifest) -> None:
    """Validate (round-trip) and write ``run.json`` atomically."""
    obj = manifest.to_json()
    parse_manifest(obj, Path(path))
    write_json_atomic(path, obj)

