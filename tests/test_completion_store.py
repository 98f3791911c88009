"""The completion store shared across runs: real tiny-model runs, the real hf worker, real snapshots and markers.

Run A generates and files its units; run B (another run from the same base) is answered from the store.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import shutil
import threading
from pathlib import Path

import pytest

from ckpteval.coord.results.completions import Completions, encode, read_completions
from ckpteval.coord.results.points import derive_point
from ckpteval.coord.run.manifest import save_manifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
from ckpteval.coord.work.units import units_for_step
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache
from ckpteval.jobs.eval.kinds.generate.store import CompletionStore, open_store, unit_key
from ckpteval.jobs.eval.worker.options import WorkerOptions
from ckpteval.jobs.lifecycle import EXIT_DONE
from tests.support.workers import make_eval_run, publish_model, results, run_inprocess, version

QUIET = {"out": lambda _line: None}


def _run(tmp: Path, name: str) -> RunDir:
    run = make_eval_run(tmp, name=name, n_prompts=6, shard_size=3, scorer="tests.support.workers:digit_first",
                        n_samples=2, max_new_tokens=3, engine={"hf": {"max_batch_size": 12}})
    manifest = run.manifest()
    spec = dataclasses.replace(manifest.eval.entries[0], temperature=1.0, seed=7)
    save_manifest(run.manifest_path, dataclasses.replace(manifest, eval=dataclasses.replace(manifest.eval,
                                                                                            entries=(spec,))))
    publish_model(tmp, run.snapshots, 0, seed=0)  # both runs start from the same base weights
    return run


def _work(run: RunDir, store: Path) -> int:
    opts = WorkerOptions(run_dir=run.path, poll_interval_s=0.05, pin_timeout_s=0.3, once=True, completion_store=store)
    code, _ = run_inprocess(opts, **QUIET)
    return code


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunDir, Path]:
    tmp = tmp_path_factory.mktemp("store")
    run = _run(tmp, "a")
    store = tmp / "store"
    assert _work(run, store) == EXIT_DONE
    return run, store


def test_a_second_run_from_the_same_base_evaluates_step_0_from_the_store(
        filled: tuple[RunDir, Path], tmp_path: Path) -> None:
    a, store = filled
    first = results(a)
    assert all(r.cost["store_misses"] == 1 and r.cost["engine_s"] > 0 for r in first.values())
    assert len(list(store.rglob("*.completions.json.gz"))) == 2
    b = _run(tmp_path, "b")
    assert _work(b, store) == EXIT_DONE
    second = results(b)
    assert sorted(second) == sorted(first)
    for unit, r in second.items():
        assert r.cost["store_hits"] == 1 and r.cost["engine_s"] == r.cost["gpu_s"] == r.timings["load_s"] == 0
        assert r.attest["how"] == "completion_store" and not r.attest["attested"]
        assert r.scores == first[unit].scores and r.answers == first[unit].answers
        assert set(r.weight_versions) == {version(b, 0)}  # b's own version: its point is b's, not a pin violation
        kept = read_completions(b.results / f"step-{0:010d}" / f"{unit.id}.completions.json.gz")
        assert kept.weight_version == r.weight_versions and kept.lease_token == r.lease_token
    point = derive_point(b.manifest(), 0, second)
    assert point.complete and point.cost["store_hits"] == 2 and point.cost["engine_s"] == 0
    assert point.datasets["addition"].mixed_version_ratio == 0.0


def _keys(run: RunDir, store: CompletionStore) -> list[str]:
    ref = SnapshotDiscovery(run.snapshots).poll()[0]
    cache = DatasetCache(run, run.manifest())
    return [store.key(cache, u, ref)[0] for u in units_for_step(run.manifest(), 0)]  # type: ignore[index]


def _store(run: RunDir, tmp: Path, dtype: str | None = None) -> CompletionStore:
    settings = {"hf": {"max_batch_size": 12, **({"dtype": dtype} if dtype else {})}}
    store = open_store(tmp / "s", run.manifest(), ["hf"], settings, "cpu", 1)
    assert store is not None
    return store


def _change_spec(run: RunDir, **changes: object) -> None:
    m = run.manifest()
    spec = dataclasses.replace(m.eval.entries[0], **changes)
    save_manifest(run.manifest_path, dataclasses.replace(m, eval=dataclasses.replace(m.eval, entries=(spec,))))


def test_changing_any_one_key_input_misses(filled: tuple[RunDir, Path], tmp_path: Path) -> None:
    a, _ = filled
    run = RunDir.open(shutil.copytree(a.path, tmp_path / "copy", symlinks=True))
    base = _keys(run, _store(run, tmp_path))
    assert len(set(base)) == 2 and base == _keys(run, _store(run, tmp_path))  # stable, and one per unit

    def differs(keys: list[str]) -> bool:
        return all(k not in base for k in keys)

    assert differs(_keys(run, _store(run, tmp_path, dtype="bfloat16")))  # the engine's dtype
    data = run.path / "data" / "addition.jsonl"
    rows = data.read_text().splitlines()
    edited = json.loads(rows[0])
    edited["answer"] = "0"
    data.write_text("\n".join([json.dumps(edited), *rows[1:]]) + "\n")
    changed = _keys(run, _store(run, tmp_path))
    assert changed[0] not in base and changed[1] == base[1]  # one row: only its shard misses
    data.write_text("\n".join(rows) + "\n")
    for change in ({"seed": 8}, {"max_new_tokens": 4}, {"temperature": 0.5}, {"top_k": 5}):
        _change_spec(run, **change)
        assert differs(_keys(run, _store(run, tmp_path))), change
        _change_spec(run, **{"seed": 7, "max_new_tokens": 3, "temperature": 1.0, "top_k": -1})
    assert _keys(run, _store(run, tmp_path)) == base
    other = tmp_path / "other-weights"
    publish_model(tmp_path, other, 0, seed=1)
    store = _store(run, tmp_path)
    cache = DatasetCache(run, run.manifest())
    ref = SnapshotDiscovery(other).poll()[0]
    assert store.key(cache, units_for_step(run.manifest(), 0)[0], ref)[0] not in base  # type: ignore[index]
    # the same weights with a chat template added to the tokenizer (a prompt rendering input) miss too
    from ckpteval.coord.snapshots.snapshot import publish_snapshot
    from ckpteval.jobs.reference.model import build_model, save_tokenizer
    from ckpteval.jobs.trainer.export.hf_files import write_hf_files
    from tests.support.workers import base_dir

    chat_base = shutil.copytree(base_dir(tmp_path), tmp_path / "chat-base")
    save_tokenizer(chat_base, json.loads((chat_base / "config.json").read_text())["max_position_embeddings"], chat=True)
    templated = tmp_path / "templated"
    publish_snapshot(templated, 0, lambda d: write_hf_files(d, build_model(seed=0).state_dict(), chat_base))
    ref = SnapshotDiscovery(templated).poll()[0]
    plain = SnapshotDiscovery(run.snapshots).poll()[0]
    assert ref.marker.tensors == plain.marker.tensors  # equal weights, bit for bit
    assert store.key(cache, units_for_step(run.manifest(), 0)[0], ref)[0] not in base  # type: ignore[index]


def test_template_kwargs_change_the_key(filled: tuple[RunDir, Path], tmp_path: Path) -> None:
    a, _ = filled
    ref = SnapshotDiscovery(a.snapshots).poll()[0]
    unit = units_for_step(a.manifest(), 0)[0]
    keyed = _store(a, tmp_path).key(DatasetCache(a, a.manifest()), unit, ref)
    assert keyed is not None
    work = keyed[1]  # the same rendered prompts, only the kwargs differ (the tiny model has no chat template)
    chat = dataclasses.replace(work.spec, prompt_format="chat")
    thinking_off = dataclasses.replace(chat, chat_template_kwargs={"enable_thinking": False})
    weights, engine = {"w": "digest"}, {"kind": "hf"}
    assert unit_key(weights, engine, dataclasses.replace(work, spec=chat)) != unit_key(
        weights, engine, dataclasses.replace(work, spec=thinking_off))


def test_a_corrupt_or_foreign_entry_is_a_logged_miss_and_is_replaced(
        filled: tuple[RunDir, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, filled_store = filled
    store = shutil.copytree(filled_store, tmp_path / "store")
    first, second = sorted(store.rglob("*.completions.json.gz"))
    first.write_bytes(first.read_bytes()[:-20])  # a torn entry (say, copied by hand)
    entry = read_completions(second)
    forged = dataclasses.replace(entry, text=tuple("999" for _ in entry.text), store_key="0" * 64)
    second.write_bytes(encode(forged))  # whole, but filed under another key: never served
    b = _run(tmp_path, "b")
    assert _work(b, store) == EXIT_DONE
    err = capsys.readouterr().err
    assert str(first) in err and str(second) in err and "treated as a miss" in err
    got, expected = results(b), results(a)
    for unit, r in got.items():
        assert r.cost["store_misses"] == 1 and r.scores == expected[unit].scores  # regenerated, right answers
    for path in (first, second):  # replaced whole by the fresh completions
        assert read_completions(path).store_key == path.name.split(".")[0]


def test_concurrent_writers_of_one_key_leave_one_whole_entry(tmp_path: Path) -> None:
    from ckpteval.coord.work.units import WorkUnit

    store = CompletionStore(tmp_path / "s", {"kind": "hf"})
    key = "ab" + "0" * 62
    barrier = threading.Barrier(8)
    won: list[bool] = []

    def put(i: int) -> None:
        record = Completions(WorkUnit(0, "d", 0), ("p",), (f"text {i}",), ("stop",), (2,), (1,), (None,), ("v",), "r")
        barrier.wait()
        won.append(store.put(key, record))

    threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(won) == [False] * 7 + [True]
    entry = read_completions(store.path(key))
    assert entry.store_key == key and entry.text[0].startswith("text ")
    assert [p.name for p in store.path(key).parent.iterdir()] == [store.path(key).name]  # no temp file left


@pytest.mark.parametrize("digest", ["kept", "dropped"])
def test_an_entry_whose_text_was_edited_is_a_logged_miss_never_a_hit(
        filled: tuple[RunDir, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], digest: str) -> None:
    """An entry's text edited in place (its key and everything else as written) fails the sha256 written with
    it, and an edit that also drops the sha256 fails for lacking one (#37): a miss naming the entry,
    regenerated, never served as a hit."""
    a, filled_store = filled
    store = shutil.copytree(filled_store, tmp_path / "store")
    entry = sorted(store.rglob("*.completions.json.gz"))[0]
    body = json.loads(gzip.decompress(entry.read_bytes()))
    body["text"] = ["999" for _ in body["text"]]
    if digest == "dropped":
        del body["sha256"]
    entry.write_bytes(gzip.compress(json.dumps(body).encode()))
    b = _run(tmp_path, "b")
    assert _work(b, store) == EXIT_DONE
    err = capsys.readouterr().err
    said = "does not match the sha256 written with it" if digest == "kept" else "no sha256 written with its text"
    assert str(entry) in err and said in err
    got, expected = results(b), results(a)
    assert sum(r.cost.get("store_misses", 0) for r in got.values()) == 1
    assert all(r.scores == expected[unit].scores for unit, r in got.items())
