"""lm-eval tasks as work units (issue 10 §6), end to end and offline.

A real run with a ``kind: lm_eval`` entry over the task YAMLs shipped in ``tests/lmeval_task/`` (a local
JSONL, nothing downloaded; ``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``), a real snapshot of the tiny
reference model, and a real ``ckpteval worker`` process on the hf engine: the harness's own HFLM adapter
wraps the engine's loaded model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckpteval.coord.entries.lm_eval import LmEvalEntry
from ckpteval.coord.results.files import parse_result
from ckpteval.coord.results.points import derive_point, point_metrics
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest, load_manifest, parse_manifest
from ckpteval.coord.run.rundir import RunDir, unit_dir
from ckpteval.coord.work.units import WorkUnit, units_for_step
from ckpteval.jobs.eval.kinds.env.endpoint import reply_version
from ckpteval.jobs.views.plot import plot_series
from ckpteval.jobs.views.status.main import collect_status, points_table
from tests.support.workers import REPO, finish, publish_model, results, spawn, version

pytest.importorskip("lm_eval", reason="the harness extra (lm-eval) is not installed")

TASK_DIR = REPO / "tests" / "lmeval_task"
TASKS = ("ckpteval_addition_gen", "ckpteval_addition_mc")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def harness_run(tmp: Path, generate: bool = True, **fields: object) -> RunDir:
    """A run with the lm-eval entry ``harness`` (``generate``: and the built-in addition set before it)."""
    from ckpteval.jobs.eval.kinds.generate.evalsets import write_addition_dataset

    run = RunDir.create(tmp / "run")
    spec = write_addition_dataset(run, n=4, shard_size=4)
    harness = LmEvalEntry(name="harness", tasks=TASKS, include_path=str(TASK_DIR), include_defaults=False,
                          batch_size=4, **fields)  # type: ignore[arg-type]
    manifest = RunManifest(
        run_id="harness-run",
        eval=EvalSpec(entries=(spec, harness) if generate else (harness,)),
        snapshot_roots=(str(run.snapshots),),
        lease=LeaseSettings(30.0, 5.0),
    )
    return RunDir.create(run.path, manifest)


def test_lm_eval_entry_round_trips_through_run_json_as_a_dataset_entry(tmp_path: Path) -> None:
    run = harness_run(tmp_path)
    on_disk = json.loads(run.manifest_path.read_text())
    kinds = [d.get("kind", "generate") for d in on_disk["eval"]["datasets"]]
    assert kinds == ["generate", "lm_eval"]
    manifest = load_manifest(run.manifest_path)
    assert manifest.entry("harness").tasks == TASKS
    assert [u.dataset for u in units_for_step(manifest, 5)] == ["addition", "harness", "harness"]
    assert [u.shard for u in units_for_step(manifest, 5) if u.dataset == "harness"] == [0, 1]


@pytest.mark.parametrize(
    "entry, why",
    [
        ({"tasks": []}, "tasks must be a non-empty list"),
        ({"tasks": ["a", "a"]}, "has duplicates"),
        ({"tasks": ["a"], "limit": 0}, "limit must be >= 1"),
        ({"tasks": ["a"], "include_defaults": False}, "no include_path"),
        ({"tasks": ["a"], "fewshots": 3}, "fewshots is not a setting of a dataset of kind 'lm_eval' .*did you mean 'num_fewshot'"),
        ({"tasks": ["a"], "kind": "lmeval"}, "kind 'lmeval' must be one of generate, lm_eval, env, catalog \\(did you mean 'lm_eval'"),
        ({"tasks": ["a"], "chat_template_kwargs": {"enable_thinking": False}},
         "chat_template_kwargs needs apply_chat_template true"),
        ({"tasks": ["a"], "apply_chat_template": True, "chat_template_kwargs": {"add_generation_prompt": False}},
         "chat_template_kwargs sets add_generation_prompt, which rendering sets itself"),
    ],
)
def test_bad_lm_eval_entries_are_one_error_naming_the_field(entry: dict, why: str) -> None:
    obj = {"run_id": "r", "snapshot_roots": ["/tmp/x"],
           "eval": {"datasets": [{"kind": "lm_eval", "name": "h", **entry}]}}
    with pytest.raises(ValueError, match=why):
        parse_manifest(obj, Path("run.json"))


def test_an_lm_eval_task_runs_end_to_end_offline_through_a_worker_on_the_pinned_hf_engine(tmp_path: Path) -> None:
    run = harness_run(tmp_path)
    publish_model(tmp_path, run.snapshots, 5)
    proc = spawn("worker", "--run-dir", str(run.path), "--once", "--poll-interval", "0.2", env=OFFLINE)
    code, out = finish(proc, timeout=300)
    assert code == 0, out
    got = results(run)
    for i, task in enumerate(TASKS):
        r = got[WorkUnit(5, "harness", i)]
        assert r.ok, (task, r.skip_reason, r.message)
        assert r.weight_versions == (version(run, 5),) * 2  # read back before and after the task
        assert r.scores == ()
        raw = json.loads((unit_dir(run.results, r.unit.step) / r.unit.result_name).read_text())
        assert parse_result(raw, Path("x")).metrics == r.metrics  # the file carries them
        assert r.scorer["name"] == "lm_eval" and r.scorer["lm_eval"] != "unknown", r.scorer  # what scored it
        assert r.scorer["chat_template_kwargs"] == {} and r.scorer["apply_chat_template"] is False
    gen, mc = got[WorkUnit(5, "harness", 0)].metrics, got[WorkUnit(5, "harness", 1)].metrics
    assert set(gen) == {"exact_match", "n"} and 0.0 <= gen["exact_match"] <= 1.0 and gen["n"] == 8.0
    assert "acc" in mc and mc["acc"] in {i / 8 for i in range(9)}  # 8 docs in the shipped JSONL
    point = derive_point(run.manifest(), 5, got)
    assert point.complete
    metrics = point_metrics(point)
    assert metrics["eval/ckpteval_addition_gen/exact_match"] == gen["exact_match"]
    assert metrics["eval/ckpteval_addition_mc/acc"] == mc["acc"]
    assert metrics["eval/ckpteval_addition_mc/weight_version/mean"] == 5.0
    assert metrics["eval/ckpteval_addition_mc/weight_version/mixed_version_ratio"] == 0.0
    assert "eval/addition" in metrics  # the JSONL dataset of the same point is untouched
    status = collect_status(run.path)  # status and plot show the task metrics
    assert status["harness_metrics"] == ["ckpteval_addition_gen/exact_match", "ckpteval_addition_mc/acc"]
    assert "ckpteval_addition_mc/acc" in [c.header for c in points_table(status).columns]
    assert plot_series(status)["series"]["ckpteval_addition_mc/acc"] == ([5], [mc["acc"]])


def test_status_shows_lm_eval_tasks_where_generate_sets_are_with_stderr_n_and_their_pin_proof(tmp_path: Path) -> None:
    """A run of lm-eval tasks only: ``status --json`` puts each task in ``points[].datasets`` (no second place),
    with its score, stderr, n and the versions read back around it; the text view's pin proof shows them."""
    run = harness_run(tmp_path, generate=False, bootstrap_iters=100)  # > 0: lm-eval computes stderrs (mean: closed form)
    publish_model(tmp_path, run.snapshots, 5)
    code, out = finish(spawn("worker", "--run-dir", str(run.path), "--once", "--poll-interval", "0.2", env=OFFLINE),
                       timeout=300)
    assert code == 0, out
    mc = results(run)[WorkUnit(5, "harness", 1)].metrics
    code, raw = finish(spawn("status", "--json", str(run.path)), timeout=60)
    (point,) = json.loads(raw)["points"]
    assert "metrics" not in point
    task = point["datasets"]["ckpteval_addition_mc"]
    assert task["kind"] == "lm_eval" and task["metric"] == "acc" and task["score"] == mc["acc"]
    assert task["stderr"] == mc["acc_stderr"] and task["n"] == 8
    assert task["weight_version_mean"] == 5.0 and task["mixed_version_ratio"] == 0.0
    assert point["datasets"]["ckpteval_addition_gen"]["n"] == 8
    code, text = finish(spawn("status", str(run.path), env={"COLUMNS": "400"}), timeout=60)
    header, row = next(([c.strip() for c in lines[i].split("┃")[1:-1]], [c.strip() for c in lines[i + 2].split("│")[1:-1]])
                       for lines in [text.splitlines()] for i in range(len(lines)) if "wv/mean" in lines[i])
    cells = dict(zip(header, row, strict=True))
    assert cells["wv/mean"] == "5.0" and cells["mixed"] == "0.00", text
    assert cells["ckpteval_addition_mc/acc"] == f"{mc['acc']:.3f}±{mc['acc_stderr']:.3f}", text


def test_harness_metrics_are_lm_evals_own_numbers_for_the_same_model(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Running the task on the engine through ckpteval gives what lm-eval's HFLM gives on that model."""
    from ckpteval.jobs.eval.engines.hf.engine import HFEngine
    from ckpteval.jobs.eval.kinds.lm_eval import evaluate_task, hf_lm, run_task

    monkeypatch.chdir(REPO)  # the task YAML's data_files path is relative to the working directory

    run = harness_run(tmp_path)
    snap = publish_model(tmp_path, run.snapshots, 7)
    spec = run.manifest().entry("harness")
    engine = HFEngine(device="cpu")
    engine.load(str(snap), "7")
    via_engine = run_task(engine, run, spec, TASKS[1], str(snap))
    direct = evaluate_task(hf_lm(engine.model, engine.tokenizer, spec), run, spec, TASKS[1])
    assert via_engine == direct
    engine.close()


def test_an_unknown_task_stops_the_worker_at_start_with_one_line(tmp_path: Path) -> None:
    run = RunDir.create(tmp_path / "bad")
    obj = harness_run(tmp_path).manifest().to_json()
    obj["eval"]["datasets"] = [{"kind": "lm_eval", "name": "h", "tasks": ["no_such_task"],
                                "include_path": str(TASK_DIR), "include_defaults": False}]
    run.manifest_path.write_text(json.dumps(obj))
    code, out = finish(spawn("worker", "--run-dir", str(run.path), "--once", env=OFFLINE), timeout=120)
    assert code == 2, out
    assert "unknown task(s) ['no_such_task']" in out and "Traceback" not in out


def test_an_lm_eval_task_runs_through_an_attached_server_with_lm_evals_completions_backend(tmp_path: Path) -> None:
    """``ckpteval serve`` (the real HTTP engine) with its ``/v1/completions``; the worker pins it through
    ``/update_weights_from_disk`` and lm-eval's ``local-completions`` adapter generates through it."""
    from dataclasses import replace

    from tests.support.workers import kill_all, start_serve

    run = harness_run(tmp_path)
    manifest = run.manifest()
    only_gen = replace(manifest.entry("harness"), tasks=(TASKS[0],))
    run.manifest_path.unlink()
    RunDir.create(run.path, replace(manifest, eval=replace(manifest.eval, entries=(manifest.entry("addition"), only_gen))))
    snap = publish_model(tmp_path, run.snapshots, 5)
    url, server = start_serve(snap, "0", tmp_path / "serve.log")
    try:
        code, out = finish(spawn("worker", "--run-dir", str(run.path), "--once", "--engine", f"http:{url}",
                                 "--poll-interval", "0.2", env=OFFLINE), timeout=300)
    finally:
        kill_all([server])
    assert code == 0, out
    r = results(run)[WorkUnit(5, "harness", 0)]
    assert r.ok, (r.skip_reason, r.message)
    assert r.weight_versions == (version(run, 5),) * 2 and 0.0 <= r.metrics["exact_match"] <= 1.0


def test_serve_v1_completions_cuts_at_stop_strings_and_refuses_loglikelihood(tmp_path: Path) -> None:
    import httpx

    from tests.support.workers import kill_all, start_serve

    snap = publish_model(tmp_path, tmp_path / "snaps", 3)
    url, server = start_serve(snap, "3", tmp_path / "serve.log")
    try:
        native = httpx.post(f"{url}/generate", json={"text": ["12+30=", "07+07="], "sampling_params": {
            "max_new_tokens": 6, "temperature": 0}}).json()
        got = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": ["12+30=", "07+07="],
                                                         "max_tokens": 6, "temperature": 0, "seed": 1}).json()
        assert [c["index"] for c in got["choices"]] == [0, 1]
        assert reply_version(got) == native[0]["meta_info"]["weight_version"] is not None  # stamped as sglang does
        assert [c["text"] for c in got["choices"]] == [n["text"] for n in native]  # same engine, same greedy text
        text = native[0]["text"]
        assert len(text) >= 3, native  # 6 greedy tokens of the tiny model decode to several characters
        stop = text[2]
        cut = httpx.post(f"{url}/v1/completions", json={"prompt": "12+30=", "max_tokens": 6, "temperature": 0,
                                                         "stop": [stop]}).json()["choices"][0]
        assert cut["text"] == text[: text.index(stop)] and cut["finish_reason"] == "stop"
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "1+1=", "echo": True, "logprobs": 1})
        assert refused.status_code == 400 and "generates only" in refused.json()["message"]
        unknown = httpx.post(f"{url}/v1/completions", json={"prompt": "1+1=", "best_of": 2})
        assert unknown.status_code == 400 and "best_of" in unknown.json()["message"]
    finally:
        kill_all([server])


def test_lm_eval_entries_refuse_engines_without_an_lm_eval_adapter(tmp_path: Path) -> None:
    from ckpteval.jobs.eval.worker.evaluators import check_entry_engines

    manifest = harness_run(tmp_path).manifest()
    for kinds, replicas in ((["fn"], 1), (["hf"], 2), (["hf", "http"], 1)):
        with pytest.raises(ValueError, match="need exactly one hf, http:URL or sglang engine"):
            check_entry_engines(manifest, kinds, replicas)
    check_entry_engines(manifest, ["http"], 1)  # one engine with an adapter: accepted


def test_a_task_lm_eval_cannot_run_on_the_model_is_that_unit_s_skip_with_lm_evals_message(tmp_path: Path) -> None:
    """256 generation tokens on the tiny model's 64-token context: lm-eval raises inside its adapter. The
    unit is a ``crashed`` skip written at once with lm-eval's message; the worker goes on and exits 0
    (before: the exception ended the worker with a traceback and left the unit pending)."""
    run = harness_run(tmp_path, gen_kwargs={"max_gen_toks": 256, "until": ["\n"]})
    publish_model(tmp_path, run.snapshots, 5)
    code, out = finish(spawn("worker", "--run-dir", str(run.path), "--once", "--poll-interval", "0.2",
                             env=OFFLINE), timeout=300)
    assert code == 0, out
    got = results(run)
    gen = got[WorkUnit(5, "harness", 0)]
    assert (gen.skip_reason, gen.blame, gen.attempt) == ("crashed", "lm_eval", 1), gen
    assert gen.message.startswith("lm-eval task 'ckpteval_addition_gen' failed: "), gen.message
    assert "Traceback" not in out, out
    assert got[WorkUnit(5, "addition", 0)].ok  # the other units of the point are scored


def test_the_shipped_lm_eval_example_runs_on_the_demo_model(tmp_path: Path) -> None:
    """``examples/lmeval/eval.json`` as the guide shows it, on a snapshot of the demo (reference) model."""
    from ckpteval.jobs.eval.worker.evalconfig import create_run_from_config

    publish_model(tmp_path, tmp_path / "snaps", 5)
    run = create_run_from_config(tmp_path / "run", REPO / "examples" / "lmeval" / "eval.json", (tmp_path / "snaps",))
    code, out = finish(spawn("worker", "--run-dir", str(run.path), "--once", "--poll-interval", "0.2",
                             env=OFFLINE), timeout=300)
    assert code == 0, out
    (r,) = results(run).values()
    assert r.ok and set(r.metrics) == {"exact_match", "n"}, (r.skip_reason, r.message)


def test_chat_template_kwargs_reach_lm_evals_chat_rendering_on_both_adapters(tmp_path: Path) -> None:
    """``chat_template_kwargs`` on an ``lm_eval`` entry: lm-eval's HFLM (its own ``chat_template_args``) and
    the ``local-completions`` adapter of an HTTP engine render a Qwen3-style template with thinking off, as a
    ``generate`` set's rendering does; without them the template opens ``<think>``. The completions adapter
    renders text (lm-eval's own would hand ``/v1/completions`` the messages as JSON)."""
    from transformers import AutoTokenizer

    from ckpteval.jobs.eval.engines.hf.engine import HFEngine
    from ckpteval.jobs.eval.engines.http.engine import HTTPEngine
    from ckpteval.jobs.eval.kinds.generate.prompts import render_chat
    from ckpteval.jobs.eval.kinds.lm_eval import completions_lm, hf_lm
    from tests.test_reasoning import save_thinking_tokenizer

    thinking = tmp_path / "thinking"
    save_thinking_tokenizer(thinking)
    tokenizer = AutoTokenizer.from_pretrained(thinking)
    chat = [{"role": "user", "content": "2+2?"}]
    off = LmEvalEntry(name="h", tasks=("t",), apply_chat_template=True, chat_template_kwargs={"enable_thinking": False})
    on = LmEvalEntry(name="h", tasks=("t",), apply_chat_template=True)
    want_off = render_chat(tokenizer, chat, "t", template_kwargs={"enable_thinking": False})
    assert want_off.endswith("<|assistant|><think>\n\n</think>\n\n")
    engine = HFEngine(device="cpu")
    engine.load(str(publish_model(tmp_path, tmp_path / "snapshots", 1)), "1")
    try:
        assert hf_lm(engine.model, tokenizer, off).apply_chat_template(chat) == want_off
        assert hf_lm(engine.model, tokenizer, on).apply_chat_template(chat).endswith("<|assistant|><think>\n")
    finally:
        engine.close()
    http = HTTPEngine("http://127.0.0.1:9")  # never contacted: the adapter only renders here
    assert completions_lm(http, str(thinking), off).apply_chat_template(chat) == want_off
    assert completions_lm(http, str(thinking), on).apply_chat_template(chat).endswith("<|assistant|><think>\n")


def test_a_harness_results_scorer_identity_tells_chat_template_kwargs_apart() -> None:
    """Two lm_eval entries that differ only in ``chat_template_kwargs`` record different scorer identities, so
    ``compare`` and ``best`` refuse to put their points side by side (tests/test_decide.py)."""
    from ckpteval.jobs.decide.scorers import scorer_difference
    from ckpteval.jobs.eval.kinds.lm_eval import identity

    off = identity(LmEvalEntry(name="h", tasks=("t",), apply_chat_template=True, chat_template_kwargs={"enable_thinking": False}))
    on = identity(LmEvalEntry(name="h", tasks=("t",), apply_chat_template=True))
    assert off["chat_template_kwargs"] == {"enable_thinking": False} and on["chat_template_kwargs"] == {}
    assert "chat_template_kwargs" in (scorer_difference(on, off) or "")
    assert scorer_difference(on, identity(LmEvalEntry(name="h", tasks=("t",), apply_chat_template=True))) is None


@pytest.mark.parametrize("batch_size", [1, 4])
def test_a_sampled_tasks_repeats_each_get_their_own_seed_on_deterministic_sglang(tmp_path: Path, batch_size: int) -> None:
    """lm-eval sends ``seed`` 1234 on every request; deterministic sglang (the stand-in samples as it does: a hash of
    seed and position) then gives every repeat of a prompt one text, and pass@k is pass@1. Each sampled request
    now carries its own seed, one prompt per request, so four repeats are four samples; a rerun draws the same."""
    from lm_eval.api.instance import Instance

    from ckpteval.jobs.eval.engines.http.engine import HTTPEngine
    from ckpteval.jobs.eval.kinds.lm_eval import completions_lm
    from tests.support.seeded_sampler import seeded_server
    from tests.test_reasoning import save_thinking_tokenizer

    snap = tmp_path / "snap"
    save_thinking_tokenizer(snap)
    spec = LmEvalEntry(name="h", tasks=("t",), batch_size=batch_size)
    sampled = {"until": ["\n\n"], "do_sample": True, "temperature": 1.0, "max_gen_toks": 6}
    repeats = [Instance("generate_until", {}, ("Question: 2+2?", dict(sampled)), idx=0, repeats=4) for _ in range(4)]
    with seeded_server() as (url, requests):
        texts = [completions_lm(HTTPEngine(url), str(snap), spec).generate_until(repeats, disable_tqdm=True)
                 for _ in range(2)]
        greedy = completions_lm(HTTPEngine(url), str(snap), spec).generate_until(
            [Instance("generate_until", {}, ("Question: 2+2?", {"until": ["\n\n"], "max_gen_toks": 6}), idx=0)],
            disable_tqdm=True)
    assert len(set(texts[0])) == 4, texts[0]
    assert texts[0] == texts[1]  # the seeds follow the entry's seed and the order: a rerun draws the same
    sampled_prompts = [r["prompt"] if isinstance(r["prompt"], list) else [r["prompt"]] for r in requests if r["temperature"] > 0]
    assert greedy and [len(p) for p in sampled_prompts] == [1] * 8
