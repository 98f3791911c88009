"""The contamination gate (#41): planted exact, n-gram and paraphrased overlaps of a run's eval rows are found
in the trainer's data (JSONL, parquet, a verifiers environment, the files a trainer config names), each by
its tier, and nothing on clean data; a check runs once per run; the clean series and ``status`` line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckpteval.coord.entries.env import EnvEntry
from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.results.contamination import read_matches
from ckpteval.coord.results.files import ok_result, write_result
from ckpteval.coord.results.points import derive_point
from ckpteval.coord.run.ledger import Ledger
from ckpteval.coord.run.manifest import EvalSpec, RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.eval.contamination.index import EvalIndex, grams
from ckpteval.jobs.eval.contamination.main import main
from ckpteval.jobs.eval.contamination.text import tokens
from ckpteval.jobs.ingest import ingest_point
from ckpteval.jobs.metrics import MetricsSink
from ckpteval.jobs.views.status.data import collect_status
from ckpteval.jobs.views.status.text import render
from tests.support.planted import exact_copy, ngram_copy, paraphrase, prompts

EVAL = prompts(40, seed=1)
CLEAN = prompts(3000, seed=2)
PLANTED = {3: "exact", 7: "ngram", 11: "near", 20: "ngram"}  # eval row -> the tier that must find it (20: after a system turn)


def make_run(tmp: Path, entries: tuple = (), trainer: dict | None = None) -> RunDir:
    entry = GenerateEntry(name="qa", path="data/qa.jsonl", n_prompts=len(EVAL), shard_size=len(EVAL))
    manifest = RunManifest(run_id="c", eval=EvalSpec(entries=(entry, *entries)), snapshot_roots=(), trainer=trainer or {})
    run = RunDir.create(tmp / "run", manifest)
    write_jsonl(run.data / "qa.jsonl", [{"prompt": p, "answer": "1"} for p in EVAL])
    return run


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def planted_data(tmp: Path) -> list[Path]:
    """The clean rows with three overlaps planted in a JSONL file and one in a verl-style parquet file (chat messages)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": p} for p in CLEAN[:2000]]
    rows[100] = {"prompt": exact_copy(EVAL[3])}
    rows[200] = {"prompt": ngram_copy(EVAL[7], CLEAN[2500])}
    rows[300] = {"prompt": paraphrase(EVAL[11], seed=11)}
    messages = [[{"role": "user", "content": p}] for p in CLEAN[2000:]]
    messages[5] = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": EVAL[20]}]
    pq.write_table(pa.table({"prompt": messages, "data_source": ["x"] * len(messages)}), tmp / "train.parquet")
    return [write_jsonl(tmp / "train.jsonl", rows), tmp / "train.parquet"]


def test_planted_overlaps_are_found_each_by_its_tier_and_no_clean_row_is_reported(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    jsonl, parquet = planted_data(tmp_path)
    assert main([str(run.path), "--train", str(jsonl), "--train", str(parquet)]) == 0
    record = read_matches(run.path)
    found = {m["row"]: m["tier"] for m in record["datasets"]["qa"]["matched"]}
    assert found == PLANTED
    where = {m["row"]: (Path(m["examples"][0]["file"]).name, m["examples"][0]["train_row"])
             for m in record["datasets"]["qa"]["matched"]}
    assert where == {3: ("train.jsonl", 100), 7: ("train.jsonl", 200), 11: ("train.jsonl", 300),
                     20: ("train.parquet", 5)}
    assert record["train_rows"] == len(CLEAN)


def test_worker_processes_find_what_one_process_finds(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    files = planted_data(tmp_path)
    args = [str(run.path), *(a for f in files for a in ("--train", str(f)))]
    assert main(args) == 0
    one = read_matches(run.path)
    assert main([*args, "--procs", "2", "--force"]) == 0
    two = read_matches(run.path)
    assert two["checked_at"] != one["checked_at"] and two["datasets"] == one["datasets"]
    assert two["sources"] == one["sources"] and len(one["datasets"]["qa"]["matched"]) == len(PLANTED)


def test_clean_training_data_reports_nothing(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    clean = write_jsonl(tmp_path / "clean.jsonl", [{"question": p} for p in CLEAN])
    assert main([str(run.path), "--train", str(clean), "--fail-on-match"]) == 0
    assert read_matches(run.path)["datasets"]["qa"]["matched"] == []


def test_each_tier_alone_finds_only_its_own_overlaps() -> None:
    index = EvalIndex(EVAL)
    planted = [exact_copy(EVAL[0]), ngram_copy(EVAL[1], CLEAN[0]), paraphrase(EVAL[2], seed=2)]
    assert {(h.eval_id, h.train) for h in index.scan(planted, ("exact",))} == {(0, 0)}
    assert {(h.eval_id, h.train) for h in index.scan(planted, ("ngram",))} == {(0, 0), (1, 1)}
    near = {(h.eval_id, h.train) for h in index.scan(planted, ("near",))}
    assert (2, 2) in near and (1, 1) not in near  # a 15-word span in a longer row is no near-duplicate
    words = EVAL[3].split()
    shortened = " ".join(words[: int(len(words) * 0.75)])  # a smaller set, still within the size bound
    assert [(h.eval_id, h.similarity >= 0.6) for h in index.scan([shortened], ("near",))] == [(3, True)]


TEMPLATE = ("Solve the following math problem efficiently and clearly. The last line of your response should be "
            "of the form Answer: $ANSWER where $ANSWER is the answer to the problem.\n\n{}\n\nRemember to put "
            "your answer on its own line after \"Answer:\", and you do not need to use a \\boxed command.")


def test_a_prompt_template_shared_with_the_training_prompts_matches_nothing_by_itself() -> None:
    """A catalog set's template (here simple-evals' math one, 40 words) in every eval row and every training
    row: no row matches for it, and an eval question under it in training is still found."""
    index = EvalIndex([TEMPLATE.format(p) for p in EVAL], groups=["qa"] * len(EVAL))
    train = [TEMPLATE.format(p) for p in CLEAN[:500]]
    assert index.scan(train) == []
    planted = [TEMPLATE.format(EVAL[4]), TEMPLATE.format(paraphrase(EVAL[6], seed=6))]
    assert {(h.eval_id, h.train, h.tier) for h in index.scan(planted)} == {(4, 0, "exact"), (6, 1, "near")}
    bare = EvalIndex([TEMPLATE.format(p) for p in EVAL], groups=[str(i) for i in range(len(EVAL))])  # sets of one row: no template
    assert len({h.train for h in bare.scan(train)}) == len(train)  # every training row "matches"


def test_ngrams_are_lm_eval_janitors() -> None:
    """Normalization and 13-grams agree with lm-evaluation-harness's decontamination janitor on ASCII text."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its C++ warning
        from lm_eval.decontamination.janitor import Janitor, word_ngrams
    janitor = Janitor(ngram_n=13)
    for text in [*EVAL[:5], "Hello, World! It's (really) a 13-gram: one two three four five six seven eight."]:
        ours = [b" ".join(g).decode() for g in grams(tokens(text), 13)]
        assert ours == list(word_ngrams(janitor.normalize_string(text), 13))


def test_bad_training_data_is_refused_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path)
    missing = tmp_path / "nope" / "train.parquet"
    assert main([str(run.path), "--train", str(missing)]) == 2
    assert f"{missing}: training data file not found" in capsys.readouterr().err
    torn = tmp_path / "torn.jsonl"
    torn.write_text('{"prompt": "a"}\n{"prompt": \n')
    assert main([str(run.path), "--train", str(torn)]) == 2
    assert f"{torn}:2: not a JSON line" in capsys.readouterr().err
    csv = tmp_path / "train.csv"
    csv.write_text("prompt\nx\n")
    assert main([str(run.path), "--train", str(csv)]) == 2
    assert f"{csv}: training data must be .jsonl, .json, .parquet" in capsys.readouterr().err
    config = tmp_path / "config.yaml"
    config.write_text("data:\n  train_files: data/gsm8k/train.parquet\n")
    assert main([str(run.path), "--trainer-config", str(config), "--layout", "verl"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'data/gsm8k/train.parquet'}: training data named by {config} (verl) not found" in err
    assert read_matches(run.path) is None  # nothing published


def test_a_check_runs_once_until_its_inputs_change(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    data = write_jsonl(tmp_path / "t.jsonl", [{"prompt": p} for p in CLEAN[:50]])
    assert main([str(run.path), "--train", str(data)]) == 0
    first = read_matches(run.path)
    assert main([str(run.path), "--train", str(data)]) == 0
    assert read_matches(run.path)["checked_at"] == first["checked_at"]  # the same inputs: not checked again
    write_jsonl(data, [{"prompt": p} for p in [*CLEAN[:50], EVAL[0]]])
    assert main([str(run.path), "--train", str(data), "--fail-on-match"]) == 1
    assert [m["row"] for m in read_matches(run.path)["datasets"]["qa"]["matched"]] == [0]


def test_trainer_configs_name_the_data_each_layout_reads(tmp_path: Path) -> None:
    """verl's data.train_files, TRL's dataset mixture, NeMo-RL's data.train and prime-rl's environments (a
    verifiers taskset, whose tasks an env entry's rows also name: every task is found in itself)."""
    taskset = {"taskset": "tests.support.vf_arith"}
    env = EnvEntry(name="arith", path="data/arith.jsonl", n_prompts=2, env="verifiers", env_options=taskset)
    run = make_run(tmp_path, (env,))
    write_jsonl(run.data / "arith.jsonl", [{"task": 0}, {"task": 1}])
    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"prompt": EVAL[5]}])
    (tmp_path / "verl.yaml").write_text("data:\n  train_files: [d/a.jsonl]\n")
    (tmp_path / "trl.yaml").write_text("datasets:\n  - path: d\n    data_files: a.jsonl\n")
    (tmp_path / "orch.toml").write_text('[[orchestrator.train.env]]\nid = "tests.support.vf_arith"\n')
    (tmp_path / "nemo.yaml").write_text("data:\n  train:\n    data_path: d/a.jsonl\n    input_key: prompt\n")
    for config, layout in [("verl.yaml", "verl"), ("trl.yaml", "hf-trainer"), ("nemo.yaml", "nemo-rl")]:
        assert main([str(run.path), "--trainer-config", str(tmp_path / config), "--layout", layout]) == 0
        assert [m["row"] for m in read_matches(run.path)["datasets"]["qa"]["matched"]] == [5], layout
    assert main([str(run.path), "--trainer-config", str(tmp_path / "orch.toml"), "--layout", "prime-rl"]) == 0
    record = read_matches(run.path)
    assert {m["row"]: m["tier"] for m in record["datasets"]["arith"]["matched"]} == {0: "exact", 1: "exact"}
    assert record["sources"] == [{"path": "verifiers:tests.support.vf_arith", "rows": 4}]


def test_a_watched_nemo_rl_run_names_its_data_in_its_saves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No --train: the newest save of the run's watched NeMo-RL dir holds the config naming the data."""
    data = write_jsonl(tmp_path / "train.jsonl", [{"question": EVAL[9]}])
    for step, path in [(1, tmp_path / "gone.jsonl"), (3, data)]:
        save = tmp_path / "ckpts" / f"step_{step}"
        (save / "policy" / "weights").mkdir(parents=True)
        (save / "training_info.json").write_text("{}")
        (save / "config.yaml").write_text(f"data:\n  train:\n    data_path: {path}\n")
    run = make_run(tmp_path, trainer={"foreign_roots": [str(tmp_path / "ckpts")]})
    assert main([str(run.path)]) == 0
    record = read_matches(run.path)
    assert record["sources"] == [{"path": str(data), "rows": 1}]
    assert [m["row"] for m in record["datasets"]["qa"]["matched"]] == [9]
    bare = make_run(tmp_path / "other")
    assert main([str(bare.path)]) == 2
    assert "no training data named: give --train PATH" in capsys.readouterr().err


def test_the_clean_series_is_logged_beside_the_point_and_status_names_the_finding(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    data = write_jsonl(tmp_path / "t.jsonl", [{"prompt": EVAL[1]}, {"prompt": EVAL[2]}])
    assert main([str(run.path), "--train", str(data)]) == 0
    manifest, step = run.manifest(), 4
    (unit,) = manifest.eval.entries[0].units(step)
    scores = [1.0] * len(EVAL)
    scores[1] = scores[2] = 0.0  # the two contaminated prompts fail, the rest pass
    write_result(run.results, ok_result(unit, scores, [str(step)] * len(EVAL)))
    results = {unit: read_result(run, unit)}
    point = ingest_point(manifest, step, results, sink=MetricsSink(run.metrics_path), ledger=Ledger(run.ledger_path),
                         lag_steps=0)
    assert point is not None and point.datasets["qa"].score == pytest.approx(38 / 40)
    logged = json.loads(run.metrics_path.read_text().splitlines()[-1])
    assert logged["eval/qa"] == pytest.approx(38 / 40)
    assert logged["eval/qa/clean"] == 1.0 and logged["eval/qa/clean/prompts"] == 38
    lines = [str(x) for x in render(collect_status(run.path))]
    assert "contamination qa: 2 of 40 rows found in training data (exact 2); eval/qa/clean scores the rest" in lines
    assert derive_point(manifest, step, results).complete


def read_result(run: RunDir, unit):  # type: ignore[no-untyped-def]
    from ckpteval.coord.results.files import ResultIndex

    return ResultIndex(run.results, run.manifest()).refresh()[unit]


CATALOG = Path(__file__).resolve().parents[1] / "jobs" / "eval" / "catalog" / "data"


def catalog_prompts(name: str) -> list[str]:
    path = CATALOG / name / "rows.jsonl"
    if not path.is_file():
        pytest.skip(f"{path}: the catalog's vendored rows are not in this tree")
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def test_real_benchmarks_distinct_sets_share_nothing_and_mmlu_stem_holds_math_problems() -> None:
    """Real text: GSM8K and AIME 2024/2025 against MATH-500 as training data report nothing; MMLU-STEM holds
    MATH problems with its answer choices appended (known overlap), each found by the 13-gram tier."""
    math500 = catalog_prompts("math500")
    sets = {name: catalog_prompts(name) for name in ("gsm8k", "aime24", "aime25")}
    distinct = EvalIndex([p for rows in sets.values() for p in rows], groups=[n for n, rows in sets.items() for _ in rows])
    assert distinct.scan(math500) == []
    mmlu = catalog_prompts("mmlu_stem")
    hits = [h for h in EvalIndex(mmlu, groups=["mmlu"] * len(mmlu)).scan(math500) if h.tier == "ngram"]
    assert len(hits) >= 5
    for h in hits:  # the MATH problem is the MMLU question, before its choices
        assert b" ".join(tokens(math500[h.train])) in b" ".join(tokens(mmlu[h.eval_id]))
