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

Registry checks: coord knows no scorer and no environment (it imports nothing from ``jobs/``). A program installs
their checks at start (:func:`install_checks`; every ckpteval program does, through
:func:`ckpteval.jobs.eval.kinds.evaluate.install_checks`); the parser then calls the check of each name field an
entry's kind lists (``CHECKED``: ``scorer``, ``env``) with the name and its options block.
Limits: a process that installs no checks validates those names structurally only (a non-empty name, an
object); the manifest is written once at run creation; changing it under running workers is not detected.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckpteval.coord import PROTOCOL_VERSION
from ckpteval.coord.atomic import read_json_object, write_json_atomic
from ckpteval.coord.entries import Entry, entry_class
from ckpteval.coord.results.replays import ReplaySettings
from ckpteval.coord.run.fields import NAME_RE, FieldError, Fields, parse_dataclass

CANARY_ON_FAIL = ("skip", "flag")

__all__ = ["Entry", "FieldError", "Fields", "parse_dataclass"]  # their home is coord.entries / coord.run.fields


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
    cross_engine: int = 0
    """The cross-engine check on demand: the first N prompts of the first generate entry (the same at every step),
    answered greedy on each loaded snapshot by the worker's engine and by the in-process transformers engine;
    agreement and max |Δ log-prob| logged as ``eval/fidelity/cross_engine/<dataset>/<engines>/*``. 0: off."""

    def __post_init__(self) -> None:
        if isinstance(self.cross_engine, bool) or not isinstance(self.cross_engine, int) or self.cross_engine < 0:
            raise FieldError("cross_engine", f"must be a whole number of prompts >= 0, got {self.cross_engine!r}")
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


# -- the registries' checks (coord knows no scorer and no environment; see the module docstring) ----------
NameCheck = Callable[[str, Fields], None]
_checks: dict[str, NameCheck] = {}  # an entry's name field ("scorer", "env") -> its registry's check


def install_checks(checks: Mapping[str, NameCheck]) -> None:
    """Install registries' checks of the names entries carry: ``{name field: check(name, options_fields)}``,
    each raising ValueError (:func:`ckpteval.jobs.eval.kinds.evaluate.install_checks` installs jobs' own)."""
    _checks.update(checks)


def parse_entry(f: Fields) -> Entry:
    """One entry of ``eval.datasets``, validated by its kind's settings class and the registry checks it names."""
    kind = f.get("kind", str, "generate")
    try:
        cls = entry_class(kind)
        spec = parse_dataclass(f, cls, what=f"a dataset of kind {kind!r}")
        for name_field, options_field in cls.CHECKED:
            if name_field in _checks:
                _checks[name_field](getattr(spec, name_field), f.sub(options_field, {}))
    except FieldError as e:  # a registry's verdict on a name (key "kind", "scorer", "env")
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

