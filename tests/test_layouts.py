"""Checkpoint layouts of real trainers (ckpteval.coord.layouts) through ckpteval.coord.snapshots.discovery.

Each trainer's save is rebuilt here file by file in the order its own source writes it (cited in the
layout modules' docstrings), with real safetensors files, and polled after every file: a save is
found at its step, admitted only once complete (the trainer's signal, or quiescence where it gives
none), its weights verify in full (never a false ``ckpt_corrupt``), and a save rotated away before
admission is counted and recorded, never silently absent. The last tests drive a real
``transformers.Trainer`` with ``save_total_limit``.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from ckpteval.coord.layouts import LAYOUTS, detect_layouts, resolve_layout
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
from ckpteval.coord.snapshots.snapshot import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    is_adapter_snapshot,
    verify_snapshot,
)

Action = Callable[[], None]
QUIET_S = 30.0


def _hf_files(d: Path, step: int) -> list[Action]:
    """An HF model save, one action per file: two shards, the index, config and tokenizer."""

    def shard(i: int) -> Action:
        return lambda: save_file({f"w{i}": torch.full((8,), float(step))}, str(d / f"model-{i + 1:05d}-of-00002.safetensors"))

    index = {"metadata": {}, "weight_map": {f"w{i}": f"model-{i + 1:05d}-of-00002.safetensors" for i in range(2)}}
    return [lambda: d.mkdir(parents=True, exist_ok=True), shard(0), shard(1),
            lambda: (d / "model.safetensors.index.json").write_text(json.dumps(index)),
            lambda: (d / "config.json").write_text('{"model_type": "llama"}'),
            lambda: (d / "tokenizer_config.json").write_text("{}")]


def _write(path: Path, text: str = "x") -> Action:
    def act() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return act


def hf_trainer(root: Path, step: int) -> tuple[list[Action], Path, Path]:
    d = root / f"checkpoint-{step}"
    acts = [*_hf_files(d, step), _write(d / "optimizer.pt"), _write(d / "scheduler.pt"), _write(d / "rng_state.pth"),
            _write(d / "trainer_state.json", json.dumps({"global_step": step, "log_history": []}))]
    return acts, d, d


def verl(root: Path, step: int) -> tuple[list[Action], Path, Path]:
    d = root / f"global_step_{step}"
    actor = d / "actor"
    acts = [_write(actor / "model_world_size_1_rank_0.pt"), _write(actor / "optim_world_size_1_rank_0.pt"),
            _write(actor / "extra_state_world_size_1_rank_0.pt"), _write(actor / "huggingface" / "config.json", "{}"),
            _write(actor / "fsdp_config.json", "{}"), *_hf_files(actor / "huggingface", step),
            _write(d / "data.pt"), _write(root / "latest_checkpointed_iteration.txt", str(step))]
    return acts, d, actor / "huggingface"


def openrlhf(root: Path, step: int) -> tuple[list[Action], Path, Path]:
    d = root / f"global_step{step}_hf"
    acts = [_write(root / "_actor" / f"global_step{step}" / "mp_rank_00_model_states.pt"),
            _write(root / "_actor" / "latest", f"global_step{step}"), *_hf_files(d, step)]
    return acts, d, d


def prime_rl(root: Path, step: int) -> tuple[list[Action], Path, Path]:
    d = root / "weights" / f"step_{step}"
    trainer = root / "checkpoints" / f"step_{step}" / "trainer"
    acts = [_write(trainer / "__0_0.distcp"), _write(trainer / ".metadata"), _write(trainer / "STABLE", ""),
            *_hf_files(d, step), _write(d / "generation_config.json", "{}"), _write(d / "STABLE", "")]
    return acts, d, d


def nemo_rl(root: Path, step: int) -> tuple[list[Action], Path, Path]:
    tmp, d = root / f"tmp_step_{step}", root / f"step_{step}"
    weights = "policy/weights/model/consolidated"
    acts = [_write(tmp / "training_info.json", json.dumps({"step": step})), _write(tmp / "config.yaml"),
            _write(tmp / "policy" / "weights" / "model" / "shard-00001.distcp"), *_hf_files(tmp / weights, step),
            _write(tmp / "policy" / "optimizer" / "optim.distcp"), _write(tmp / "policy" / "tokenizer" / "tokenizer.json"),
            lambda: tmp.rename(d)]
    return acts, d, d / weights


def miles(root: Path, step: int) -> tuple[list[Action], Path, Path]:
    d = root / f"iter_{step:07d}"
    return [*_hf_files(d, step), _write(d / ".complete", "")], d, d


def plain(root: Path, step: int) -> tuple[list[Action], Path, Path]:
    d = root / f"step_{step}"
    return _hf_files(d, step), d, d


TREES: dict[str, Callable[[Path, int], tuple[list[Action], Path, Path]]] = {
    "hf-trainer": hf_trainer, "verl": verl, "openrlhf": openrlhf, "prime-rl": prime_rl, "nemo-rl": nemo_rl,
    "miles": miles, "plain": plain,
}
QUIESCENCE = {"openrlhf", "plain"}  # trainers that give no completion signal


def _discovery(tmp: Path, root: Path, layout: str, now: list[float]) -> SnapshotDiscovery:
    return SnapshotDiscovery(root, admit_foreign=True, quiescence_s=QUIET_S, adoption_dir=tmp / "adopted",
                             clock=lambda: now[0], layout=layout, lost_dir=tmp / "lost")


def _steps(d: SnapshotDiscovery) -> dict[int, Path]:
    return {r.step: r.path for r in d.poll()}


def test_every_registered_layout_has_a_tree() -> None:
    assert set(TREES) == set(LAYOUTS)


@pytest.mark.parametrize("layout", sorted(TREES))
def test_saves_written_slowly_are_admitted_only_when_complete(tmp_path: Path, layout: str) -> None:
    root, now = tmp_path / "out", [0.0]
    root.mkdir()
    disc = _discovery(tmp_path, root, layout, now)
    for step in (10, 20):
        acts, _entry, weights = TREES[layout](root, step)
        for act in acts[:-1]:
            act()
            now[0] += 1.0
            assert step not in _steps(disc), f"{layout}: step {step} admitted before its save finished"
        acts[-1]()
        if layout in QUIESCENCE:
            assert step not in _steps(disc)
            now[0] += QUIET_S + 1
        found = _steps(disc)
        assert found.get(step) == weights, f"{layout}: step {step} not found at {weights}: {found}"
        ref = next(r for r in disc.poll() if r.step == step)
        verify_snapshot(ref.path, "full", ref.marker)  # what eval loads verifies: never a false ckpt_corrupt
        assert {n for n in ref.marker.files if n.endswith(".safetensors")} == {
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert disc.lost == {} and not (tmp_path / "lost").exists() and disc.problems == {}


# nemo-rl is left out: its step_N/ appears (by rename) already finished and is admitted at first sight,
# so a watcher never holds a seen-but-unadmitted nemo-rl save to lose.
@pytest.mark.parametrize("layout", sorted(set(TREES) - {"nemo-rl"}))
def test_a_save_rotated_away_before_admission_is_counted_and_recorded(tmp_path: Path, layout: str) -> None:
    root, now = tmp_path / "out", [0.0]
    root.mkdir()
    disc = _discovery(tmp_path, root, layout, now)
    acts, entry, _weights = TREES[layout](root, 30)
    for act in acts[:-1]:
        act()
    assert disc.poll() == []  # seen, not finished
    acts[-1]()
    shutil.rmtree(entry)  # save_total_limit / max_ckpt_num / keep_last: gone before the next poll
    assert disc.poll() == [] and list(disc.lost.values()) == [30]
    record = json.loads((tmp_path / "lost" / "0000000030.json").read_text())
    assert record["step"] == 30 and record["layout"] == layout


def test_a_rotated_save_another_watcher_adopted_is_not_lost(tmp_path: Path) -> None:
    root, now = tmp_path / "out", [0.0]
    root.mkdir()
    slow, fast = _discovery(tmp_path, root, "hf-trainer", now), _discovery(tmp_path, root, "hf-trainer", now)
    acts, entry, _ = hf_trainer(root, 5)
    for act in acts[:-1]:
        act()
    assert slow.poll() == []
    acts[-1]()
    assert [r.step for r in fast.poll()] == [5]
    shutil.rmtree(entry)
    assert slow.poll() == [] and slow.lost == {}


def test_a_finished_verl_save_without_hf_weights_is_reported_not_admitted(tmp_path: Path) -> None:
    """verl without ``hf_model`` in save_contents: huggingface/ holds config + tokenizer only."""
    root, now = tmp_path / "out", [0.0]
    actor = root / "global_step_7" / "actor"
    for act in (_write(actor / "model_world_size_2_rank_0.pt"), _write(actor / "huggingface" / "config.json", "{}"),
                _write(root / "latest_checkpointed_iteration.txt", "7")):
        act()
    disc = _discovery(tmp_path, root, "verl", now)
    assert disc.poll() == [] and disc.lost == {}
    (line,) = disc.problems.values()
    assert "no HF weights" in line and "verl.model_merger" in line and "hf_model" in line


@pytest.mark.parametrize("layout", sorted(set(TREES) - {"plain"}))
def test_auto_detects_each_trainer_and_refuses_a_mix(tmp_path: Path, layout: str) -> None:
    root = tmp_path / layout
    acts, _, _ = TREES[layout](root, 3)
    for act in acts:
        act()
    assert detect_layouts(root) == [layout]
    assert resolve_layout(root, "auto").name == layout
    other = "verl" if layout != "verl" else "nemo-rl"
    for act in TREES[other](root, 4)[0]:
        act()
    with pytest.raises(ValueError, match="ambiguous") as e:
        resolve_layout(root, "auto")
    assert "\n" not in str(e.value) and "--layout NAME" in str(e.value)


def test_auto_falls_back_to_plain_until_the_dir_reveals_its_trainer(tmp_path: Path) -> None:
    root, now = tmp_path / "out", [0.0]
    acts, _, weights = hf_trainer(root, 2)
    for act in acts[:-1]:
        act()
    disc = _discovery(tmp_path, root, "auto", now)
    assert disc.poll() == [] and disc.active_layout.name == "plain" and resolve_layout(root, "auto") is None
    acts[-1]()  # trainer_state.json: now it is an HF Trainer dir, admitted without the quiescence wait
    assert _steps(disc) == {2: weights} and disc.active_layout.name == "hf-trainer"


def test_unknown_layout_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--layout 'nope': unknown; expected one of auto, plain"):
        SnapshotDiscovery(tmp_path, layout="nope")


def _train_with_watcher(tmp: Path, layout: str) -> SnapshotDiscovery:
    """A real ``transformers.Trainer`` saving every step with ``save_total_limit=2``; a watcher polls the
    output dir after every save (``on_save`` runs after the save and its rotation)."""
    from transformers import TrainerCallback

    out = tmp / "trainer-out"
    disc = SnapshotDiscovery(out, admit_foreign=True, quiescence_s=QUIET_S, adoption_dir=tmp / "adopted",
                             layout=layout, lost_dir=tmp / "lost")

    class Watch(TrainerCallback):
        def on_save(self, args, state, control, **kw):  # noqa: ANN001, ANN003, ANN201
            disc.poll()

    _rotating_trainer(out, 5, Watch())
    disc.poll()
    return disc


def _rotating_trainer(out: Path, steps: int, callback: object) -> None:
    """A real ``transformers.Trainer`` on the tiny model saving every step with ``save_total_limit=2``."""
    from transformers import Trainer, TrainingArguments

    from ckpteval.jobs.reference.model import ModelConfig, build_model, build_tokenizer
    from tests.test_hf_callback import AdditionDataset

    small = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64)
    targs = TrainingArguments(output_dir=str(out), max_steps=steps, save_steps=1, save_total_limit=2,
                              per_device_train_batch_size=8, report_to=[], use_cpu=True, disable_tqdm=True,
                              logging_strategy="no")
    Trainer(model=build_model(small, "llama").train(), args=targs, train_dataset=AdditionDataset(16),
            processing_class=build_tokenizer(), callbacks=[callback]).train()


def test_real_hf_trainer_saves_are_admitted_at_once_despite_rotation(tmp_path: Path) -> None:
    """HF Trainer writes trainer_state.json last: every save is admissible when the watcher looks, so
    none of the five is lost to ``save_total_limit=2`` (which left only two on disk)."""
    disc = _train_with_watcher(tmp_path, "auto")
    assert sorted(p.name for p in (tmp_path / "trainer-out").iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-4", "checkpoint-5"]
    assert sorted(p.name for p in (tmp_path / "adopted").iterdir()) == [f"{s:010d}.json" for s in range(1, 6)]
    assert disc.active_layout.name == "hf-trainer" and disc.lost == {}
    for ref in disc.poll():
        verify_snapshot(ref.path, "full", ref.marker)


def test_real_hf_trainer_under_quiescence_loses_rotated_saves_visibly(tmp_path: Path) -> None:
    """The same run watched without the trainer's signal (``plain``, 30 s quiescence): the three saves
    rotated away before they went quiet are counted and recorded, not silently absent."""
    disc = _train_with_watcher(tmp_path, "plain")
    assert not (tmp_path / "adopted").exists() or not any((tmp_path / "adopted").iterdir())
    assert sorted(disc.lost.values()) == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "lost").iterdir()) == [f"{s:010d}.json" for s in (1, 2, 3)]
    assert sorted(disc.awaiting_quiescence) == ["checkpoint-4", "checkpoint-5"]


def test_worker_refuses_an_ambiguous_watch_dir_in_one_line(tmp_path: Path) -> None:
    from tests.support.workers import finish, spawn

    mixed = tmp_path / "mixed"
    for tree, step in ((verl, 1), (nemo_rl, 2)):
        for act in tree(mixed, step)[0]:
            act()
    code, out = finish(spawn("worker", "--run-dir", str(tmp_path / "run"), "--watch", str(mixed), "--once"), 60)
    assert code == 2 and "ambiguous" in out and "verl and nemo-rl" in out and "Traceback" not in out, out


def test_status_shows_saves_lost_before_admission(tmp_path: Path) -> None:
    from ckpteval.jobs.views.status.main import collect_status, render
    from tests.support.runs import make_run

    run = make_run(tmp_path)
    root, now = tmp_path / "out", [0.0]
    disc = SnapshotDiscovery(root, admit_foreign=True, adoption_dir=run.adopted, lost_dir=run.lost,
                             layout="hf-trainer", clock=lambda: now[0])
    acts, entry, _ = hf_trainer(root, 3)
    for act in acts[:-1]:
        act()
    disc.poll()
    shutil.rmtree(entry)
    disc.poll()
    status = collect_status(run.path)
    assert status["health"]["lost_before_admission"] == [3]
    assert "LOST to rotation before admission: 1 (steps 3)" in str(render(status)[-1])


def test_worker_watching_a_real_rotating_trainer_sees_every_save(tmp_path: Path) -> None:
    """The issue's scenario, end to end: a real ``transformers.Trainer`` saving every step (0.3 s apart)
    with ``save_total_limit=2`` into a dir a ``ckpteval worker --watch`` process serves at the default
    30 s quiescence, while each unit takes 0.6 s (the fn backend's delay). The worker polls the watched
    dir while a unit runs and admits each save on HF Trainer's own signal, so every one of the six
    saves (and the start point, ``checkpoint-0``) gets its unit's result — scored, or ``ckpt_missing`` if rotated away before its turn — and none
    is lost or silently absent."""
    from transformers import TrainerCallback

    from tests.support.workers import finish, wait_for

    out, run_dir = tmp_path / "trainer-out", tmp_path / "svc"
    worker = _service(tmp_path, out, run_dir, delay_s=0.6, max_units=7)
    try:
        wait_for(lambda: (run_dir / "adopted" / f"{0:010d}.json").exists(), 120, what="the service to poll")

        class Slow(TrainerCallback):
            def on_save(self, args, state, control, **kw):  # noqa: ANN001, ANN003, ANN201
                time.sleep(0.3)

        _rotating_trainer(out, 6, Slow())
        code, log = finish(worker, 120)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert code == 0, log
    got = _results(run_dir)
    assert sorted(got) == list(range(7)), log
    assert all(r.ok or r.skip_reason == "ckpt_missing" for r in got.values()), log
    assert any(r.ok for r in got.values()) and not (run_dir / "lost").exists()


def _service(tmp: Path, out: Path, run_dir: Path, delay_s: float, max_units: int) -> Any:
    """``ckpteval worker --watch out`` (a service run over one 2-prompt unit per step, the fn backend
    taking ``delay_s`` per unit), with ``out/checkpoint-0`` already saved as the start point."""
    from ckpteval.jobs.reference.model import make_addition_examples
    from tests.support.workers import spawn, write_foreign_checkpoint

    out.mkdir()
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make_addition_examples(2, 5)))
    (tmp / "eval.json").write_text(json.dumps({"eval": {"datasets": [
        {"name": "addition", "path": "rows.jsonl", "n_prompts": 2, "scorer": "exact", "shard_size": 2}],
        "engine": {"fn": {"delay_s": delay_s}}}}))
    write_foreign_checkpoint(tmp, out / "checkpoint-0", 0)
    return spawn("worker", "--run-dir", str(run_dir), "--watch", str(out), "--eval-config", str(tmp / "eval.json"),
                 "--engine", "fn:tests.support.workers:SumBackend", "--poll-interval", "0.05",
                 "--max-units", str(max_units))


def _results(run_dir: Path) -> dict[int, Any]:
    from ckpteval.coord.results.files import ResultIndex

    return {u.step: r for u, r in ResultIndex(RunDir(run_dir).results).refresh().items()}


def test_worker_polls_watched_dirs_while_a_unit_runs(tmp_path: Path) -> None:
    """A save that appears and is rotated away while a (3 s) unit runs is admitted during that unit
    (within 2 s), so it is evaluated — here ``ckpt_missing``, since it was deleted before its turn —
    instead of never having been seen."""
    from tests.support.workers import finish, wait_for, write_foreign_checkpoint

    out, run_dir = tmp_path / "trainer-out", tmp_path / "svc"
    worker = _service(tmp_path, out, run_dir, delay_s=3.0, max_units=2)
    try:
        wait_for(lambda: (run_dir / "adopted" / f"{0:010d}.json").exists(), 120, what="step 0 admitted")
        write_foreign_checkpoint(tmp_path, out / "checkpoint-1", 1)  # while step 0's unit runs
        wait_for(lambda: (run_dir / "adopted" / f"{1:010d}.json").exists(), 2.0, what="step 1 admitted mid-unit")
        shutil.rmtree(out / "checkpoint-1")  # rotated away before its unit's turn
        code, log = finish(worker, 60)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert code == 0, log
    got = _results(run_dir)
    assert got[0].ok and got[1].skip_reason == "ckpt_missing", log


# -- current prime-rl: broadcasts/step_N (HF weights only there since PR #3316), newest kept ---------------
def _broadcast(root: Path, step: int) -> tuple[list[Action], Path]:
    """``FileSystemWeightBroadcast.broadcast_weights`` at prime-rl 559b447: shards under tmp-rank names
    renamed into place, the index last, then STABLE; no config, no tokenizer; DCP state beside it."""
    d = root / "broadcasts" / f"step_{step}"
    names = [f"model-{i + 1:05d}-of-00002.safetensors" for i in range(2)]
    index = {"metadata": {}, "weight_map": {f"w{i}": names[i] for i in range(2)}}

    def shard(i: int) -> Action:
        def act() -> None:
            save_file({f"w{i}": torch.full((8,), float(step))}, str(d / f"tmp-rank{i}.safetensors"))
            (d / f"tmp-rank{i}.safetensors").rename(d / names[i])
        return act
    return [lambda: d.mkdir(parents=True, exist_ok=True), _write(root / "checkpoints" / f"step_{step}" / "__0_0.distcp"),
            shard(0), shard(1), lambda: (d / "model.safetensors.index.json").write_text(json.dumps(index)),
            _write(d / "STABLE", "")], d


def _prime_run(tmp: Path) -> tuple[Path, list[float]]:
    base = tmp / "base"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "llama"}')
    (base / "tokenizer_config.json").write_text("{}")
    root = tmp / "out"
    root.mkdir()
    return root, [0.0]


def test_prime_rl_broadcast_is_captured_and_outlives_the_trainers_cleanup(tmp_path: Path) -> None:
    root, now = _prime_run(tmp_path)
    disc = _discovery(tmp_path, root, "auto", now)
    acts, d = _broadcast(root, 2)
    for act in acts[:-1]:
        act()
        assert disc.poll() == []  # no STABLE yet: never admitted, never captured
    acts[-1]()
    assert detect_layouts(root) == ["prime-rl"]
    [ref] = disc.poll()
    assert ref.step == 2 and ref.path == tmp_path / "captured" / f"step_{2:010d}"
    assert {"config.json", "tokenizer_config.json"} <= set(ref.marker.files)  # the run's, filled in
    for step in (3, 4):  # the trainer moves on and deletes step_{N-2} (maybe_clean)
        for act in _broadcast(root, step)[0]:
            act()
        shutil.rmtree(root / "broadcasts" / f"step_{step - 2}", ignore_errors=True)
    assert not d.exists()
    refs = {r.step: r for r in disc.poll()}
    assert sorted(refs) == [2, 3, 4] and refs[2].path == ref.path
    verify_snapshot(refs[2].path, "full", refs[2].marker)  # the capture is whole after its source is gone
    assert disc.lost == {} and disc.problems == {} and not list((tmp_path / "captured").glob(".tmp-*"))


def test_prime_rl_lora_broadcast_is_captured_as_an_adapter(tmp_path: Path) -> None:
    """A LoRA run broadcasts the adapter only (``save_lora_config``: ``adapter_model.safetensors`` +
    ``adapter_config.json``, then STABLE): captured like full weights (no ``config.json`` needed), whole after
    the trainer's cleanup, and an adapter snapshot (what a run with ``eval.base_model`` loads through its LoRA
    engine, ``jobs/eval/engines/hf/lora.py``; scoring an adapter end to end is tests/test_lora.py's)."""
    root, now = _prime_run(tmp_path)
    disc = _discovery(tmp_path, root, "auto", now)
    d = root / "broadcasts" / "step_3"
    d.mkdir(parents=True)
    save_file({"base_model.model.layers.0.q_proj.lora_A.weight": torch.zeros(2, 8)}, str(d / ADAPTER_WEIGHTS))
    assert disc.poll() == []  # STABLE not yet there
    (d / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    (d / "STABLE").touch()
    [ref] = disc.poll()
    assert ref.path == tmp_path / "captured" / f"step_{3:010d}" and is_adapter_snapshot(ref.marker.files)
    assert {ADAPTER_WEIGHTS, ADAPTER_CONFIG} <= set(ref.marker.files) and disc.problems == {}
    shutil.rmtree(d)  # the trainer's cleanup
    verify_snapshot(ref.path, "full", ref.marker)


def _handshake_broadcast(root: Path, step: int) -> tuple[list[Action], Path]:
    """The same broadcast under PR #3357's four-stage handshake: the trainer offers (``.sender_ready``), its
    consumer acknowledges (``.receiver_ready``: here the test plays the orchestrator), ``.started``, the
    weights, ``.finished``; no STABLE."""
    acts, d = _broadcast(root, step)
    mkdir, dcp, *weights, _stable = acts
    return [mkdir, _write(d / ".sender_ready", ""), _write(d / ".receiver_ready", ""), _write(d / ".started", ""),
            dcp, *weights, _write(d / ".finished", "")], d


def test_prime_rl_handshake_broadcast_is_admitted_on_finished_and_never_acknowledged(tmp_path: Path) -> None:
    """Current prime-rl (#3357): a broadcast is admitted on ``.finished`` only, and ckpteval, a watcher, writes
    nothing into the trainer's dir: a step only offered (``.sender_ready``, no consumer yet) is never
    acknowledged by it (the trainer would otherwise take ckpteval for its consumer)."""
    root, now = _prime_run(tmp_path)
    disc = _discovery(tmp_path, root, "auto", now)
    offered = root / "broadcasts" / "step_1"
    _write(offered / ".sender_ready", "")()
    acts, d = _handshake_broadcast(root, 2)
    for act in acts[:-1]:
        act()
        assert disc.poll() == []  # offered, acknowledged, started, weights written: not finished yet
    before = {p.name for p in d.iterdir()}
    acts[-1]()
    [ref] = disc.poll()
    assert ref.step == 2 and ref.path == tmp_path / "captured" / f"step_{2:010d}"
    verify_snapshot(ref.path, "full", ref.marker)
    assert {p.name for p in d.iterdir()} == before | {".finished"}  # nothing of ours in the trainer's dir
    assert [p.name for p in offered.iterdir()] == [".sender_ready"]  # never acknowledged by the watcher
    from ckpteval.coord.layouts import get_layout

    assert get_layout("prime-rl").completion_marker(d) == d / ".finished"


def test_prime_rl_broadcast_reset_while_captured_is_a_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer resets a finished step dir for a new offer (a resume re-broadcasting its step) while it
    is being linked: the marker's identity changed, so the capture is discarded and counted lost."""
    import ckpteval.coord.snapshots.discovery as discovery

    root, now = _prime_run(tmp_path)
    acts, d = _handshake_broadcast(root, 4)
    for act in acts:
        act()
    real = discovery._link_or_copy

    def reset_midway(src: Path, dst: Path) -> tuple[int, int, int]:
        got = real(src, dst)
        if (d / ".finished").exists():
            (d / ".finished").unlink()  # reset: the handshake starts over
            (d / ".sender_ready").write_text("again")
        return got

    monkeypatch.setattr(discovery, "_link_or_copy", reset_midway)
    disc = _discovery(tmp_path, root, "prime-rl", now)
    assert disc.poll() == []
    assert disc.lost == {"broadcasts/step_4": 4} and not (tmp_path / "captured" / f"step_{4:010d}").exists()


def test_prime_rl_capture_racing_the_cleanup_is_a_loss_never_a_point(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer deletes the broadcast while it is being linked: nothing admitted, the loss recorded,
    no half capture left; a real link/copy is used for every file but the one the cleanup beats."""
    import ckpteval.coord.snapshots.discovery as discovery

    root, now = _prime_run(tmp_path)
    acts, d = _broadcast(root, 6)
    for act in acts:
        act()
    real = discovery._link_or_copy

    def cleanup_midway(src: Path, dst: Path) -> tuple[int, int, int]:
        got = real(src, dst)
        shutil.rmtree(d, ignore_errors=True)  # maybe_clean runs now
        return got
    monkeypatch.setattr(discovery, "_link_or_copy", cleanup_midway)
    disc = _discovery(tmp_path, root, "prime-rl", now)
    assert disc.poll() == []
    assert disc.lost == {"broadcasts/step_6": 6} and (tmp_path / "lost" / f"{6:010d}.json").is_file()
    assert not (tmp_path / "captured" / f"step_{6:010d}").exists() and not list((tmp_path / "captured").glob(".tmp-*"))


def test_prime_rl_broadcast_without_a_config_anywhere_is_reported(tmp_path: Path) -> None:
    root, now = tmp_path / "out", [0.0]
    root.mkdir()
    for act in _broadcast(root, 2)[0]:
        act()
    disc = _discovery(tmp_path, root, "prime-rl", now)
    assert disc.poll() == []
    [problem] = disc.problems.values()
    assert "weights only" in problem and str(tmp_path / "base") in problem


def test_older_prime_rl_weights_layout_is_chosen_by_what_is_on_disk(tmp_path: Path) -> None:
    from ckpteval.coord.layouts import get_layout

    root = tmp_path / "out"
    for act in TREES["prime-rl"](root, 5)[0]:
        act()
    layout = get_layout("prime-rl")
    assert layout.containers(root) == [root / "weights"]
    located = layout.locate(root / "weights" / "step_5")
    assert located is not None and located.complete and not located.ephemeral  # used in place, as before


def test_two_watchers_capturing_the_same_broadcast_share_one_capture(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers of one run capture the same broadcast at once: the one whose rename comes second finds
    the other's capture and uses it (no crash, no second copy, no temp dir left)."""
    import ckpteval.coord.snapshots.discovery as discovery

    root, now = _prime_run(tmp_path)
    for act in _broadcast(root, 8)[0]:
        act()
    other = _discovery(tmp_path / "other", root, "prime-rl", now)  # the other worker: its own capture, renamed
    real = discovery._link_or_copy
    state = {"raced": False}

    def other_finishes_first(src: Path, dst: Path) -> tuple[int, int, int]:
        if not state["raced"]:
            state["raced"] = True
            (tmp_path / "other" / "base").mkdir(parents=True)
            shutil.copytree(tmp_path / "base", tmp_path / "other" / "base", dirs_exist_ok=True)
            monkeypatch.setattr(discovery, "_link_or_copy", real)
            [ref] = other.poll()
            shutil.move(str(ref.path), tmp_path / "captured" / ref.path.name)  # into this run's captured/
            monkeypatch.setattr(discovery, "_link_or_copy", other_finishes_first)
        return real(src, dst)
    monkeypatch.setattr(discovery, "_link_or_copy", other_finishes_first)
    mine = _discovery(tmp_path, root, "prime-rl", now)
    [ref] = mine.poll()
    assert state["raced"] and ref.path == tmp_path / "captured" / f"step_{8:010d}"
    assert not list((tmp_path / "captured").glob(".tmp-*")) and mine.problems == {} and mine.lost == {}
    verify_snapshot(ref.path, "full", ref.marker)


CITED = re.compile(r"\b(?:commit [0-9a-f]{7,40}|[0-9a-f]{40}|transformers \d+\.\d+\.\d+)\b")


def test_every_trainer_layout_cites_what_it_was_read_from_and_the_guide_names_it() -> None:
    """#31: each layout module cites the trainer commit (or release) it was read from, and the guide's
    "Trainer versions known to work" names that commit's short hash (or the release)."""
    import importlib

    guide = (Path(__file__).parents[1] / "docs" / "USER_GUIDE.md").read_text()
    known = guide.split("Trainer versions known to work", 1)[1].split("\n\n", 1)[0]
    for name, target in LAYOUTS.items():
        if name == "plain":
            continue  # no trainer: a dir of snapshot dirs
        doc = importlib.import_module(target.split(":")[0]).__doc__ or ""
        cited = CITED.search(doc)
        assert cited, f"layout {name}: its module docstring cites no commit or release"
        ref = cited.group(0).removeprefix("commit ")
        assert (ref if " " in ref else ref[:7]) in known, (name, ref, known)
