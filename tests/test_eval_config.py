"""Issue 17 §1 (dataset settings declared once, ``n_prompts`` from the file, subsets) and issue 22 items
2 and 4 (the engine URL forms people type; unknown keys in every config file refused with the closest
valid one). Real files, the real eval-config reader, real ``ckpteval worker`` processes and a real
``ckpteval serve`` HTTP engine."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.entries.rows import subset_rows
from ckpteval.coord.run.manifest import load_manifest, parse_manifest
from ckpteval.jobs.eval.engines.factory import normalize_spec, spec_kind
from ckpteval.jobs.eval.kinds.generate.evalsets import load_dataset
from ckpteval.jobs.eval.worker.evalconfig import create_run_from_config, read_eval_config
from ckpteval.jobs.lifecycle import EXIT_DONE, EXIT_USAGE
from tests.support.workers import finish, make_eval_run, publish_model, results, spawn, start_serve


def _config(tmp: Path, rows: int = 10, **entry: object) -> Path:
    (tmp / "qa.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                                          for i in range(rows)))
    (tmp / "cfg.json").write_text(json.dumps({"eval": {"datasets": [{"name": "qa", "path": "qa.jsonl", **entry}]}}))
    return tmp / "cfg.json"


def test_n_prompts_is_filled_from_the_file_when_the_run_is_created(tmp_path: Path) -> None:
    run = create_run_from_config(tmp_path / "run", _config(tmp_path), (tmp_path / "ckpts",))
    (spec,) = load_manifest(run.manifest_path).eval.entries
    assert spec.n_prompts == 10 and spec.n_shards == 1
    assert json.loads(run.manifest_path.read_text())["eval"]["datasets"][0]["n_prompts"] == 10
    with pytest.raises(ValueError, match=r"file .*qa.jsonl has 10 rows, n_prompts says 12"):
        read_eval_config(_config(tmp_path, n_prompts=12))


def test_a_subset_is_the_first_n_rows_or_a_seeded_sample_recorded_in_run_json(tmp_path: Path) -> None:
    first = create_run_from_config(tmp_path / "first", _config(tmp_path, subset=3), (tmp_path / "ckpts",))
    (spec,) = first.manifest().eval.entries
    assert (spec.n_prompts, spec.subset, spec.subset_seed) == (3, 3, None)
    assert [r["prompt"] for r in load_dataset(first, spec)] == ["0+1=", "1+1=", "2+1="]

    sampled = create_run_from_config(tmp_path / "sampled", _config(tmp_path, subset=4, subset_seed=7),
                                     (tmp_path / "ckpts",))
    on_disk = json.loads(sampled.manifest_path.read_text())["eval"]["datasets"][0]
    assert (on_disk["n_prompts"], on_disk["subset"], on_disk["subset_seed"]) == (4, 4, 7)
    (spec,) = sampled.manifest().eval.entries
    picked = subset_rows(10, spec)
    assert picked == sorted(picked) and len(set(picked)) == 4 and picked != [0, 1, 2, 3]
    assert [r["prompt"] for r in load_dataset(sampled, spec)] == [f"{i}+1=" for i in picked]
    assert subset_rows(10, dataclasses.replace(spec, subset_seed=8)) != picked  # the seed decides
    with pytest.raises(ValueError, match=r"subset 11 but the file has 10 rows"):
        read_eval_config(_config(tmp_path, subset=11))
    with pytest.raises(ValueError, match=r"subset_seed needs subset"):
        read_eval_config(_config(tmp_path, subset_seed=1))


def test_dataset_defaults_are_declared_once_on_the_dataclass() -> None:
    """The parser derives from GenerateEntry: an entry with only the required keys gets the dataclass's
    defaults, field for field."""
    obj = {"run_id": "r", "snapshot_roots": [], "eval": {"datasets": [{"name": "d", "path": "p", "n_prompts": 1}]}}
    (spec,) = parse_manifest(obj, Path("run.json")).eval.entries
    assert spec == GenerateEntry(name="d", path="p", n_prompts=1)


@pytest.mark.parametrize("where, edit, key, close", [
    ("dataset", {"max_new_token": 4}, "eval.datasets[0].max_new_token", "max_new_tokens"),
    ("dataset", {"temprature": 0.7}, "eval.datasets[0].temprature", "temperature"),
    ("eval", {"dataset": []}, "eval.dataset", "datasets"),
    ("lease", {"duration": 5}, "lease.duration", "duration_s"),
    ("top", {"snapshot_root": []}, "snapshot_root", "snapshot_roots"),
])
def test_unknown_keys_in_run_json_name_the_key_and_the_closest_valid_one(where: str, edit: dict, key: str,
                                                                        close: str) -> None:
    obj: dict = {"run_id": "r", "snapshot_roots": [], "lease": {},
                 "eval": {"datasets": [{"name": "d", "path": "p", "n_prompts": 1}]}}
    target = {"dataset": obj["eval"]["datasets"][0], "eval": obj["eval"], "lease": obj["lease"], "top": obj}[where]
    target.update(edit)
    with pytest.raises(ValueError, match=rf"run.json: field {re.escape(key)} is not a setting .*did you mean '{close}'"):
        parse_manifest(obj, Path("run.json"))


def test_a_typo_in_an_eval_config_is_exit_2_with_one_line(tmp_path: Path) -> None:
    cfg = _config(tmp_path, max_new_token=4)
    (tmp_path / "ckpts").mkdir()
    code, out = finish(spawn("worker", "--run-dir", str(tmp_path / "run"), "--watch", str(tmp_path / "ckpts"),
                             "--eval-config", str(cfg), "--once"), 60)
    assert code == EXIT_USAGE, out
    assert out.strip().count("\n") == 0 and "max_new_token is not a setting" in out and "'max_new_tokens'" in out
    assert not (tmp_path / "run").exists()
    (tmp_path / "cfg2.json").write_text(json.dumps({"evals": {}}))
    with pytest.raises(ValueError, match=r"cfg2.json: field evals is not a setting of an eval config .*'eval'"):
        read_eval_config(tmp_path / "cfg2.json")


@pytest.mark.parametrize("typed, canonical", [
    ("http://127.0.0.1:30000", "http:http://127.0.0.1:30000"),
    ("https://judge.example:443/", "http:https://judge.example:443/"),
    ("http:127.0.0.1:30000", "http:http://127.0.0.1:30000"),
    ("http:http://127.0.0.1:30000", "http:http://127.0.0.1:30000"),
    ("hf", "hf"),
])
def test_engine_url_forms_people_type_are_accepted(typed: str, canonical: str) -> None:
    assert normalize_spec(typed) == canonical
    assert spec_kind(typed) == canonical.partition(":")[0]


@pytest.mark.parametrize("bad", ["http://", "http:", "http:host:port"])
def test_an_http_spec_without_a_usable_url_is_refused_with_the_right_form(bad: str) -> None:
    with pytest.raises(ValueError, match=r"(http://HOST:PORT|needs a URL)"):
        spec_kind(bad)


def test_a_worker_given_a_plain_url_evaluates_through_the_server(tmp_path: Path) -> None:
    """``--engine http://HOST:PORT`` (no ``http:`` prefix) against ``ckpteval serve``: scored, exit 0."""
    run = make_eval_run(tmp_path, n_prompts=2, shard_size=2)
    snap = publish_model(tmp_path, run.snapshots, 1)
    url, proc = start_serve(snap, "0", tmp_path / "serve.log")
    try:
        assert url.startswith("http://")
        code, out = finish(spawn("worker", "--run-dir", str(run.path), "--once", "--engine", url,
                                 "--poll-interval", "0.05"), 120)
    finally:
        proc.terminate()
        proc.wait(30)
    assert code == EXIT_DONE, out
    (r,) = results(run).values()
    assert r.ok and r.worker["engine"] == f"http:{url}", r
