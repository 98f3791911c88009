"""HFEngine on real tiny models: loading, in-place reload, version pinning, batching, sampling, health."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from ckpteval.jobs.eval.engines.base import Engine, EngineError, SamplingParams
from ckpteval.jobs.eval.engines.hf.engine import HFEngine
from ckpteval.jobs.reference.model import make_addition_examples

SnapshotFactory = Callable[..., Path]

GREEDY = SamplingParams(max_new_tokens=6)
# Different lengths, so left padding is exercised; the empty prompt is just <bos>.
PROMPTS = [ex["prompt"] for ex in make_addition_examples(12, seed=0)] + ["1", "2+", "", "99+99=1"]
PROBE = torch.tensor([[1, 4, 5, 14, 6, 15]])


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(PROBE).logits


def _reference_logits(snapshot: Path) -> torch.Tensor:
    return _logits(
        AutoModelForCausalLM.from_pretrained(snapshot, use_safetensors=True, local_files_only=True)
    )


@pytest.fixture
def engine() -> Iterator[HFEngine]:
    e = HFEngine()
    yield e
    e.close()


def test_hf_engine_implements_the_engine_protocol() -> None:
    assert isinstance(HFEngine(), Engine)


def test_optional_engine_capabilities_are_declared_protocols_a_pool_answers_through_its_members() -> None:
    """The capabilities only some engines have (issue 27) are runtime-checkable protocols in engines/base.py:
    the in-process engine digests its weights, teacher-forces and reports its dtype and GPUs, launches no
    server and reads the run's tokenizer; an HTTP client checksums, teacher-forces, names its server and canary
    kind and serves lm-eval; a pool of two answers GPUs and launch time as the sum of its members'."""
    from ckpteval.jobs.eval.engines.base import (
        ChecksumsWeights,
        DigestsWeights,
        LaunchesServer,
        NamesCanaryKind,
        OccupiesGPUs,
        Pooled,
        ReadsRunTokenizer,
        ReportsComputeDtype,
        ServesHTTP,
        ServesLmEval,
        TeacherForced,
        engine_gpus,
        launch_timeout,
        members,
    )
    from ckpteval.jobs.eval.engines.factory import EnginePool
    from ckpteval.jobs.eval.engines.http.engine import HTTPEngine

    hf = HFEngine(device="cpu")
    assert all(isinstance(hf, cap) for cap in (DigestsWeights, TeacherForced, ReportsComputeDtype, OccupiesGPUs,
                                               ReadsRunTokenizer))
    assert not isinstance(hf, (LaunchesServer, ChecksumsWeights, Pooled, NamesCanaryKind, ServesHTTP, ServesLmEval))
    assert members(hf) == [hf]
    client = HTTPEngine("http://127.0.0.1:9")  # a client of sglang's API: nothing is contacted until a call
    try:
        assert all(isinstance(client, cap) for cap in (ChecksumsWeights, TeacherForced, NamesCanaryKind, ServesHTTP,
                                                       ServesLmEval, OccupiesGPUs))
        assert not isinstance(client, (DigestsWeights, ReadsRunTokenizer, Pooled, LaunchesServer))
    finally:
        client.close()
    assert engine_gpus(hf) == 0 and launch_timeout(hf) == 0.0  # on CPU: no GPU held, nothing to launch

    class OnTwoGPUs(HFEngine):
        gpus = 2  # type: ignore[assignment]

    pool = EnginePool([OnTwoGPUs(device="cpu"), OnTwoGPUs(device="cpu")])
    assert isinstance(pool, Pooled) and engine_gpus(pool) == 4 and members(pool) == pool.engines


def test_first_load_builds_model_and_stamps_every_generation(engine: HFEngine, tiny_snapshot: Path) -> None:
    assert engine.weight_version() is None
    engine.load(str(tiny_snapshot), "0")
    gens = engine.generate(PROMPTS, GREEDY)
    assert engine.weight_version() == "0"
    assert len(gens) == len(PROMPTS)
    assert {g.weight_version for g in gens} == {"0"}
    assert all(1 <= g.n_tokens <= GREEDY.max_new_tokens for g in gens)
    assert torch.allclose(_logits(engine.model), _reference_logits(tiny_snapshot))


def test_in_place_reload_changes_outputs_and_version_without_reinstantiation(
    engine: HFEngine, snapshot_factory: SnapshotFactory
) -> None:
    first, second = snapshot_factory(seed=0), snapshot_factory(seed=1)
    engine.load(str(first), "100")
    model, before = engine.model, engine.generate(PROMPTS, GREEDY)
    engine.load(str(second), "200")
    after = engine.generate(PROMPTS, GREEDY)
    assert engine.model is model  # same object: weights were copied in, not rebuilt
    assert engine.weight_version() == "200"
    assert {g.weight_version for g in after} == {"200"}
    assert [g.text for g in after] != [g.text for g in before]
    # Tied lm_head (absent from the file) follows the embeddings: logits equal a fresh load.
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.allclose(_logits(model), _reference_logits(second))


def test_sharded_snapshot_reloads_in_place(engine: HFEngine, snapshot_factory: SnapshotFactory) -> None:
    sharded = snapshot_factory(seed=2, max_shard_size="300KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    engine.load(str(snapshot_factory(seed=0)), "1")
    model = engine.model
    engine.load(str(sharded), "2")
    assert engine.model is model and engine.weight_version() == "2"
    assert torch.allclose(_logits(model), _reference_logits(sharded))


def test_architecture_change_builds_a_new_model(engine: HFEngine, snapshot_factory: SnapshotFactory) -> None:
    engine.load(str(snapshot_factory(seed=0, arch="llama")), "1")
    llama = engine.model
    engine.load(str(snapshot_factory(seed=0, arch="qwen2")), "2")
    assert engine.model is not llama
    assert engine.model.config.model_type == "qwen2" and engine.weight_version() == "2"
    assert {g.weight_version for g in engine.generate(PROMPTS[:3], GREEDY)} == {"2"}


def test_batched_greedy_equals_one_prompt_at_a_time(engine: HFEngine, tiny_snapshot: Path) -> None:
    engine.load(str(tiny_snapshot), "0")
    batched = engine.generate(PROMPTS, GREEDY)
    single = [engine.generate([p], GREEDY)[0] for p in PROMPTS]
    assert batched == single
    chunked = HFEngine(max_batch_size=5)
    chunked.load(str(tiny_snapshot), "0")
    assert chunked.generate(PROMPTS, GREEDY) == batched


def test_sampling_with_a_seed_is_reproducible_and_leaves_global_rng_alone(
    engine: HFEngine, tiny_snapshot: Path
) -> None:
    engine.load(str(tiny_snapshot), "0")
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.95, top_k=10, seed=123)
    rng_state = torch.random.get_rng_state()
    a = engine.generate(PROMPTS, sampled)
    b = engine.generate(PROMPTS, sampled)
    c = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, seed=124))
    assert a == b
    assert [g.text for g in a] != [g.text for g in c]
    assert torch.equal(torch.random.get_rng_state(), rng_state)


def test_a_bad_snapshot_keeps_the_old_weights_and_version(
    engine: HFEngine, tiny_snapshot: Path, tmp_path: Path
) -> None:
    engine.load(str(tiny_snapshot), "1")
    before = engine.generate(PROMPTS, GREEDY)
    # Same config, one tensor missing from the safetensors file.
    partial = tmp_path / "partial"
    shutil.copytree(tiny_snapshot, partial)
    state = load_file(partial / "model.safetensors")
    state.pop("model.norm.weight")
    save_file(state, partial / "model.safetensors", metadata={"format": "pt"})
    # Pickled weights only: refused without being opened.
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tiny_snapshot / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    for bad, match in [(partial, "missing"), (pickled, "pickled"), (tmp_path / "absent", "config.json")]:
        with pytest.raises(EngineError, match=match):
            engine.load(str(bad), "2")
        assert engine.weight_version() == "1"
    assert engine.generate(PROMPTS, GREEDY) == before


def test_generate_before_load_raises_and_bad_sampling_is_a_value_error(
    engine: HFEngine, tiny_snapshot: Path
) -> None:
    with pytest.raises(EngineError, match="no model loaded"):
        engine.generate(["1+1="], GREEDY)
    engine.load(str(tiny_snapshot), "0")
    for bad in [
        SamplingParams(max_new_tokens=0),
        SamplingParams(temperature=-1.0),
        SamplingParams(top_p=0.0),
    ]:
        with pytest.raises(ValueError):
            engine.generate(["1+1="], bad)
    with pytest.raises(ValueError, match="token ids"):
        engine.generate_ids([[999]], GREEDY)


def test_health_restart_and_close(engine: HFEngine, tiny_snapshot: Path, tmp_path: Path) -> None:
    assert engine.healthy() is False  # nothing loaded
    engine.restart()  # nothing to rebuild yet: a no-op
    assert engine.model is None and engine.weight_version() is None
    snapshot = tmp_path / "snap"
    shutil.copytree(tiny_snapshot, snapshot)
    engine.load(str(snapshot), "5")
    before = engine.generate(PROMPTS, GREEDY)
    assert engine.healthy() is True

    engine.restart()  # snapshot still there: rebuilt with the same weights and version
    assert engine.healthy() and engine.weight_version() == "5"
    assert engine.generate(PROMPTS, GREEDY) == before

    shutil.rmtree(snapshot)
    engine.restart()  # snapshot gone: fresh weights, honest version None, still serving
    assert engine.healthy() and engine.weight_version() is None
    engine.load(str(tiny_snapshot), "6")
    assert engine.generate(PROMPTS, GREEDY) == [replace(g, weight_version="6") for g in before]

    engine.close()
    engine.close()  # idempotent
    assert engine.healthy() is False and engine.weight_version() is None
    with pytest.raises(EngineError):
        engine.generate(["1"], GREEDY)


def test_engines_built_concurrently_in_threads_get_their_own_weights(
    snapshot_factory: SnapshotFactory,
) -> None:
    # transformers builds models under process-global contexts; a pool builds its engines in threads.
    snapshots = [snapshot_factory(seed=0), snapshot_factory(seed=1)]
    references = [_reference_logits(s) for s in snapshots]
    for _ in range(3):
        engines, errors = [HFEngine(), HFEngine()], []

        def build(i: int, engines: list[HFEngine] = engines, errors: list[Exception] = errors) -> None:
            try:
                engines[i].load(str(snapshots[i]), str(i))
            except (EngineError, RuntimeError, NotImplementedError) as e:
                errors.append(e)

        threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        for engine, reference in zip(engines, references, strict=True):
            assert torch.allclose(_logits(engine.model), reference)
