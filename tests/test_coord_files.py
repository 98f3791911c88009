"""Atomic files, run.json validation and snapshot publish/verify on a real filesystem."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckpteval.coord.atomic import publish_exclusive, read_json, read_jsonl, write_json_atomic
from ckpteval.coord.run.manifest import load_manifest
from ckpteval.coord.snapshots.discovery import SnapshotDiscovery
from ckpteval.coord.snapshots.snapshot import (
    SnapshotCorrupt,
    SnapshotMissing,
    checkpoint_dirname,
    mark_complete,
    publish_snapshot,
    read_marker,
    snapshot_dirname,
    snapshot_path,
    step_from_name,
    verify_snapshot,
)
from tests.support.runs import flip_byte, make_run, write_tiny_shards


def test_atomic_write_leaves_no_temp_and_reads_back(tmp_path: Path) -> None:
    write_json_atomic(tmp_path / "a.json", {"x": 1})
    assert read_json(tmp_path / "a.json") == {"x": 1}
    assert os.listdir(tmp_path) == ["a.json"]


@pytest.mark.parametrize("renameat2", [True, False], ids=["renameat2", "link-fallback"])
def test_publish_exclusive_first_writer_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, renameat2: bool) -> None:
    """Both ways of publishing without replacing: renameat2(RENAME_NOREPLACE), and link + unlink where the
    C library or filesystem lacks the flag (as if it had none: the function pointer removed)."""
    from ckpteval.coord import atomic

    if renameat2 and atomic._renameat2 is None:
        pytest.skip("this C library has no renameat2 (glibc < 2.28)")
    if not renameat2:
        monkeypatch.setattr(atomic, "_renameat2", None)
    assert publish_exclusive(tmp_path / "r.json", b"first")
    assert not publish_exclusive(tmp_path / "r.json", b"second")
    assert (tmp_path / "r.json").read_bytes() == b"first"
    assert os.listdir(tmp_path) == ["r.json"]


def test_malformed_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: malformed JSON"):
        read_json(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="nope.json"):
        read_json(tmp_path / "nope.json")


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda m: m["eval"]["datasets"][0].update(shard_size=0), r"eval\.datasets\[0\]\.shard_size must be >= 1"),
        (lambda m: m["eval"]["datasets"][0].update(name="a.b"), r"eval\.datasets\[0\]\.name"),
        (lambda m: m["eval"]["datasets"][0].pop("n_prompts"), r"eval\.datasets\[0\]\.n_prompts is missing"),
        (lambda m: m["eval"]["datasets"][0].update(temperature="hot"), r"eval\.datasets\[0\]\.temperature must be int or float"),
        (lambda m: m["eval"].update(datasets=[]), r"eval\.datasets must list at least one"),
        (lambda m: m.update(snapshot_roots=["relative/dir"]), r"snapshot_roots\[0\] must be an absolute path"),
        (lambda m: m["lease"].update(heartbeat_s=100), r"lease\.heartbeat_s"),
        (lambda m: m.pop("run_id"), r"run_id is missing"),
        (lambda m: m["eval"].update(canary={"on_fail": "ignore"}), r"eval\.canary\.on_fail 'ignore' must be one of skip, flag"),
        (lambda m: m["eval"].update(canary={"max_abs_logprob_diff": -1}), r"eval\.canary\.max_abs_logprob_diff must be a number >= 0"),
        (lambda m: m["eval"].update(canary={"threshold": 1}), r"eval\.canary\.threshold"),
    ],
)
def test_bad_manifest_field_is_named(tmp_path: Path, mutate, field: str) -> None:
    run = make_run(tmp_path)
    obj = json.loads(run.manifest_path.read_text())
    mutate(obj)
    run.manifest_path.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=f"run.json: field {field}"):
        load_manifest(run.manifest_path)


def test_jsonl_torn_tail_is_ignored_by_readers_and_cut_by_the_writer(tmp_path: Path) -> None:
    """One JSONL policy: a missing file is empty, a torn tail is ignored (or repaired), a bad line is named."""
    path = tmp_path / "log.jsonl"
    assert read_jsonl(path) == []
    path.write_bytes(b'{"step": 1}\n\n{"step": 2}\n{"step": 3, "x"')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    assert path.read_bytes().endswith(b'"x"')  # a reader never truncates a live file
    assert read_jsonl(path, repair=True) == [{"step": 1}, {"step": 2}]
    assert path.read_bytes() == b'{"step": 1}\n\n{"step": 2}\n'
    path.write_bytes(b'{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="log.jsonl:2"):
        read_jsonl(path)
    path.write_bytes(b'{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match="log.jsonl:2: expected a JSON object"):
        read_jsonl(path)


def test_jsonl_utf8_bom_is_accepted_and_a_json_array_is_named(tmp_path: Path) -> None:
    """Editors (Notepad, Excel exports) write a UTF-8 BOM: it is not data. A file that is one JSON array
    is named as such (not "malformed JSON line 1"), for protocol files and eval sets alike."""
    from ckpteval.jobs.eval.kinds.generate.evalsets import load_rows

    path = tmp_path / "set.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}')
    assert [r["answer"] for r in load_rows(path)] == ["2", "4"]  # no trailing newline: an eval set is whole
    path.write_bytes(b'\xef\xbb\xbf{"step": 1}\n')
    assert read_jsonl(path) == [{"step": 1}]
    for array in (b'[{"prompt": "1+1=", "answer": "2"}]\n', b'[\n {"prompt": "1+1=", "answer": "2"}\n]\n'):
        path.write_bytes(array)
        with pytest.raises(ValueError, match=r"set.jsonl: a JSON array, not JSONL: write one JSON object per line"):
            load_rows(path)
        with pytest.raises(ValueError, match="a JSON array, not JSONL"):
            read_jsonl(path)


def test_publish_verify_fast_and_full(tmp_path: Path) -> None:
    root = tmp_path / "staging"
    snap = publish_snapshot(root, 100, lambda d: write_tiny_shards(d))
    marker = verify_snapshot(snap, "full")
    assert marker.step == 100 and marker.weight_version == "100" and marker.mode == "staging"
    assert set(marker.files) == {"model-00000.safetensors", "model-00001.safetensors", "config.json"}
    assert [p.name for p in root.iterdir()] == ["step-0000000100"]

    flip_byte(snap / "model-00001.safetensors")  # inside tensor data: sizes and headers still fine
    verify_snapshot(snap, "fast")
    with pytest.raises(SnapshotCorrupt, match="CRC-32"):
        verify_snapshot(snap, "full")


def test_truncated_shard_and_missing_file(tmp_path: Path) -> None:
    snap = publish_snapshot(tmp_path, 5, lambda d: write_tiny_shards(d))
    shard = snap / "model-00000.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with pytest.raises(SnapshotCorrupt, match="size"):
        verify_snapshot(snap, "fast")
    shard.unlink()
    with pytest.raises(SnapshotMissing, match="missing"):
        verify_snapshot(snap, "fast")


def test_marker_that_lies_about_sizes_is_caught_by_header_check(tmp_path: Path) -> None:
    snap = publish_snapshot(tmp_path, 5, lambda d: write_tiny_shards(d))
    shard = snap / "model-00000.safetensors"
    with open(shard, "r+b") as f:  # grow the file and make the marker agree: the header still disagrees
        f.seek(0, os.SEEK_END)
        f.write(b"\0" * 64)
    marker = json.loads((snap / ".complete").read_text())
    marker["files"]["model-00000.safetensors"]["bytes"] += 64
    (snap / ".complete").write_text(json.dumps(marker))
    with pytest.raises(SnapshotCorrupt, match="tensor data ends"):
        verify_snapshot(snap, "fast")


def test_malformed_marker_is_corrupt_and_named(tmp_path: Path) -> None:
    snap = publish_snapshot(tmp_path, 7, lambda d: write_tiny_shards(d))
    (snap / ".complete").write_text('{"protocol": 2, "step": "seven"}')  # this protocol, a malformed field
    with pytest.raises(SnapshotCorrupt, match=r"\.complete: marker field step"):
        verify_snapshot(snap)
    with pytest.raises(ValueError, match=r"\.complete"):
        read_marker(snap)


def test_republish_same_step_is_idempotent(tmp_path: Path) -> None:
    first = publish_snapshot(tmp_path, 3, lambda d: write_tiny_shards(d, seed=1))
    before = (first / ".complete").read_bytes()
    again = publish_snapshot(tmp_path, 3, lambda d: write_tiny_shards(d, seed=2))
    assert again == first and (first / ".complete").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["step-0000000003"]


def test_mark_complete_reuse_mode(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-200"
    ckpt.mkdir()
    write_tiny_shards(ckpt)
    marker = mark_complete(ckpt, 200)
    assert marker.mode == "reuse" and verify_snapshot(ckpt, "full").step == 200


SLOW_PUBLISHER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from ckpteval.coord.snapshots.snapshot import publish_snapshot

    def write(d: Path) -> None:
        for i in range(1000):
            (d / f"model-{i:05d}.safetensors").write_bytes(b"x" * 4096)
            if i == 3:
                print("writing", flush=True)
            time.sleep(0.01)

    publish_snapshot(Path(sys.argv[1]), 42, write)
    """
)


def test_sigkill_mid_publish_is_never_discovered(tmp_path: Path) -> None:
    root = tmp_path / "staging"
    root.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", SLOW_PUBLISHER, str(root)], stdout=subprocess.PIPE,
                            cwd=Path(__file__).parents[1])
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"writing"
    disc = SnapshotDiscovery(root)
    assert disc.poll() == []
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert any(p.name.startswith(".tmp-") for p in root.iterdir())  # the torn copy is there...
    assert disc.poll() == [] and SnapshotDiscovery(root).poll() == []  # ...and never discovered


def test_snapshot_location_rules_build_and_parse_names_once(tmp_path: Path) -> None:
    """``step-N`` (staging, zero-padded so names sort by step) and ``checkpoint-N`` (reuse) round-trip."""
    assert snapshot_path(tmp_path, 7, "staging") == tmp_path / snapshot_dirname(7) == tmp_path / "step-0000000007"
    assert snapshot_path(tmp_path, 7, "reuse") == tmp_path / checkpoint_dirname(7) == tmp_path / "checkpoint-7"
    assert step_from_name(tmp_path / snapshot_dirname(120)) == 120
    assert step_from_name(tmp_path / checkpoint_dirname(5)) == 5
    assert step_from_name(tmp_path / "final") is None
    assert sorted(snapshot_dirname(s) for s in (100, 9, 20)) == [snapshot_dirname(s) for s in (9, 20, 100)]
