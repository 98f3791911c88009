"""The canary (#19 §2): the eval engine recomputes the trainer's teacher-forced log-probs of a probe.

Real parts: snapshots of the reference trainer's tiny model exported with their canary by the exporter
(``AsyncExporter.submit(canary=...)``, what the dispatcher passes), the real tokenizer and the real
in-process hf engine. The faults (a tokenizer swapped after launch, a layer scaled by 1.01, a stale
layer) are applied to that real engine; the canary is checked directly where attestation would catch
the fault first (it runs before the canary in the worker).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from tokenizers import processors

from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
from ckpteval.coord.snapshots.snapshot import CANARY, read_marker
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.kinds.generate.evalsets import load_dataset
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
from ckpteval.jobs.eval.proof.canary import (
    CANARY_MAX_DIFF_NARROWER,
    CANARY_MAX_DIFF_SAME_DTYPE,
    canary_bytes,
    probe_rows,
)
from ckpteval.jobs.eval.proof.canary_check import CanaryFailed, check_canary
from ckpteval.jobs.eval.worker.evaluators import EngineEvaluator, evaluate_unit
from ckpteval.jobs.reference.model import build_model, build_tokenizer
from ckpteval.jobs.trainer.export.async_export import AsyncExporter
from tests.support.workers import base_dir, make_eval_run, version


def _export(tmp_path: Path, run, step: int) -> Path:  # noqa: ANN001
    """Export ``step`` of the tiny model with its canary, as the dispatcher does."""
    model = build_model(seed=step)
    pairs = probe_rows(load_dataset(run, run.manifest().eval.entries[0]))
    exporter = AsyncExporter(run.snapshots, base_dir(tmp_path), run=None)
    exporter.submit(step, model, canary=canary_bytes(model, build_tokenizer(), pairs))
    exporter.wait()
    (outcome,) = exporter.poll()
    assert outcome.ok, outcome.error
    return outcome.path


@pytest.fixture
def snapshot(tmp_path: Path):  # noqa: ANN201
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4, max_new_tokens=2)
    return run, _export(tmp_path, run, 1)


def test_the_canary_is_stored_with_the_snapshot_and_listed_in_its_marker(snapshot) -> None:  # noqa: ANN001
    _, path = snapshot
    marker = read_marker(path)
    assert CANARY in marker.files
    import json

    stored = json.loads((path / CANARY).read_text())
    assert stored["dtype"] == "float32" and len(stored["probes"]) == 4
    assert all(len(p["logprobs"]) == len(p["argmax"]) > 0 for p in stored["probes"])


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_an_honest_engine_passes_at_fp32_and_bf16_within_the_bound(snapshot, dtype: str) -> None:  # noqa: ANN001
    run, path = snapshot
    (ref,) = SnapshotDiscovery(run.snapshots).poll()
    engine = HFEngine(dtype=dtype)
    try:
        evaluator = EngineEvaluator(engine, DatasetCache(run, run.manifest()), 5.0, 120.0)
        result = evaluate_unit(evaluator, WorkUnit(1, "addition", 0), ref, "fast")
    finally:
        engine.close()
    assert result.ok, result.message
    diff = result.fidelity["max_abs_logprob_diff"]
    assert result.fidelity["tokens"] > 0
    if dtype == "auto":  # the trainer's own dtype and kernels: the same numbers
        assert diff <= CANARY_MAX_DIFF_SAME_DTYPE and result.fidelity["argmax_agreement"] == 1.0
    else:  # bf16 cannot hold the fp32 snapshot: attestation says so, the canary bounds the damage
        assert 0 < diff <= CANARY_MAX_DIFF_NARROWER and result.attest["attested"] is False


def _loaded(path: Path, run) -> HFEngine:  # noqa: ANN001
    engine = HFEngine()
    engine.load(str(path), version(run, 1))
    return engine


def test_a_tokenizer_swapped_after_launch_fails_the_canary(snapshot) -> None:  # noqa: ANN001
    run, path = snapshot
    engine = _loaded(path, run)
    try:
        swapped = copy.deepcopy(engine.tokenizer)
        swapped.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A", special_tokens=[])
        engine._tokenizer = swapped  # no <bos>: what a server launched with another tokenizer does
        with pytest.raises(CanaryFailed, match="max |Δ log-prob| inf"):
            check_canary(engine, path, read_marker(path), None)
    finally:
        engine.close()


def test_a_layer_scaled_by_1_01_fails_the_canary(snapshot) -> None:  # noqa: ANN001
    run, path = snapshot
    engine = _loaded(path, run)
    try:
        assert check_canary(engine, path, read_marker(path), None).max_abs_logprob_diff <= CANARY_MAX_DIFF_SAME_DTYPE
        with torch.no_grad():
            for p in engine.model.model.layers[0].parameters():
                p.mul_(1.01)
        with pytest.raises(CanaryFailed):  # the default bound of an engine in the trainer's dtype
            check_canary(engine, path, read_marker(path), None)
    finally:
        engine.close()


def test_the_stale_layer_engine_fails_the_canary(tmp_path: Path, snapshot) -> None:  # noqa: ANN001
    from tests.test_attest import StaleLayerEngine

    run, path = snapshot
    other = _export(tmp_path, run, 2)
    engine = StaleLayerEngine()
    try:
        engine.load(str(other), "2")
        engine.load(str(path), version(run, 1))  # keeps step 2's layer-0 attention under step 1's label
        with pytest.raises(CanaryFailed):
            check_canary(engine, path, read_marker(path), None)
    finally:
        engine.close()


@pytest.mark.parametrize("on_fail", ["skip", "flag"])
def test_the_runs_canary_policy_skips_or_flags_a_unit_over_its_threshold(snapshot, on_fail: str) -> None:  # noqa: ANN001
    """run.json ``eval.canary``: a bf16 engine (about 0.01 from the fp32 trainer, bench/RESULTS.md) against a
    threshold of 0.001 fails the canary; ``skip`` makes the unit ``canary_failed``, ``flag`` scores it and
    marks the fidelity (and the point's ``eval/fidelity/flagged``)."""
    from dataclasses import replace

    from ckpteval.coord.results.points import point_fidelity
    from ckpteval.coord.run.manifest import CanarySettings, save_manifest

    run, _ = snapshot
    manifest = run.manifest()
    canary = CanarySettings(max_abs_logprob_diff=1e-3, on_fail=on_fail)
    save_manifest(run.manifest_path, replace(manifest, eval=replace(manifest.eval, canary=canary)))
    assert run.manifest().eval.canary == canary  # written and read back through run.json
    (ref,) = SnapshotDiscovery(run.snapshots).poll()
    engine = HFEngine(dtype="bfloat16")
    try:
        evaluator = EngineEvaluator(engine, DatasetCache(run, run.manifest()), 5.0, 120.0)
        result = evaluate_unit(evaluator, WorkUnit(1, "addition", 0), ref, "fast")
    finally:
        engine.close()
    if on_fail == "skip":
        assert result.skip_reason == "canary_failed" and "exceeds 0.001" in result.message
    else:
        assert result.ok, result.message
        assert result.fidelity["flagged"] == 1.0 and result.fidelity["max_abs_logprob_diff"] > 1e-3
        assert point_fidelity([result])["flagged"] == 1.0
