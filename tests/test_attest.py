"""Attestation (#19): an engine proves which weights it holds; the label alone never passes a unit.

Real parts only: snapshots of the reference trainer's tiny model written by the exporter, the real
in-process hf engine, and ``ckpteval serve`` (the sglang stand-in) over HTTP. The faulty engines are the
real :class:`HFEngine` with one deliberate bug each (a stale layer, a dropped tensor), the faults the
issue names; the relabel is done by another HTTP client on the real server.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file

from ckpteval.coord.digests import compare_digests, crc32_combine, safetensors_digests
from ckpteval.coord.discovery import SnapshotDiscovery, SnapshotRef
from ckpteval.coord.rundir import RunDir
from ckpteval.coord.snapshot import mark_complete, read_marker
from ckpteval.coord.units import WorkUnit
from ckpteval.jobs.eval.engines.hf import HFEngine
from ckpteval.jobs.eval.engines.http import HTTPEngine
from ckpteval.jobs.eval.evaluators import EngineEvaluator, evaluate_unit
from ckpteval.jobs.eval.scoring import DatasetCache
from ckpteval.jobs.reference.model import build_model
from ckpteval.jobs.trainer.export.hf_files import write_hf_files
from tests.support.workers import base_dir, make_eval_run, publish_model, start_serve, version


# -- the digests themselves ------------------------------------------------------------------------------
def test_crc32_combine_equals_the_crc_of_the_concatenation() -> None:
    a, b = bytes(range(256)) * 37, b"tensor bytes" * 1001
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert crc32_combine(zlib.crc32(a), 0, 0) == zlib.crc32(a)


def test_exporter_records_per_tensor_digests_that_a_reread_reproduces(tmp_path: Path) -> None:
    records = write_hf_files(tmp_path / "o", build_model(seed=1).state_dict(), base_dir(tmp_path))
    shard = tmp_path / "o" / "model.safetensors"
    info, tensors = safetensors_digests(shard)
    assert records["model.safetensors"]["crc32"] == zlib.crc32(shard.read_bytes()) == info["crc32"]
    assert records["model.safetensors"]["tensors"] == tensors
    on_disk = load_file(shard)
    assert set(tensors) == set(on_disk)
    name = sorted(on_disk)[0]
    raw = on_disk[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert tensors[name]["crc32"] == zlib.crc32(raw)
    assert tensors[name]["xxh3"] == xxhash.xxh3_64_intdigest(raw)  # the digest engines are attested with


def test_a_reused_checkpoint_is_marked_with_tensor_digests(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-7"
    write_hf_files(ckpt, build_model(seed=7).state_dict(), base_dir(tmp_path))
    marker = mark_complete(ckpt, 7)
    assert marker.tensors is not None and "model.embed_tokens.weight" in marker.tensors
    assert read_marker(ckpt).tensors == marker.tensors
    assert marker.files["model.safetensors"]["crc32"] == zlib.crc32((ckpt / "model.safetensors").read_bytes())


def test_compare_digests_names_missing_extra_and_different() -> None:
    expected = {"a": {"crc32": 1}, "b": {"crc32": 2}, "c": {"crc32": 3}}
    diffs = compare_digests(expected, {"a": 1, "b": 9, "d": 4, "tied": 1}, {"tied": "a"})
    assert diffs == ["missing 1: c", "extra 1: d", "different 1: b"]
    fast = {n: {"crc32": 0, "xxh3": d["crc32"]} for n, d in expected.items()}
    assert compare_digests(fast, {"a": 1, "b": 9, "d": 4, "tied": 1}, {"tied": "a"}, "xxh3") == diffs


# -- the worker's evaluator ------------------------------------------------------------------------------
class StaleLayerEngine(HFEngine):
    """A buggy engine: every load keeps layer 0's attention weights of the weights it held before."""

    def load(self, snapshot_dir: str, weight_version: str) -> None:
        old = None if self.model is None else {
            n: p.detach().clone() for n, p in self.model.named_parameters() if n.startswith("model.layers.0.self_attn")
        }
        super().load(snapshot_dir, weight_version)
        if old:
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, value in old.items():
                    params[name].copy_(value)


class DroppingEngine(HFEngine):
    """A buggy engine: after a load the final norm's weight is no longer one of the model's tensors."""

    def load(self, snapshot_dir: str, weight_version: str) -> None:
        super().load(snapshot_dir, weight_version)
        norm = self.model.model.norm
        if "weight" in norm._parameters:
            weight = norm._parameters.pop("weight").detach()
            object.__setattr__(norm, "weight", weight)  # still used by forward, gone from the state dict


def _run_with_steps(tmp_path: Path, steps: tuple[int, ...]) -> tuple[RunDir, dict[int, SnapshotRef]]:
    run = make_eval_run(tmp_path, n_prompts=4, shard_size=2, max_new_tokens=2)
    for step in steps:
        publish_model(tmp_path, run.snapshots, step)
    return run, {ref.step: ref for ref in SnapshotDiscovery(run.snapshots).poll()}


def _evaluate(engine: Any, run: RunDir, refs: dict[int, SnapshotRef], units: list[WorkUnit]) -> list[Any]:
    evaluator = EngineEvaluator(engine, DatasetCache(run, run.manifest()), pin_timeout_s=5.0, load_timeout_s=120.0)
    return [evaluate_unit(evaluator, unit, refs[unit.step], "fast") for unit in units]


def test_an_honest_hf_engine_is_attested_on_first_load_and_in_place_reload(tmp_path: Path) -> None:
    run, refs = _run_with_steps(tmp_path, (1, 2))
    engine = HFEngine()
    try:
        results = _evaluate(engine, run, refs, [WorkUnit(1, "addition", 0), WorkUnit(2, "addition", 0),
                                                 WorkUnit(2, "addition", 1)])
    finally:
        engine.close()
    for r in results:
        assert r.ok, r.message
        assert r.attest["attested"] is True and r.attest["how"] == "tensor_digests", r.attest
        assert "xxh3 digests" in r.attest["detail"]
    assert results[2].timings["attest_s"] == 0.0  # same load: the attestation is reused, not redone


def test_an_engine_keeping_a_stale_layer_under_the_new_label_fails_attestation(tmp_path: Path) -> None:
    run, refs = _run_with_steps(tmp_path, (1, 2))
    engine = StaleLayerEngine()
    try:
        first, second = _evaluate(engine, run, refs, [WorkUnit(1, "addition", 0), WorkUnit(2, "addition", 0)])
        assert engine.weight_version() == version(run, 2)  # the label says step 2 ...
    finally:
        engine.close()
    assert first.ok and first.attest["attested"] is True
    assert second.skip_reason == "attest_failed", second.message  # ... the weights do not
    assert "different" in second.message and "model.layers.0.self_attn" in second.message


def test_a_marker_written_before_xxh3_is_attested_by_crc32(tmp_path: Path) -> None:
    """A marker whose tensors carry CRC-32 only (written before XXH3): engines digest with CRC-32, an
    honest one passes and the stale-layer one still fails."""
    from bench.bench_attest import without_xxh3
    from ckpteval.jobs.eval.attest import AttestFailed, attest

    run, refs = _run_with_steps(tmp_path, (1, 2))
    legacy = without_xxh3(read_marker(refs[1].path))
    assert all("xxh3" not in d and "crc32" in d for d in legacy.tensors.values())
    honest, stale = HFEngine(), StaleLayerEngine()
    try:
        honest.load(str(refs[1].path), "1")
        assert "crc32 digests" in attest(honest, refs[1].path, legacy, run).detail
        stale.load(str(refs[2].path), "2")
        stale.load(str(refs[1].path), "1")
        with pytest.raises(AttestFailed, match="model.layers.0.self_attn"):
            attest(stale, refs[1].path, legacy, run)
    finally:
        honest.close()
        stale.close()


def test_an_engine_that_drops_a_tensor_fails_attestation(tmp_path: Path) -> None:
    run, refs = _run_with_steps(tmp_path, (1,))
    engine = DroppingEngine()
    try:
        (result,) = _evaluate(engine, run, refs, [WorkUnit(1, "addition", 0)])
    finally:
        engine.close()
    assert result.skip_reason == "attest_failed"
    assert "missing 1: model.norm.weight" in result.message


def test_a_snapshot_modified_after_its_marker_fails_attestation(tmp_path: Path) -> None:
    run, refs = _run_with_steps(tmp_path, (1,))
    shard = refs[1].path / "model.safetensors"
    tensors = load_file(shard)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"] * 1.01
    shard.unlink()
    save_file(tensors, shard, metadata={"format": "pt"})  # same names, shapes, size: passes --verify fast
    engine = HFEngine()
    try:
        (result,) = _evaluate(engine, run, refs, [WorkUnit(1, "addition", 0)])
    finally:
        engine.close()
    assert result.skip_reason == "attest_failed"
    assert "different 1: model.layers.0.mlp.up_proj.weight" in result.message


# -- sglang's consistency proof, against the stand-in's /weights_checker ------------------------------------
@pytest.fixture
def served(tmp_path: Path) -> Any:
    run, refs = _run_with_steps(tmp_path, (1, 2))
    url, proc = start_serve(refs[2].path, version(run, 2), tmp_path / "serve.log")
    try:
        yield run, refs, url
    finally:
        proc.kill()
        proc.wait()


def test_a_server_relabelled_by_another_client_fails_the_consistency_proof(served: Any) -> None:
    run, refs, url = served
    with HTTPEngine(url) as honest:  # launched on step 2 under step 2's label: the first checksum recorded
        (first,) = _evaluate(honest, run, refs, [WorkUnit(2, "addition", 0)])
    assert first.ok and first.attest["how"] == "consistency" and first.attest["attested"] is True
    assert "first checksum" in first.attest["detail"]
    assert len(list(run.weight_checksums.iterdir())) == 1
    # another client loads step 1 and relabels the server as step 2
    httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(refs[1].path), "weight_version": "x"},
               timeout=120).raise_for_status()
    httpx.post(f"{url}/update_weight_version", json={"new_version": version(run, 2)}, timeout=30).raise_for_status()
    with HTTPEngine(url) as fooled:
        assert fooled.weight_version() == version(run, 2)
        (relabelled, reloaded) = _evaluate(fooled, run, refs, [WorkUnit(2, "addition", 1), WorkUnit(2, "addition", 1)])
    assert relabelled.skip_reason == "attest_failed", relabelled.message
    assert "differs from the first one recorded" in relabelled.message
    # the next try reloads the snapshot (the failed version is distrusted) and reproduces the checksum
    assert reloaded.ok and reloaded.attest["attested"] is True and "reproduces" in reloaded.attest["detail"]


def test_the_stand_in_answers_weights_checker_as_sglang_does(served: Any) -> None:
    _, _, url = served
    body = httpx.post(f"{url}/weights_checker", json={"action": "checksum"}, timeout=30).json()
    assert body["success"] is True and isinstance(body["per_engine_checksum"], str)
    (rank,) = body["ranks"]
    assert rank["parallelism_info"][0]["role"] == "target" and rank["parallelism_info"][0]["tp_size"] == 1
    assert all(len(v) == 16 for v in rank["checksums"].values())
    assert not any("inv_freq" in n for n in rank["checksums"])
    bad = httpx.post(f"{url}/weights_checker", json={"action": "snapshot"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["success"] is False


# -- what a point cost (#19 §3) ---------------------------------------------------------------------------
def test_units_record_their_cost_and_the_point_and_status_sum_it(tmp_path: Path) -> None:
    from ckpteval.coord.points import derive_point, point_metrics
    from ckpteval.coord.results import write_result
    from ckpteval.jobs.views.status import collect_status, cost_line

    run, refs = _run_with_steps(tmp_path, (1,))
    engine = HFEngine()
    try:
        results = _evaluate(engine, run, refs, [WorkUnit(1, "addition", 0), WorkUnit(1, "addition", 1)])
    finally:
        engine.close()
    for r in results:
        assert r.ok, r.message
        assert r.cost["prompt_tokens"] > 0 and 0 < r.cost["generated_tokens"] <= 2 * 2  # 2 prompts x 2 tokens
        assert r.cost["gpus"] == 0 and r.cost["gpu_s"] == 0  # the hf engine on CPU holds no GPU
        assert r.cost["engine_s"] == r.timings["generate_s"] and r.cost["load_s"] == r.timings["load_s"]
        write_result(run.results, r)
    manifest = run.manifest()
    metrics = point_metrics(derive_point(manifest, 1, {r.unit: r for r in results}))
    assert metrics["eval/addition/attested"] == 1.0
    assert metrics["eval/cost/generated_tokens"] == sum(r.cost["generated_tokens"] for r in results)
    assert metrics["eval/cost/prompt_tokens"] == sum(r.cost["prompt_tokens"] for r in results)
    status = collect_status(run.path)
    (point,) = status["points"]
    assert point["cost"]["attest_s"] == sum(r.cost["attest_s"] for r in results)
    (rate,) = status["cost"]["tokens_per_s"].values()  # one engine (this process) wrote both units
    assert rate == pytest.approx(metrics["eval/cost/generated_tokens"] / metrics["eval/cost/engine_s"])
    assert status["cost"]["eval_gpu_hours"] == 0.0 and "GPU-h" in cost_line(status["cost"])
