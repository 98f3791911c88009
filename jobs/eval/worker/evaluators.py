"""What happens between claim and result: verify, pin, score, check the pin again.

An :class:`Evaluator` turns one claimed unit into scores or raises a skip; :func:`evaluate_unit` maps every
expected failure to a skip reason (``ckpt_missing``/``ckpt_corrupt``/``pin_violation``/``unhealthy``/
``rejected``/``aborted``/``crashed``/a backend's own). Pinning is :mod:`ckpteval.jobs.eval.proof.pinning`'s (shared with
the shared posture). A request the engine refuses (``rejected``) or samples it aborts (``aborted``) never
restart the engine; an engine whose last load failed reports no version, so the next unit reloads it.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from ckpteval.coord.entries import EngineNeed
from ckpteval.coord.results.engine_identity import EngineIdentity
from ckpteval.coord.results.files import Result, skip_result
from ckpteval.coord.run.identity import run_key, snapshots_key, weight_version
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.snapshots.discovery import SnapshotRef, overwritten
from ckpteval.coord.snapshots.snapshot import (
    ADAPTER_CONFIG,
    SnapshotCorrupt,
    SnapshotError,
    SnapshotMissing,
    VerifiedSnapshots,
    verify_snapshot,
)
from ckpteval.coord.work.units import WorkUnit, shard_range
from ckpteval.jobs.eval.engines.base import (
    Engine,
    EngineError,
    ServerMisconfigured,
    engine_gpus,
    engine_identity,
    launch_timeout,
)
from ckpteval.jobs.eval.engines.factory import (
    ENGINES,
    EnginePool,
    engine_settings,
    make_engine,
    resolve_specs,
    spec_kind,
)
from ckpteval.jobs.eval.engines.fn import CheckpointEvalFn, EvalSkip, build_input, parse_output
from ckpteval.jobs.eval.kinds.evaluate import Evaluation, evaluate_pinned, unit_result
from ckpteval.jobs.eval.kinds.generate.prompts import NoChatTemplate, render_prompts
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache, unit_input
from ckpteval.jobs.eval.kinds.generate.store import CompletionStore, answer_from_store, open_store
from ckpteval.jobs.eval.kinds.generate.tokenizer_files import offer_run_tokenizer
from ckpteval.jobs.eval.proof.attest import (
    NOT_ATTESTED,
    Attestation,
    AttestDisputed,
    AttestFailed,
    attest,
    settle,
)
from ckpteval.jobs.eval.proof.canary_check import CanaryFailed, check_canary, engine_kind
from ckpteval.jobs.eval.proof.cross_engine import cross_check, first_generate
from ckpteval.jobs.eval.proof.pinning import PinViolation, pin, restart
from ckpteval.jobs.eval.skips import WorkerSkip
from ckpteval.jobs.eval.worker.options import WorkerOptions

# What scoring may raise and still be a ``crashed`` unit rather than a dead worker: engine/runtime, bad
# values, I/O, and the lookup/type/arithmetic errors a custom scorer or fn backend raises on bad input.
# Anything else is a bug in the worker itself: it stops (exit 1) with the unit's lease released.
SCORING_ERRORS = (RuntimeError, ValueError, OSError, LookupError, TypeError, ArithmeticError)


# -- skips raised while evaluating --------------------------------------------------------------------
class Unhealthy(WorkerSkip):
    reason = "unhealthy"


class ConfigMismatch(ValueError):
    """A snapshot the run's configuration cannot load on any node (a LoRA adapter in a run without
    ``eval.base_model``, or the reverse; a server without a route, flag or variable it needs, :class:`ServerMisconfigured`):
    the worker stops with one line and exit 2, never 4 (requeue)."""


def check_snapshot_form(manifest: RunManifest, snapshot: Path) -> None:
    """:class:`ConfigMismatch` when ``snapshot``'s form (adapter or full model) is not what run.json says."""
    adapter = (snapshot / ADAPTER_CONFIG).is_file() and not (snapshot / "config.json").is_file()
    base = manifest.eval.base_model
    if adapter and base is None:
        raise ConfigMismatch(
            f"snapshot {snapshot} is a LoRA adapter ({ADAPTER_CONFIG}, no config.json) but run.json names no "
            "eval.base_model: put \"base_model\": \"<the base model's directory>\" under \"eval\" in the eval "
            "config and use a new run dir (backfill --from-run of a LoRA run carries it)")
    if base is not None and not adapter and (snapshot / "config.json").is_file():
        raise ConfigMismatch(
            f"snapshot {snapshot} is a full model (config.json, no {ADAPTER_CONFIG}) but run.json names "
            f"eval.base_model {base}, which makes every snapshot a LoRA adapter on it: drop eval.base_model "
            "from the eval config and use a new run dir")


# -- evaluators: the part between claim and result ------------------------------------------------------
class Evaluator(Protocol):
    cache: DatasetCache  # the run's datasets and manifest

    def evaluate(self, unit: WorkUnit, ref: SnapshotRef, timings: dict[str, float]) -> Evaluation: ...

    def probe(self) -> None:
        """Before the first claim: raise :class:`EngineError` if this backend cannot work at all."""

    def close(self) -> None: ...


class EngineEvaluator:
    """Engines (:class:`~ckpteval.jobs.eval.engines.base.Engine`): probe, heal, pin, then the one unit path
    (:func:`ckpteval.jobs.eval.kinds.evaluate.evaluate_pinned`, which checks the pin again)."""

    def __init__(
        self, engine: Engine, cache: DatasetCache, pin_timeout_s: float, load_timeout_s: float,
        canary_max_diff: float | None = None, store: CompletionStore | None = None,
    ) -> None:
        self.engine, self.cache = engine, cache
        self.store = store  # --completion-store: units already known are answered without the engine
        offer_run_tokenizer(engine, cache.run.base)  # a checkpoint saved without its tokenizer uses the run's
        self.key = run_key(cache.manifest)  # versions are <run key>@<step>: a shared engine never
        # passes one run's pin while holding another run's weights of the same step
        self.pin_timeout_s, self.load_timeout_s = pin_timeout_s, load_timeout_s
        self._loaded_once = False
        canary = cache.manifest.eval.canary  # the run's policy; --canary-max-diff overrides its threshold
        self.canary_max_diff = canary.max_abs_logprob_diff if canary_max_diff is None else canary_max_diff
        self.canary_on_fail = canary.on_fail
        self.cross_engine = canary.cross_engine  # prompts of the cross-engine check per load (0: off)
        self._attested: tuple[str, Attestation, dict[str, float]] | None = None  # (version, attestation,
        # canary fidelity) since the last load
        self._distrusted: set[str] = set()  # versions whose attestation failed: reloaded before the next try
        self._self_loaded: str | None = None  # the version this evaluator itself loaded into the engine from
        # disk and still holds; any other (a label someone else set, a server launched by another) is reloaded

    def evaluate(self, unit: WorkUnit, ref: SnapshotRef, timings: dict[str, float]) -> Evaluation:
        want = weight_version(self.key, unit.step)
        keyed = self.store.key(self.cache, unit, ref) if self.store is not None else None
        if keyed is not None and self.store is not None and (entry := self.store.get(*keyed)) is not None:
            timings["load_s"] = timings["generate_s"] = 0.0
            ev = answer_from_store(self.cache, unit, keyed[1], entry, want, self.store.path(keyed[0]), str(ref.path))
            identity = engine_identity(self.engine)  # the store key holds the engine's: an entry is this identity's
            return replace(ev, engine={} if identity is None else identity.to_json())
        check_snapshot_form(self.cache.manifest, Path(ref.path))  # before any load: never an engine restart
        t0 = time.perf_counter()
        self._prepare(ref, want)
        timings["load_s"] = time.perf_counter() - t0
        attestation, fidelity = self._attest(ref, want, timings)
        try:
            ev = evaluate_pinned(self.engine, self.cache, unit, str(ref.path), want)
        except EngineError as e:
            if not e.restart_helps:  # a rejected request, aborted samples: the engine is fine
                raise
            self._heal(ref, want)  # died mid-unit: bring it back, attest the reload, then one more try
            attestation, fidelity = self._attest(ref, want, timings)
            ev = evaluate_pinned(self.engine, self.cache, unit, str(ref.path), want)
        timings["generate_s"] = ev.generate_s
        if keyed is not None and self.store is not None and ev.kept is not None:
            self.store.put(keyed[0], ev.kept)
            ev = replace(ev, cost={**ev.cost, "store_misses": 1.0})
        identity = engine_identity(self.engine)  # what produced the samples (EngineError: unhealthy)
        return replace(ev, attest=attestation.to_json(), fidelity=fidelity,
                       cost=unit_cost(ev, timings, engine_gpus(self.engine)),
                       engine={} if identity is None else identity.to_json())

    def _attest(self, ref: SnapshotRef, want: str, timings: dict[str, float],
                rederive: bool = True) -> tuple[Attestation, dict[str, float]]:
        """The attestation of the weights held for ``want`` and the canary's fidelity (:mod:`ckpteval.jobs.eval.proof.canary`;
        ``{}``: no canary), made after each load (the evaluator only scores versions it loaded itself). The
        checksum is recorded (:func:`ckpteval.jobs.eval.proof.attest.settle`) only after the canary passed unflagged.
        A disputed checksum on an engine this worker launched is re-derived once by a relaunch (an independent
        load); elsewhere the dispute is the unit's (left for another worker)."""
        if self._attested is not None and self._attested[0] == want:
            timings["attest_s"] = timings["canary_s"] = 0.0
            return self._attested[1], self._attested[2]
        marker = verify_snapshot(ref.path, "fast", marker=ref.marker if ref.foreign else None)
        try:
            attestation = attest(self.engine, ref.path, marker, self.cache.run, loaded=self._self_loaded == want)
            fidelity = check_canary(self.engine, ref.path, marker, self.canary_max_diff, self.canary_on_fail)
            attestation = settle(attestation, record=fidelity is None or not fidelity.flagged)
        except AttestDisputed:
            self._distrusted.add(want)
            if rederive and launch_timeout(self.engine) > 0:  # a server this worker launched: relaunch it
                self._heal(ref, want)
                return self._attest(ref, want, timings, rederive=False)
            raise
        except (AttestFailed, CanaryFailed):
            self._distrusted.add(want)
            raise
        self._distrusted.discard(want)
        record = {**({} if fidelity is None else fidelity.to_json()), **self._cross_engine(ref)}
        self._attested = (want, attestation, record)
        timings["attest_s"], timings["canary_s"] = attestation.seconds, record.get("seconds", 0.0)
        return attestation, record

    def _cross_engine(self, ref: SnapshotRef) -> dict[str, float]:
        """run.json ``eval.canary.cross_engine``: the loaded snapshot against the in-process engine
        (:mod:`ckpteval.jobs.eval.proof.cross_engine`); {} when off, for the in-process engine itself and for LoRA."""
        if not self.cross_engine or engine_kind(self.engine) == "hf" or self.cache.manifest.eval.base_model:
            return {}
        spec = first_generate(self.cache.manifest)
        prompts = render_prompts(spec, self.cache.rows(spec)[:self.cross_engine], str(ref.path))
        return cross_check(self.engine, spec, prompts, str(ref.path))

    def probe(self) -> None:
        """Start-up probe: the engine answers (a remote one that does not raises EngineError) and, once
        it holds weights (a server is started with a model), passes a one-token generate. An in-process
        engine with nothing loaded yet was checked when it was built (its device exists)."""
        if self.engine.weight_version() is not None and not self.engine.healthy():
            raise EngineError("the engine failed its start-up probe (one-token generate)")

    def _prepare(self, ref: SnapshotRef, want: str) -> None:
        """Probe (when something is loaded), pin, and probe again after a fresh load; heal on failure."""
        if self._loaded_once and not self.engine.healthy():
            self._heal(ref, want)
            return
        try:
            loaded = self._pin(ref, want)
        except EngineError as e:
            if not e.restart_helps:  # the snapshot's form: no restart loads it
                raise
            self._heal(ref, want, cause=e)
            return
        if loaded and not self.engine.healthy():
            self._heal(ref, want)

    def _heal(self, ref: SnapshotRef, want: str, cause: EngineError | None = None) -> None:
        """Restart, reload, re-probe; the skip names ``cause`` (what failed first) before the restart's failure
        (an attached server's ``cannot restart`` hides nothing: the 404 that started it comes first)."""
        self._self_loaded, self._attested = None, None  # a relaunch: reloaded and attested afresh
        try:
            restart(self.engine, self.load_timeout_s)  # bounded by a launch's start-up timeout
            self._pin(ref, want)
        except EngineError as e:
            first = "" if cause is None or str(cause) == str(e) else f"{cause}; then "
            raise Unhealthy(f"{first}engine dead after restart: {e}") from e
        if not self.engine.healthy():
            raise Unhealthy("engine failed its probe after restart and reload")

    def _pin(self, ref: SnapshotRef, want: str) -> bool:
        """:func:`ckpteval.jobs.eval.proof.pinning.pin` with the fleet's bounds; returns whether a load happened."""
        try:
            loaded = pin(self.engine, str(ref.path), want, load_timeout_s=self.load_timeout_s,
                         pin_timeout_s=self.pin_timeout_s,
                         reload=want in self._distrusted or self._self_loaded != want)  # never adopt a label
        except PinViolation:
            self._loaded_once, self._attested, self._self_loaded = True, None, None  # loaded; read-back failed
            raise
        except EngineError:
            self._attested, self._self_loaded = None, None  # the held weights are unknown: reload, attest again
            raise
        if loaded:
            self._attested, self._self_loaded = None, want  # new weights, loaded here: attested before they score
        self._loaded_once = self._loaded_once or loaded
        return loaded

    def close(self) -> None:
        self.engine.close()


def unit_cost(ev: Evaluation, timings: dict[str, float], gpus: int) -> dict[str, float]:
    """What a unit cost (``eval/cost/*``): the kind's own counts (tokens, scorer seconds) plus the
    engine's generation seconds, its GPU count, the load and attestation seconds, and GPU-seconds:
    (generation + load + attestation) x GPUs (idle time between units is not a unit's cost)."""
    load_s, attest_s = timings.get("load_s", 0.0), timings.get("attest_s", 0.0)
    busy = ev.generate_s + load_s + attest_s
    return {**ev.cost, "engine_s": ev.generate_s, "gpus": float(gpus), "gpu_s": busy * gpus,
            "load_s": load_s, "attest_s": attest_s, "canary_s": timings.get("canary_s", 0.0)}


class FnEvaluator:
    """A :class:`~ckpteval.jobs.eval.engines.fn.CheckpointEvalFn`: hands it the unit, checks what comes back."""

    def __init__(self, backend: CheckpointEvalFn, cache: DatasetCache, spec: str = "fn") -> None:
        self.backend, self.cache = backend, cache
        self.identity = EngineIdentity("fn", version=spec.partition(":")[2] or None)  # the backend's module:Class

    def evaluate(self, unit: WorkUnit, ref: SnapshotRef, timings: dict[str, float]) -> Evaluation:
        manifest = self.cache.manifest
        spec = manifest.entry(unit.dataset)
        rows = [self.cache.rows(spec)[i] for i in shard_range(manifest, unit)]
        work = unit_input(self.cache, unit, str(ref.path))
        want = str(unit.step)
        t0 = time.perf_counter()
        output = self.backend.evaluate_checkpoint(
            str(ref.path), build_input(manifest, spec, unit, rows, work.prompts[:: len(work.samples)], work.seeds)
        )
        timings["generate_s"] = time.perf_counter() - t0
        parsed = parse_output(output, len(rows) * len(work.samples), want)
        wrong = sorted({str(v) for v in parsed.weight_versions if v != want})
        if wrong:
            raise PinViolation(f"want version {want}; backend reported {wrong}")
        ev = Evaluation(parsed.scores, parsed.weight_versions, parsed.message, parsed.answers,
                        scored={"extras": parsed.extras()} if parsed.extras() else {},
                        attest=NOT_ATTESTED.to_json(), generate_s=timings["generate_s"])
        return replace(ev, cost=unit_cost(ev, timings, 0), engine=self.identity.to_json())

    def probe(self) -> None:
        """An fn backend was built (and its constructor ran) at start; nothing more to probe."""

    def close(self) -> None:
        self.backend.dispose()


def evaluate_unit(evaluator: Evaluator, unit: WorkUnit, ref: SnapshotRef, verify: str,
                  verified: VerifiedSnapshots | None = None) -> Result:
    """Verify the snapshot (through ``verified``: once per snapshot per process) and evaluate ``unit``; every
    expected failure becomes a skip result. A failed unit's snapshot is checked again, never from the cache."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    check = verify_snapshot if verified is None else verified.verify
    try:
        marker = check(ref.path, verify, ref.marker if ref.foreign else None)
        own = snapshots_key(evaluator.cache.manifest)
        if not ref.foreign and marker.run is not None and marker.run != own:  # e.g. reached by the dispatch ledger
            raise SnapshotMissing(ref.path, overwritten(ref.path, marker.run, own))
        if marker.step != unit.step:
            raise SnapshotCorrupt(ref.path, f"marker says step {marker.step}, expected {unit.step}")
        timings["verify_s"] = time.perf_counter() - t0
        return unit_result(unit, evaluator.evaluate(unit, ref, timings), timings=timings)
    except ConfigMismatch:  # the run's configuration, not this unit: the worker stops (exit 2)
        raise
    except ServerMisconfigured as e:  # the server lacks a route/flag the run needs: no node cures it (exit 2)
        raise ConfigMismatch(str(e)) from e
    except WorkerSkip as e:  # blame: user code failed (a scorer, a library task), written at once
        if e.blame is not None:
            return skip_result(unit, e.reason, str(e), timings=timings, blame=e.blame)
        reason, message = e.reason, str(e)
    except (SnapshotError, EvalSkip, NoChatTemplate) as e:
        reason, message = e.reason, str(e)
    except EngineError as e:  # unhealthy; or rejected/aborted (RequestRejected, SamplesAborted)
        reason, message = e.reason, str(e)
    except SCORING_ERRORS as e:
        reason, message = "crashed", f"{type(e).__name__}: {e}"
    if reason in {"unhealthy", "crashed"}:
        # The snapshot may have gone away (or been damaged) after it was verified: then the load or the
        # backend failed because of the snapshot, and blaming the engine would restart a healthy one.
        try:
            verify_snapshot(ref.path, "fast", marker=ref.marker if ref.foreign else None)
        except SnapshotError as gone:
            reason, message = gone.reason, f"{gone} (after verification; the evaluation failed: {message})"
    return skip_result(unit, reason, message, timings=timings)


def check_entry_engines(manifest: RunManifest, kinds: list[str], replicas: int) -> None:
    """Entries that need exactly one engine (:attr:`EngineNeed.ONE`: lm_eval, through lm-eval's own adapters)
    get one hf, http or sglang engine, no pool; entries that need an engine (``GENERATING``: env) get no
    fn: backend (it scores whole units, one completion per prompt)."""
    unit_backend = len(kinds) == 1 and ENGINES[kinds[0]].unit_backend
    one = [e for e in manifest.eval.entries if e.ENGINES is EngineNeed.ONE]
    if one and (len(kinds) != 1 or replicas != 1 or unit_backend):
        raise ValueError(
            f"run {manifest.run_id} has {one[0].kind} entries {[e.name for e in one]}: they need exactly one hf, "
            f"http:URL or sglang engine (got --engine {'+'.join(kinds)} x{replicas})"
        )
    generating = [e for e in manifest.eval.entries if e.ENGINES is EngineNeed.GENERATING]
    if generating and unit_backend:
        raise ValueError(f"run {manifest.run_id} has {generating[0].kind} entries {[e.name for e in generating]}: "
                         "they need an engine (hf, http:URL, sglang), not an fn: backend (it scores whole units, "
                         "one completion per prompt)")


def _settings(manifest: RunManifest, kind: str) -> dict[str, Any]:
    """run.json's settings for ``kind``; an engine with a batch-invariant mode (sglang:
    ``--enable-deterministic-inference``) runs it unless every entry opts out (``"deterministic": false``;
    the mode is server-wide, so one entry that keeps it keeps it for all). run.json's own
    ``eval.engine.<kind>.deterministic`` wins."""
    settings = engine_settings(manifest.eval.engine, kind)
    if ENGINES[kind].deterministic_mode:
        settings.setdefault("deterministic", any(wants_determinism(e) for e in manifest.eval.entries))
    return settings


def wants_determinism(entry: object) -> bool:
    """Whether an entry asks for the engine's deterministic mode (its ``deterministic`` setting; a kind
    without one: yes)."""
    return bool(getattr(entry, "deterministic", True))


def build_evaluator(opts: WorkerOptions, manifest: RunManifest, cache: DatasetCache) -> Evaluator:
    specs = resolve_specs(opts.engines, opts.device)  # --engine auto: decided here, on the node
    if list(specs) != list(opts.engines):
        print(f"ckpteval worker: --engine auto -> {', '.join(specs)} (device {opts.device})", file=sys.stderr)
    kinds = [spec_kind(s) for s in specs]
    check_entry_engines(manifest, kinds, opts.replicas)
    if len(kinds) == 1 and ENGINES[kinds[0]].unit_backend:
        backend = make_engine(specs[0], opts.device, _settings(manifest, kinds[0]))
        return FnEvaluator(backend, cache, specs[0])  # type: ignore[arg-type]
    if manifest.eval.adapters:
        raise ValueError(
            f"run {manifest.run_id} evaluates adapters {list(manifest.eval.adapters)}; engines here would score the "
            "bare base weights — use an fn: backend that applies them (a run whose snapshots are LoRA adapters "
            "names its base in eval.base_model instead)"
        )
    base_model = manifest.eval.base_model
    if base_model is not None and not Path(base_model).is_dir():
        raise FileNotFoundError(f"run {manifest.run_id}: eval.base_model {base_model} is not a directory")
    engines = [
        make_engine(spec, opts.device, _settings(manifest, kind), base_model)
        for spec, kind in zip(specs, kinds, strict=True)
        for _ in range(opts.replicas)
    ]
    engine: Engine = engines[0] if len(engines) == 1 else EnginePool(engines)  # type: ignore[assignment,arg-type]
    store = open_store(opts.completion_store, manifest, list(specs),
                       {k: _settings(manifest, k) for k in kinds}, opts.device, opts.replicas)
    return EngineEvaluator(engine, cache, opts.pin_timeout_s, opts.load_timeout_s, opts.canary_max_diff, store)
