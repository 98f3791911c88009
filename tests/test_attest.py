"""Attestation (#19): an engine proves which weights it holds; the label alone never passes a unit.

Real parts only: snapshots of the reference trainer's tiny model written by the exporter, the real
in-process hf engine, and ``ckpteval serve`` (the sglang stand-in) over HTTP. The faulty engines are the
real :class:`HFEngine` with one deliberate bug each (a stale layer, a dropped tensor), the faults the
issue names; the relabel is done by another HTTP client on the real server.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file

from ckpteval.coord.atomic import read_json_object
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.digests import compare_digests, crc32_combine, safetensors_digests
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery, SnapshotRef
from ckpteval.coord.snapshots.snapshot import mark_complete, read_marker
from ckpteval.coord.snapshots.weight_checksums import summarize
from ckpteval.coord.work.units import WorkUnit
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.eval.engines.http.engine import HTTPEngine
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
from ckpteval.jobs.eval.worker.evaluators import EngineEvaluator, evaluate_unit
from ckpteval.jobs.reference.model import build_model
from ckpteval.jobs.trainer.export.hf_files import write_hf_files
from ckpteval.jobs.views.status.main import collect_status, render
from tests.support.serve_fork import ServeForker
from tests.support.stale_serve import StaleLayerEngine
from tests.support.workers import base_dir, make_eval_run, publish_model, version


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


def _evaluate(engine: Any, run: RunDir, refs: dict[int, SnapshotRef], units: list[WorkUnit],
              canary_bound: float | None = None) -> list[Any]:
    evaluator = EngineEvaluator(engine, DatasetCache(run, run.manifest()), pin_timeout_s=5.0, load_timeout_s=120.0,
                                canary_max_diff=canary_bound)
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


@pytest.mark.parametrize("older, says", [
    ("no_xxh3", r"marker field files\['model.safetensors'\] has tensor digests without xxh3, an older format \(written before XXH3\)"),
    ("protocol_1", r"marker protocol 1: this ckpteval reads only protocol 2 markers"),
])
def test_a_marker_of_an_older_format_is_refused_naming_the_file(tmp_path: Path, older: str, says: str) -> None:
    """A marker written before XXH3 (tensors with CRC-32 only) or of another protocol is not read: one
    line naming the marker file and what it has (no attestation falls back to a weaker digest)."""
    ckpt = tmp_path / "checkpoint-7"
    write_hf_files(ckpt, build_model(seed=7).state_dict(), base_dir(tmp_path))
    mark_complete(ckpt, 7)
    obj = read_json_object(ckpt / ".complete")
    if older == "no_xxh3":
        for d in obj["files"]["model.safetensors"]["tensors"].values():
            del d["xxh3"]
    else:
        obj["protocol"] = 1
    (ckpt / ".complete").write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=f"^{ckpt / '.complete'}: {says}"):
        read_marker(ckpt)


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


# -- sglang's consistency proof, against the stand-in's /weights_checker (#26 §3) ---------------------------
@pytest.fixture(scope="module")
def forker() -> Any:
    """One zygote for the module's many launches (tests.support.serve_fork): each launch is still its own
    ``ckpteval serve`` process loading its model itself, without ~5-15 s of interpreter start and imports."""
    zygote = ServeForker()
    try:
        yield zygote
    finally:
        zygote.close()


class Servers:
    """Real ``ckpteval serve`` processes for one test (honest, or with the stale-layer engine); all killed after."""

    def __init__(self, tmp_path: Path, forker: ServeForker) -> None:
        self.tmp, self.forker, self.procs = tmp_path, forker, []

    def start(self, snapshot: Path, label: str, stale: bool = False) -> str:
        return self.launch(["--model", str(snapshot), "--weight-version", label], stale)

    def launch(self, args: list[str], stale: bool = False) -> str:
        """``ckpteval serve ARGS`` (``tests.support.stale_serve serve ARGS`` when ``stale``); its URL."""
        module = "tests.support.stale_serve" if stale else "ckpteval.jobs.cli"
        url, proc = self.forker.start(args, self.tmp / f"serve{len(self.procs)}.log", module=module)
        self.procs.append(proc)
        return url

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


@pytest.fixture
def servers(tmp_path: Path, forker: ServeForker) -> Any:
    run, refs = _run_with_steps(tmp_path, (1, 2))
    box = Servers(tmp_path, forker)
    try:
        yield run, refs, box
    finally:
        box.close()


def _unit(url: str, run: RunDir, refs: dict[int, SnapshotRef], shard: int = 0) -> Any:
    """One unit of step 2 evaluated by a fresh worker-side evaluator over the server at ``url``."""
    with HTTPEngine(url) as engine:
        (result,) = _evaluate(engine, run, refs, [WorkUnit(2, "addition", shard)])
    return result


def _records(run: RunDir) -> tuple[list[Path], list[Path]]:
    """(observation files, standing reference files) under RUN/weight_checksums/."""
    files = sorted(run.weight_checksums.rglob("*.json")) if run.weight_checksums.is_dir() else []
    return [f for f in files if f.name.startswith("obs.")], [f for f in files if f.name == "reference.json"]


def _relabel(url: str, snapshot: Path, label: str) -> None:
    """Another client loads ``snapshot`` and relabels the server ``label`` (sglang's two admin routes)."""
    httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(snapshot), "weight_version": "x"},
               timeout=120).raise_for_status()
    httpx.post(f"{url}/update_weight_version", json={"new_version": label}, timeout=30).raise_for_status()


def _adopted(url: str, run: RunDir, refs: dict[int, SnapshotRef]) -> Any:
    """Attest the server at ``url`` for step 2 as an engine found holding it (not loaded by the caller)."""
    from ckpteval.jobs.eval.proof.attest import attest, settle

    with HTTPEngine(url) as engine:
        return settle(attest(engine, refs[2].path, read_marker(refs[2].path), run, loaded=False))


@pytest.mark.parametrize("order", ["relabelled_first", "honest_first"])
def test_a_relabelled_server_is_never_the_reference(servers: Any, order: str) -> None:
    """A server holding step 1 relabelled as step 2 by another client: the worker reloads it (it never adopts a
    label it did not load), an attestation of it as found is compared and never recorded, and the checksum of
    step 2 stands only once two independent servers reproduced it. The old code adopted the relabelled server,
    recorded its step-1 checksum as step 2's reference and failed every honest load after it."""
    from ckpteval.jobs.eval.proof.attest import AttestFailed

    run, refs, box = servers
    fooled = box.start(refs[1].path, "x")
    _relabel(fooled, refs[1].path, version(run, 2))
    if order == "relabelled_first":
        first = _unit(fooled, run, refs)  # the worker loads step 2 itself before scoring: nothing to compare yet
        assert first.ok and first.attest["attested"] is False and first.attest["state"] == "reference", first.attest
        assert httpx.get(f"{fooled}/model_info", timeout=30).json()["model_path"] == str(refs[2].path)
        _relabel(fooled, refs[1].path, version(run, 2))
        found = _adopted(fooled, run, refs)  # found holding it: compared with what stands (nothing), not recorded
        assert found.attested is False and found.state == "unverified" and found.by["loaded"] == "adopted"
        assert len(_records(run)[0]) == 1
        honest = box.start(refs[2].path, version(run, 2))
    else:
        honest = box.start(refs[2].path, version(run, 2))
        first = _unit(honest, run, refs)
        assert first.ok and first.attest["attested"] is False and first.attest["state"] == "reference", first.attest
        with pytest.raises(AttestFailed, match="did not load step 2 itself"):
            _adopted(fooled, run, refs)  # step 1's weights under step 2's label: matches no load of step 2
        assert len(_records(run)[0]) == 1  # ... and is not recorded
    assert first.attest["by"]["loaded"] == "self" and "nothing to compare" in first.attest["detail"]
    second = _unit(fooled if order == "honest_first" else honest, run, refs, shard=1)
    assert second.ok and second.attest["attested"] is True and "reproduces" in second.attest["detail"], second.message
    observations, standing = _records(run)
    assert len(observations) == 2 and len(standing) == 1
    assert len(read_json_object(standing[0])["instances"]) == 2
    if order == "honest_first":
        _relabel(fooled, refs[1].path, version(run, 2))
        with pytest.raises(AttestFailed, match="differs from the one that stands"):
            _adopted(fooled, run, refs)


def test_two_loads_of_one_snapshot_on_one_server_are_one_witness(servers: Any) -> None:
    """An in-place reload on the same launch is not an independent load: two evaluators loading step 2 into one
    server leave one observation and no reference (the old code recorded the second as a reproduction); a
    second server's load makes it stand."""
    run, refs, box = servers
    url = box.start(refs[1].path, version(run, 1))
    first, again = _unit(url, run, refs), _unit(url, run, refs, shard=1)
    for r in (first, again):
        assert r.ok and r.attest["attested"] is False and r.attest["state"] == "reference", r.attest
    assert r.attest["by"]["instance"].startswith(url + "@")
    assert [len(x) for x in _records(run)] == [1, 0]
    other = _unit(box.start(refs[2].path, version(run, 2)), run, refs)
    assert other.ok and other.attest["attested"] is True and "reproduces" in other.attest["detail"], other.message
    assert [len(x) for x in _records(run)] == [2, 1]


@pytest.mark.parametrize("order", ["stale_first", "honest_first"])
def test_a_stale_layer_server_cannot_make_its_checksum_the_truth(servers: Any, order: str) -> None:
    """A server whose every in-place load keeps layer 0's attention of the weights it held before (launched on
    step 1, then loading step 2). First or second, its checksum never stands: against an honest load it is a
    dispute (the unit left for another load, not scored and not ``attest_failed``); a further independent
    honest load reproduces the honest checksum, which then stands, and the stale server fails against it. The
    old code made the first loader's checksum the reference: stale first, every honest load failed."""
    run, refs, box = servers
    stale = box.start(refs[1].path, version(run, 1), stale=True)
    honest = box.start(refs[2].path, version(run, 2))
    if order == "stale_first":
        first = _unit(stale, run, refs)
        assert first.ok and first.attest["attested"] is False and first.attest["state"] == "reference"
        disputed = _unit(honest, run, refs, shard=1)
    else:
        first = _unit(honest, run, refs)
        assert first.ok and first.attest["attested"] is False and first.attest["state"] == "reference"
        disputed = _unit(stale, run, refs, shard=1)
    assert disputed.skip_reason == "attest_disputed" and "none stands yet" in disputed.message, disputed.message
    assert [len(x) for x in _records(run)] == [2, 0]  # both recorded, neither stands
    assert summarize(run.weight_checksums) == {"stands": 0, "reference_only": 0, "disputed": 1}
    third = _unit(box.start(refs[2].path, version(run, 2)), run, refs, shard=1)  # another independent load
    assert third.ok and third.attest["attested"] is True and "reproduces" in third.attest["detail"], third.message
    again = _unit(honest, run, refs, shard=1)
    assert again.ok and again.attest["attested"] is True and "stands" in again.attest["detail"]
    rejected = _unit(stale, run, refs, shard=1)
    assert rejected.skip_reason == "attest_failed" and "differs from the one that stands" in rejected.message
    status = collect_status(run.path)
    assert status["attestation"] == {"stands": 1, "reference_only": 0, "disputed": 0}
    assert "weight checksums: 1 compared" in "\n".join(str(x) for x in render(status))


def test_units_a_stale_first_loader_scored_are_re_derived_once_the_honest_checksum_stands(
        tmp_path: Path, forker: ServeForker) -> None:
    """The stale-layer server is the first to load step 2: a worker scores both units on it (unverified,
    ``reference``). An honest load is disputed, a second honest load reproduces it and the honest checksum
    stands: both units the stale checksum scored are superseded (``attest_overturned``, generation 1) and a
    worker re-runs them (generation 2, compared), so the point holds no stale score. The old code left the
    stale units standing in the point."""
    from ckpteval.coord.results.files import ResultIndex
    from ckpteval.coord.results.points import derive_point, point_metrics
    from ckpteval.jobs.eval.worker.options import WorkerOptions
    from tests.support.workers import run_inprocess

    run = make_eval_run(tmp_path, n_prompts=4, shard_size=2, max_new_tokens=2)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    older = publish_model(tmp_path, elsewhere, 1)  # what the stale server held before: not one of the run's
    publish_model(tmp_path, run.snapshots, 2)
    refs = {ref.step: ref for ref in SnapshotDiscovery(run.snapshots).poll()}
    box = Servers(tmp_path, forker)
    quiet = {"out": lambda _line: None}

    def work(url: str) -> dict[WorkUnit, Any]:
        opts = WorkerOptions(run_dir=run.path, engines=(f"http:{url}",), once=True, poll_interval_s=0.05)
        assert run_inprocess(opts, **quiet)[0] == 0
        index = ResultIndex(run.results)
        return {u: (r, index.generation(u)) for u, r in index.refresh().items()}

    try:
        stale = box.start(older, "x", stale=True)
        first = work(stale)
        assert len(first) == 2 and all(r.ok and r.attest["state"] == "reference" for r, _ in first.values())
        disputed = _unit(box.start(refs[2].path, version(run, 2)), run, refs, shard=1)
        assert disputed.skip_reason == "attest_disputed", disputed.message
        honest = box.start(refs[2].path, version(run, 2))
        assert _unit(honest, run, refs, shard=1).attest["attested"] is True  # it stands now
        index = ResultIndex(run.results)
        now = index.refresh()
        assert sorted((r.skip_reason, index.generation(u)) for u, r in now.items()) == [("attest_overturned", 1)] * 2
        assert "which lost" in next(iter(now.values())).message
        again = work(honest)
    finally:
        box.close()
    assert all(r.ok and r.attest["state"] == "compared" and g == 2 for r, g in again.values()), again
    metrics = point_metrics(derive_point(run.manifest(), 2, {u: r for u, (r, _) in again.items()}))
    assert metrics["eval/addition/attested"] == 1.0


def test_a_pool_of_two_servers_is_two_independent_loads(servers: Any) -> None:
    """``--engine http:A+http:B``: the worker loads step 2 into both servers; each member's observation
    witnesses the other's, so the first unit is already compared and the checksum stands."""
    from ckpteval.jobs.eval.engines.factory import EnginePool

    run, refs, box = servers
    urls = [box.start(refs[1].path, version(run, 1)) for _ in range(2)]
    pool = EnginePool([HTTPEngine(u) for u in urls])
    try:
        (result,) = _evaluate(pool, run, refs, [WorkUnit(2, "addition", 0)])
    finally:
        pool.close()
    assert result.ok and result.attest["attested"] is True and "2 engines: reproduces" in result.attest["detail"]
    assert [len(x) for x in _records(run)] == [2, 1]


def test_a_disputed_checksum_on_a_launched_server_is_re_derived_by_a_relaunch(servers: Any) -> None:
    """A server the worker launched (it can restart it) whose checksum disputes an honest load is relaunched
    within the unit: the fresh launch is an independent load, its checksum reproduces the honest one, which
    then stands, and the unit scores ``compared`` (the stale server loads correctly when launched fresh)."""
    run, refs, box = servers
    assert _unit(box.start(refs[2].path, version(run, 2)), run, refs).attest["state"] == "reference"
    url = box.start(refs[1].path, version(run, 1), stale=True)
    port = url.rsplit(":", 1)[1]

    def relaunch() -> None:  # what SGLangEngine.restart does: a new server process on the same port
        box.procs[-1].kill()
        box.procs[-1].wait()
        box.launch(["--model", str(refs[2].path), "--weight-version", version(run, 2), "--port", port], stale=True)

    with HTTPEngine(url, launcher=relaunch) as engine:
        engine.launch_timeout_s = 60.0  # type: ignore[attr-defined]  # a launched server (base.LaunchesServer)
        engine.launch_pending = False  # type: ignore[attr-defined]
        (result,) = _evaluate(engine, run, refs, [WorkUnit(2, "addition", 1)])
    assert result.ok and result.attest["attested"] is True and "reproduces" in result.attest["detail"], result.message
    observations, standing = _records(run)
    assert len(observations) == 3 and len(standing) == 1  # honest, the stale launch, the fresh launch


def test_a_unit_whose_canary_fails_records_no_checksum(tmp_path: Path, forker: ServeForker) -> None:
    """The stale-layer server's canary catches it (the snapshot carries the trainer's probe log-probs): under
    an explicit bound the unit is ``canary_failed``, under sglang's unmeasured default it is scored but
    flagged; either way its checksum is not recorded, so it can never become a reference."""
    from tests.test_canary import _export

    run = make_eval_run(tmp_path, n_prompts=4, shard_size=4, max_new_tokens=2)
    other, path = _export(tmp_path, run, 2), _export(tmp_path, run, 1)
    refs = {ref.step: ref for ref in SnapshotDiscovery(run.snapshots).poll()}
    box = Servers(tmp_path, forker)
    try:
        url = box.start(other, version(run, 2), stale=True)
        with HTTPEngine(url) as engine:
            (flagged,) = _evaluate(engine, run, refs, [WorkUnit(1, "addition", 0)])
        with HTTPEngine(url) as engine:
            (result,) = _evaluate(engine, run, refs, [WorkUnit(1, "addition", 0)], canary_bound=0.05)
    finally:
        box.close()
    assert refs[1].path == path
    assert flagged.ok and flagged.fidelity["flagged"] == 1.0, flagged.message
    assert result.skip_reason == "canary_failed", result.message
    assert not run.weight_checksums.is_dir() or not any(run.weight_checksums.rglob("*.json"))  # nothing recorded


def test_checksum_layout_reads_both_sglang_shapes_of_parallelism_info() -> None:
    """sglang 0.5.19 sends one ``parallelism_info`` object per rank (``srt/managers/io_struct.py``
    ``ChecksumInfo``), 0.5.23 a list of one per role: both give the same parallel part of the key; the key
    also names dtype, quantization, version and the device the hash runs on (the old code read 0.5.19's
    object as no information: ``tp?-dp?-pp?``)."""
    from ckpteval.jobs.eval.engines.http.server_info import checksum_layout

    placement = {"tp_rank": 0, "tp_size": 2, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
                 "rank": 0, "size": 2}
    old = [{"checksums": {}, "per_gpu_checksum": "a", "parallelism_info": dict(placement, tp_rank=r)} for r in (0, 1)]
    new = [{"checksums": {}, "per_gpu_checksum": "a", "parallelism_info": [dict(placement, tp_rank=r, role="target")]}
           for r in (0, 1)]
    info = {"dtype": "bfloat16", "quantization": "fp8", "version": "0.5.19", "device": "cuda"}
    assert checksum_layout(old, info) == "tp2-dp1-pp1-ranks2-rolestarget-bfloat16-qfp8-sglang0.5.19-oncuda"
    assert checksum_layout(new, {**info, "version": "0.5.23"}).startswith("tp2-dp1-pp1-ranks2-rolestarget-bfloat16")
    draft = [{"parallelism_info": [dict(placement, role="target"), dict(placement, role="draft")]}]
    assert checksum_layout(draft).startswith("tp2-dp1-pp1-ranks1-rolesdraft+target-?-qnone-sglang?-on?")


def test_the_stand_in_answers_weights_checker_as_sglang_does(tmp_path: Path, forker: ServeForker) -> None:
    run, refs = _run_with_steps(tmp_path, (2,))
    box = Servers(tmp_path, forker)
    try:
        url = box.start(refs[2].path, version(run, 2))
        body = httpx.post(f"{url}/weights_checker", json={"action": "checksum"}, timeout=30).json()
        info = httpx.get(f"{url}/server_info", timeout=30).json()
        bad = httpx.post(f"{url}/weights_checker", json={"action": "snapshot"}, timeout=30)
    finally:
        box.close()
    assert body["success"] is True and isinstance(body["per_engine_checksum"], str)
    (rank,) = body["ranks"]
    assert rank["parallelism_info"][0]["role"] == "target" and rank["parallelism_info"][0]["tp_size"] == 1
    assert all(len(v) == 16 for v in rank["checksums"].values())
    assert not any("inv_freq" in n for n in rank["checksums"])
    assert bad.status_code == 400 and bad.json()["success"] is False
    assert (info.get("dtype"), info.get("device")) == ("float32", "cpu") and isinstance(info.get("startup_time"), float)


# -- what a point cost (#19 §3) ---------------------------------------------------------------------------
def test_units_record_their_cost_and_the_point_and_status_sum_it(tmp_path: Path) -> None:
    from ckpteval.coord.results.files import write_result
    from ckpteval.coord.results.points import derive_point, point_metrics
    from ckpteval.jobs.views.status.main import collect_status, cost_line

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
