"""LoRA runs end to end on CPU with the real tiny model and real peft: adapter export (our safetensors
writer + marker), verification and discovery of adapter snapshots, the hf engine's resident base with the
adapter swapped per snapshot (checked against peft's own ``merge_and_unload``), run.json's
``eval.base_model``, and the reference trainer ``--lora`` with a real worker fleet, every point pinned."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from ckpteval.coord.run.manifest import load_manifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
from ckpteval.coord.snapshots.snapshot import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MARKER,
    SnapshotCorrupt,
    read_marker,
    verify_snapshot,
)
from ckpteval.jobs.eval.engines.base import EngineError, SamplingParams
from ckpteval.jobs.eval.engines.hf.lora import HFLoRAEngine
from ckpteval.jobs.reference.model import build_model, build_tokenizer, save_base_model_dir
from ckpteval.jobs.trainer.export.async_export import AsyncExporter
from tests.support.training import eval_lines
from tests.support.workers import finish, kill_all, spawn

PROMPTS = ["07+35=", "99+01=", "12+34="]
TARGETS = ["q_proj", "v_proj", "down_proj"]


def _base(tmp: Path) -> tuple[Path, torch.nn.Module]:
    model = build_model(seed=3)
    return save_base_model_dir(tmp / "base", model=model), model


def _peft(model: torch.nn.Module, rank: int = 4, seed: int = 0) -> PeftModel:
    """``model`` with a LoRA adapter whose B matrices are non-zero (a fresh adapter is a no-op)."""
    pm = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return pm


def _export(root: Path, step: int, pm: PeftModel) -> Path:
    exporter = AsyncExporter(root, None)
    exporter.submit(step, pm)
    exporter.wait()
    (outcome,) = exporter.poll()
    assert outcome.ok, outcome.error
    return outcome.path


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = build_tokenizer()(PROMPTS)["input_ids"]
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits


def test_adapter_export_is_peft_loadable_and_verifies(tmp_path: Path) -> None:
    base_dir, model = _base(tmp_path)
    pm = _peft(model)
    snap = _export(tmp_path / "snaps", 5, pm)
    assert sorted(p.name for p in snap.iterdir()) == sorted([MARKER, ADAPTER_CONFIG, ADAPTER_WEIGHTS])
    marker = verify_snapshot(snap, "full")
    assert marker.step == 5 and set(marker.files) == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    config = json.loads((snap / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and sorted(config["target_modules"]) == sorted(TARGETS)
    # peft itself reads our files back to the very same tensors
    reloaded = PeftModel.from_pretrained(build_model(seed=3), snap)
    ours = {k: v for k, v in reloaded.state_dict().items() if "lora_" in k}
    theirs = {k: v for k, v in pm.state_dict().items() if "lora_" in k}
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # the marker must list the config of an adapter snapshot
    broken = read_marker(snap).to_json()
    del broken["files"][ADAPTER_CONFIG]
    (snap / MARKER).write_text(json.dumps(broken))
    with pytest.raises(SnapshotCorrupt, match="adapter snapshot without adapter_config.json"):
        verify_snapshot(snap)
    assert base_dir.is_dir()


def test_hf_engine_base_plus_adapter_matches_the_merged_model(tmp_path: Path) -> None:
    """The independent check: peft's merge_and_unload of the same snapshot gives the engine's logits."""
    base_dir, model = _base(tmp_path)
    snap = _export(tmp_path / "snaps", 7, _peft(model))
    engine = HFLoRAEngine(str(base_dir))
    engine.load(str(snap), "7")
    assert engine.weight_version() == "7"
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True), snap
    ).merge_and_unload()
    bare = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
    got, want = _logits(engine.model), _logits(merged)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert not torch.allclose(got, _logits(bare), atol=1e-3)  # the adapter changes the answers
    gens = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4))
    assert [g.weight_version for g in gens] == ["7"] * 3


def test_hf_engine_swaps_the_adapter_without_reloading_the_base(tmp_path: Path) -> None:
    base_dir, model = _base(tmp_path)
    first = _export(tmp_path / "snaps", 1, _peft(model, seed=1))
    second = _export(tmp_path / "snaps", 2, _peft(build_model(seed=3), seed=2))
    engine = HFLoRAEngine(str(base_dir))
    engine.load(str(first), "1")
    resident, embed = engine.model, engine.model.model.embed_tokens.weight
    before = _logits(resident)
    engine.load(str(second), "2")
    assert engine.model is resident and engine.model.model.embed_tokens.weight is embed  # base untouched
    assert engine.weight_version() == "2"
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True), second
    ).merge_and_unload()
    assert torch.allclose(_logits(resident), _logits(merged), atol=1e-5)
    assert not torch.allclose(_logits(resident), before, atol=1e-3)

    # an adapter file missing a tensor: refused before anything is touched, old adapter and version stay
    bad = tmp_path / "bad"
    shutil.copytree(second, bad)
    tensors = load_file(bad / ADAPTER_WEIGHTS)
    tensors.pop(sorted(tensors)[0])
    save_file(tensors, bad / ADAPTER_WEIGHTS)
    with pytest.raises(EngineError, match="missing="):
        engine.load(str(bad), "3")
    assert engine.weight_version() == "2" and torch.allclose(_logits(resident), _logits(merged), atol=1e-5)

    # another rank: the adapter layers are rebuilt (base read again), the result still matches peft's
    third = _export(tmp_path / "snaps", 4, _peft(build_model(seed=3), rank=8, seed=4))
    engine.load(str(third), "4")
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True), third
    ).merge_and_unload()
    assert engine.weight_version() == "4" and torch.allclose(_logits(engine.model), _logits(merged), atol=1e-5)

    # a full-model snapshot in a LoRA run is refused with a clear message
    with pytest.raises(EngineError, match="not a LoRA adapter snapshot"):
        engine.load(str(base_dir), "5")


def test_foreign_adapter_checkpoint_is_admitted(tmp_path: Path) -> None:
    """An HF Trainer + peft ``checkpoint-N/`` (adapter files, no model weights) is a complete checkpoint."""
    _, model = _base(tmp_path)
    ckpt = tmp_path / "hf" / "checkpoint-30"
    _peft(model).save_pretrained(ckpt)
    clock = [0.0]
    disc = SnapshotDiscovery(tmp_path / "hf", admit_foreign=True, quiescence_s=1.0,
                             adoption_dir=tmp_path / "adopted", clock=lambda: clock[0])
    assert disc.poll() == []
    clock[0] = 5.0
    (ref,) = disc.poll()
    assert ref.step == 30 and verify_snapshot(ref.path, "full", marker=ref.marker).step == 30


def test_base_model_must_be_absolute(tmp_path: Path) -> None:
    from tests.support.workers import make_eval_run

    run = make_eval_run(tmp_path, n_prompts=2, shard_size=2)
    obj = json.loads(run.manifest_path.read_text())
    obj["eval"]["base_model"] = "relative/base"
    run.manifest_path.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match="eval.base_model must be an absolute path"):
        load_manifest(run.manifest_path)


def test_missing_base_model_is_a_usage_error(tmp_path: Path) -> None:
    from tests.support.workers import make_eval_run

    run = make_eval_run(tmp_path, n_prompts=2, shard_size=2)
    obj = json.loads(run.manifest_path.read_text())
    obj["eval"]["base_model"] = str(tmp_path / "no-base")
    run.manifest_path.write_text(json.dumps(obj))
    proc = spawn("worker", "--run-dir", str(run.path), "--once")
    code, out = finish(proc, 120)
    assert code == 2 and "eval.base_model" in out and "is not a directory" in out


def test_reference_trainer_lora_with_a_worker_fleet_pins_every_point(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    trainer = spawn("train", "--run-dir", str(run_dir), "--lora", "--lora-rank", "4", "--steps", "30",
                    "--eval-interval", "10", "--batch-size", "16", "--eval-n-prompts", "8", "--eval-shard-size", "4",
                    "--no-progress", "--threads", "1", "--eval-poll-interval", "0.2", "--eval-drain-timeout", "180",
                    "--eval-keep-snapshots", "4")
    workers = []
    try:
        # workers start once run.json exists (they refuse a dir without one)
        for _ in range(600):
            if (run_dir / "run.json").is_file() or trainer.poll() is not None:
                break
            time.sleep(0.1)
        workers = [spawn("worker", "--run-dir", str(run_dir), "--poll-interval", "0.2") for _ in range(2)]
        code, out = finish(trainer, 300)
        assert code == 0, out[-3000:]
    finally:
        for w in workers:
            if w.poll() is None:
                w.terminate()
        kill_all(workers)
    run = RunDir(run_dir)
    manifest = run.manifest()
    assert manifest.eval.base_model == str((run_dir / "base").resolve())
    snaps = sorted((run_dir / "snapshots").glob("step-*"))
    assert snaps and all({p.name for p in s.iterdir()} == {MARKER, ADAPTER_CONFIG, ADAPTER_WEIGHTS} for s in snaps)
    points = {p["eval/step"]: p for p in eval_lines(run_dir)}
    assert sorted(points) == [0, 10, 20, 30]  # step 0: the initial weights (base + untrained adapter)
    for step, point in points.items():
        assert point["eval/addition/weight_version/mean"] == step, point
        assert point["eval/addition/weight_version/mixed_version_ratio"] == 0
        assert not any(k.startswith("eval/skipped") for k in point), point
