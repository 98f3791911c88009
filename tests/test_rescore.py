"""Kept completions and ``ckpteval rescore``, on real tiny-model runs evaluated by the real hf worker.

One run is generated per module (the worker's cost is paid once); each test copies it, so they are independent.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from ckpteval.coord.results.completions import (
    PER_SAMPLE,
    completions_path,
    content_digest,
    read_completions,
    rows_digest,
)
from ckpteval.coord.results.files import ResultIndex
from ckpteval.coord.results.scorings import scoring_results
from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.eval.worker.options import WorkerOptions
from ckpteval.jobs.eval.worker.rescore import main as rescore_main
from ckpteval.jobs.lifecycle import EXIT_DONE
from ckpteval.jobs.views.status.main import collect_status
from tests.support.workers import (
    PYTHON,
    REPO,
    make_eval_run,
    publish_model,
    results,
    run_inprocess,
    worker_env,
)

QUIET = {"out": lambda _line: None}
OTHER = "tests.support.workers:completion_hash"  # a scorer that reads the exact text: every score changes


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    tmp = tmp_path_factory.mktemp("kept")
    run = make_eval_run(tmp, n_prompts=6, shard_size=3, scorer="tests.support.workers:digit_first", n_samples=2,
                        max_new_tokens=3, engine={"hf": {"max_batch_size": 12}})
    manifest = run.manifest()
    spec = manifest.eval.entries[0]
    from dataclasses import replace

    from ckpteval.coord.run.manifest import save_manifest
    save_manifest(run.manifest_path, replace(manifest, eval=replace(manifest.eval, entries=(
        replace(spec, temperature=1.0, seed=7),))))
    for step in (0, 10):
        publish_model(tmp, run.snapshots, step)
    opts = WorkerOptions(run_dir=run.path, poll_interval_s=0.05, pin_timeout_s=0.3, once=True)
    code, _ = run_inprocess(opts, **QUIET)
    assert code == EXIT_DONE
    return run


@pytest.fixture
def run(evaluated: RunDir, tmp_path: Path) -> RunDir:
    shutil.copytree(evaluated.path, tmp_path / "run", symlinks=True)
    return RunDir.open(tmp_path / "run")


def test_each_unit_keeps_its_completions_beside_its_result(run: RunDir) -> None:
    got = results(run)
    assert len(got) == 4 and all(r.ok for r in got.values())
    for unit, r in got.items():
        kept = read_completions(completions_path(run.results, unit))
        assert kept.unit == unit and kept.lease_token == r.lease_token
        assert len(kept.text) == len(r.scores) == 6 and len(kept.prompts) == 3
        assert kept.weight_version == r.weight_versions
        assert all(isinstance(s, int) for s in kept.seed) and len(set(kept.seed)) == 6  # sampled: a seed each
        assert all(n >= 1 for n in kept.n_tokens) and all(p for p in kept.prompt_tokens)
        # the scorer's answer is the whole completion: the kept text is the text that was scored
        assert [t.strip() for t in kept.text] == list(r.answers)


def test_a_partial_or_corrupt_completions_file_is_refused_naming_it(run: RunDir) -> None:
    unit = sorted(results(run))[0]
    path = completions_path(run.results, unit)
    data = path.read_bytes()
    path.write_bytes(data[:-9])  # cut inside the gzip trailer
    with pytest.raises(ValueError, match=str(path)):
        read_completions(path)
    body = json.loads(gzip.decompress(data))
    body["text"] = body["text"][:-1]  # a whole gzip of a record with one text missing
    path.write_bytes(gzip.compress(json.dumps(body).encode()))
    with pytest.raises(ValueError, match="texts but"):
        read_completions(path)


def test_kept_text_edited_after_scoring_is_refused_naming_the_file(run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    """The result binds its kept text (#37): a text edited under an unchanged lease token is refused by the
    reader (the file's own sha256), and one rewritten whole (a fresh sha256) by rescore (the result's)."""
    unit = sorted(results(run))[0]
    path = completions_path(run.results, unit)
    body = json.loads(gzip.decompress(path.read_bytes()))
    assert results(run)[unit].completions_sha256 == body["sha256"]
    body["text"][0] += "7"  # one sample's text changed; lease token and everything else as written
    path.write_bytes(gzip.compress(json.dumps(body).encode()))
    with pytest.raises(ValueError, match=f"{path}: its text does not match the sha256 written with it"):
        read_completions(path)
    body["sha256"] = content_digest({k: body[k] for k in ("unit", "rows_sha256", "prompts", *PER_SAMPLE)})
    path.write_bytes(gzip.compress(json.dumps(body).encode()))  # rewritten whole: the file agrees with itself
    read_completions(path)
    assert rescore_main([str(run.path), "--name", "x"]) == 0
    err = capsys.readouterr().err
    assert f"{path}: its text does not match the completions_sha256 its result recorded" in err
    own = ResultIndex(run.path / "scorings" / "x" / "results").refresh()
    assert unit not in own and len(own) == len(results(run)) - 1


def test_rescore_with_the_same_scorer_equals_the_original_exactly(run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    assert rescore_main([str(run.path), "--name", "same"]) == 0
    original = results(run)
    rescored, errors = scoring_results(run, "same")
    assert not errors
    own = ResultIndex(run.path / "scorings" / "same" / "results").refresh()
    assert set(own) == set(original)
    for unit, r in original.items():
        again = own[unit]
        assert again.scores == r.scores and again.answers == r.answers  # exact, not approximately
        assert again.scorer == r.scorer and again.weight_versions == r.weight_versions
        assert again.worker["rescore_of"] == unit.result_name_at(0)
    assert "4 units re-scored here" in capsys.readouterr().out


def test_rescore_publishes_a_new_scoring_and_views_name_it(run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    before = {p: p.read_bytes() for p in run.results.rglob("*") if p.is_file()}
    assert rescore_main([str(run.path), "--scorer", OTHER, "--steps", "10", "--name", "hash"]) == 0
    capsys.readouterr()
    assert {p: p.read_bytes() for p in run.results.rglob("*") if p.is_file()} == before  # the original stays
    shown = collect_status(run.path, scoring="hash")
    plain = collect_status(run.path)
    assert shown["scoring"] == "hash" and plain["scoring"] is None
    by_step = {p["step"]: p for p in shown["points"]}
    orig = {p["step"]: p for p in plain["points"]}
    assert by_step[0]["datasets"] == orig[0]["datasets"]  # step 0 not re-scored: the original shows
    assert by_step[10]["datasets"]["addition"]["score"] != orig[10]["datasets"]["addition"]["score"]
    assert not by_step[10]["mixed_scorers"]
    own = ResultIndex(run.path / "scorings" / "hash" / "results").refresh()
    assert {u.step for u in own} == {10} and all(r.scorer["name"] == OTHER for r in own.values())
    from ckpteval.jobs.decide.compare import main as compare_main

    # step 0 (not re-scored) against step 10 re-scored by another scorer: refused, naming the scorer; allowed, noted
    assert compare_main([str(run.path), "--steps", "0", "10", "--scoring", "hash"]) == 2
    assert "were scored by different scorers (name" in capsys.readouterr().err
    compared = {}
    for extra in ([], ["--scoring", "hash", "--allow-scorer-mismatch"]):
        assert compare_main([str(run.path), "--steps", "0", "10", "--json", *extra]) == 0
        compared[bool(extra)] = json.loads(capsys.readouterr().out)
    assert "scorer_notes" in compared[True]["datasets"][0] and "scorer_notes" not in compared[False]["datasets"][0]
    assert compared[True]["b"].endswith("(scoring hash)") and "scoring" not in compared[False]["b"]
    assert compared[True]["datasets"][0]["b"] == pytest.approx(by_step[10]["datasets"]["addition"]["score"])
    assert compared[False]["datasets"][0]["b"] == pytest.approx(orig[10]["datasets"]["addition"]["score"])
    # exactly once: a second rescore finds every unit done and writes nothing
    assert rescore_main([str(run.path), "--scorer", OTHER, "--steps", "10", "--name", "hash"]) == 0
    assert len(list((run.path / "scorings" / "hash" / "results").rglob("*.json"))) == 2
    # a name is one scoring: another scorer under it is refused
    assert rescore_main([str(run.path), "--name", "hash"]) == 2


def test_changed_rows_or_foreign_completions_are_passed_over(run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    units = sorted(results(run))
    data = run.path / "data" / "addition.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[0]["answer"] = "999"  # shard 0's gold changed after generation
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = (completions_path(run.results, u) for u in units if u.step == 10)
    shutil.copy(b, a)  # shard 0 of step 10 now holds shard 1's completions
    assert rescore_main([str(run.path), "--name", "x"]) == 0
    err = capsys.readouterr().err
    own = ResultIndex(run.path / "scorings" / "x" / "results").refresh()
    assert sorted(own) == [u for u in units if u.shard == 1]
    assert "changed since it was generated" in err and "belongs to another result" in err
    assert rows_digest([rows[1]]) != rows_digest([rows[0]])


def test_concurrent_rescores_share_the_units_exactly_once(run: RunDir) -> None:
    cmd = [PYTHON, "-m", "ckpteval.jobs.cli", "rescore", str(run.path), "--scorer", OTHER, "--name", "par",
           "--poll-interval", "0.05"]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]  # two interpreters starting on a loaded machine
    assert all(p.returncode == 0 for p in procs), outs
    written = sum(int(o.split("scoring par: ")[1].split(" ")[0]) for o in outs)
    assert written == 4  # each unit scored by exactly one of them
    assert not (run.path / "scorings" / "par" / "results" / "duplicates").exists()
    assert not list((run.path / "scorings" / "par" / "leases").rglob("*.lock"))


def test_keeping_off_keeps_nothing_and_rescore_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_eval_run(tmp_path, n_prompts=2, shard_size=2)
    publish_model(tmp_path, run.snapshots, 0)
    opts = WorkerOptions(run_dir=run.path, poll_interval_s=0.05, pin_timeout_s=0.3, once=True, keep_completions=False)
    assert run_inprocess(opts, **QUIET)[0] == EXIT_DONE
    (unit, r), = results(run).items()
    assert r.ok and not completions_path(run.results, unit).exists()
    assert rescore_main([str(run.path), "--name", "none"]) == 0
    assert "no kept completions" in capsys.readouterr().err
    assert not list((run.path / "scorings" / "none" / "results").rglob("*.json"))


def test_a_bad_scorer_or_selection_is_one_error_and_writes_nothing(run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    assert rescore_main([str(run.path), "--scorer", "no_such_scorer"]) == 2
    assert rescore_main([str(run.path), "--scorer", "exact", "--scorer-options", '{"no_such_option": 1}']) == 2
    assert rescore_main([str(run.path), "--datasets", "nope"]) == 2
    assert rescore_main([str(run.path), "--scorer-options", "[1]"]) == 2
    err = capsys.readouterr().err
    assert err.count("ckpteval rescore:") == 4 and "Traceback" not in err
    assert not (run.path / "scorings").exists()


def test_rescore_applies_a_reasoning_strip_to_the_kept_text(run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    """#28: a reasoning strip applied later to kept completions. Forced reasoning whose end never appears leaves
    no answer (every score 0, never scored from the trace); one whose opening tag never appears leaves the whole
    text the answer (the original scores, exactly). A tokenizer-named end needs the snapshot: refused."""
    original = results(run)
    assert any(s > 0 for r in original.values() for s in r.scores)  # else "all 0" below proves nothing
    assert rescore_main([str(run.path), "--reasoning", '{"end": "</think>"}', "--name", "forced"]) == 0
    assert rescore_main([str(run.path), "--reasoning", '{"end": "</think>", "start": "<think>"}',
                         "--name", "unforced"]) == 0
    forced = ResultIndex(run.path / "scorings" / "forced" / "results").refresh()
    unforced = ResultIndex(run.path / "scorings" / "unforced" / "results").refresh()
    for unit, r in original.items():
        assert list(forced[unit].scores) == [0.0] * len(r.scores)
        assert forced[unit].scorer["reasoning"] == {"end": "</think>", "start": None, "always": True}
        assert unforced[unit].scores == r.scores and unforced[unit].answers == r.answers
    capsys.readouterr()
    assert rescore_main([str(run.path), "--reasoning", '{"end": "tokenizer"}']) == 2
    assert "needs the snapshot's tokenizer" in capsys.readouterr().err


def test_rescore_counts_reasoning_tokens_and_can_score_without_a_strip(run: RunDir) -> None:
    """#37 (lows): a re-scoring counts reasoning tokens with the snapshot's tokenizer, as the worker does (it
    dropped them); ``--reasoning none`` scores the whole text, the dataset's own strip off."""
    from dataclasses import replace

    from ckpteval.jobs.eval.worker.rescore import Rescoring

    original = results(run)
    assert rescore_main([str(run.path), "--reasoning", '{"end": "</think>"}', "--name", "forced"]) == 0
    forced = ResultIndex(run.path / "scorings" / "forced" / "results").refresh()
    for unit, r in original.items():  # forced reasoning never ended: every token of every sample is reasoning
        assert forced[unit].extras["reasoning_tokens"] == pytest.approx(r.extras["completion_tokens"])
    assert rescore_main([str(run.path), "--reasoning", "none", "--name", "plain"]) == 0
    plain = ResultIndex(run.path / "scorings" / "plain" / "results").refresh()
    assert all(plain[unit].scores == r.scores for unit, r in original.items())
    spec = run.manifest().entry(next(iter(original)).dataset)
    thinking = replace(spec, reasoning={"end": "</think>"})
    assert Rescoring(None, None, no_reasoning=True).spec(thinking).reasoning is None
    assert Rescoring(None, None).spec(thinking).reasoning == thinking.reasoning
    with pytest.raises(ValueError, match="none, or a strip, not both"):
        Rescoring(None, None, {"end": "</think>"}, no_reasoning=True)
