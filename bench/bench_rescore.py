"""Kept completions and ``ckpteval rescore`` (issue 28 §2): bytes per kept sample, and re-scoring a synthetic run.

1. **Bytes per kept sample**: kept-completions files (:mod:`ckpteval.coord.results.completions`, gzip'd JSON) of units of
   64 prompts x 4 samples at three completion lengths (about 8, 256 and 4,096 tokens at 4 characters a token).
   Texts are non-overlapping windows of this repository's own prose and code (docs/*.md, *.py), picked at random,
   so gzip finds no repeats a real completion would not have; the short ones are digit strings like the tiny
   model's. Each is compared with the bytes of the result file of the same unit (scores, answers, versions).
2. **Re-scoring** a synthetic run of ``--points`` steps x one dataset (``--prompts`` rows, ``--shard-size`` rows per
   unit), its results and kept completions written as a worker writes them: the time of ``rescore`` with the
   dataset's own scorer (CPU only, one process), against reading the same run's results (the ratio), and the
   check that every re-scored score and answer equals the original exactly.
3. **Step 0 once per base** (``--store-prompts`` > 0): two runs from the same base (the tiny model, the hf engine on
   CPU), each with step 0's snapshot, evaluated one after the other with one ``--completion-store``: the second
   run's engine and load seconds (zero when answered from the store) and its wall time against the first's.

    .venv/bin/python bench/bench_rescore.py [--points 1000] [--prompts 128] [--shard-size 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import tempfile
import time
from pathlib import Path

from ckpteval.coord.results.completions import Completions, encode, record_generations, rows_digest
from ckpteval.coord.results.files import ResultIndex, dumps, ok_result, write_result
from ckpteval.coord.run.identity import run_key, weight_version
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import WorkUnit, shard_range, units_for_step
from ckpteval.jobs.eval.engines.base import Generation
from ckpteval.jobs.eval.kinds.generate.answering import Reasoning
from ckpteval.jobs.eval.kinds.generate.evalsets import write_addition_dataset
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache, unit_scores
from ckpteval.jobs.eval.worker.rescore import Rescorer, Rescoring, open_or_create

REPO = Path(__file__).resolve().parents[1]
CHARS_PER_TOKEN = 4


def corpus() -> str:
    files = sorted([*REPO.glob("docs/*.md"), *REPO.glob("coord/*.py"), *REPO.glob("jobs/**/*.py")])
    return "\n".join(p.read_text() for p in files)


def windows(text: str, size: int, count: int, rng: random.Random) -> list[str]:
    """``count`` non-overlapping windows of ``size`` characters (wrapping around when the corpus is short)."""
    starts = list(range(0, max(1, len(text) - size), size))
    rng.shuffle(starts)
    return [text[starts[i % len(starts)]:starts[i % len(starts)] + size] for i in range(count)]


def kept_bytes(tokens: int, prompts: int = 64, samples: int = 4, seed: int = 0) -> dict[str, float]:
    """Bytes per sample of one unit's kept completions with texts of ``tokens`` tokens, and of its result."""
    rng = random.Random(seed)
    n = prompts * samples
    texts = ([f" {rng.randint(0, 999):03d}\n" for _ in range(n)] if tokens <= 8
             else windows(corpus(), tokens * CHARS_PER_TOKEN, n, rng))
    unit = WorkUnit(100, "set", 0)
    version = "run-20261203-0123abcd@100"
    gens = [Generation(t, version, tokens, 60, "stop") for t in texts]
    prompt_rows = [f"Question {i}: what is {rng.randint(0, 99)} + {rng.randint(0, 99)}? Think step by step.\n"
                   for i in range(prompts)]
    record = record_generations(unit, prompt_rows, rows_digest(prompt_rows), list(range(n)), gens)
    blob = encode(record)
    result = ok_result(unit, [float(rng.random() < 0.5) for _ in range(n)], [version] * n,
                       [str(rng.randint(0, 999)) for _ in range(n)], lease_token=secrets.token_hex(16))
    raw = sum(len(t.encode()) for t in texts) / n
    return {"tokens": tokens, "text_bytes_per_sample": raw, "kept_bytes_per_sample": len(blob) / n,
            "compression": raw / (len(blob) / n) if tokens > 8 else None,
            "result_bytes_per_sample": len(dumps(result.to_json())) / n}


def synthetic_run(root: Path, points: int, prompts: int, shard_size: int) -> RunDir:
    """A run whose ``points`` steps each have every unit's result and kept completions, as a worker writes them."""
    run = RunDir.create(root / "run")
    spec = write_addition_dataset(run, n=prompts, shard_size=shard_size)
    manifest = RunManifest(run_id="bench-rescore", eval=EvalSpec(entries=(spec,)), snapshot_roots=(str(run.snapshots),),
                           lease=LeaseSettings(60.0, 10.0))
    run = RunDir.create(run.path, manifest)
    cache = DatasetCache(run, manifest)
    scorer, key, rng = cache.scorer(spec), run_key(manifest), random.Random(1)
    rows = cache.rows(spec)
    for step in range(points):
        version = weight_version(key, step)
        for unit in units_for_step(manifest, step):
            mine = [rows[i] for i in shard_range(manifest, unit)]
            texts = [(r["answer"] if rng.random() < 0.4 else f"{rng.randint(0, 999):03d}") for r in mine]
            prompt_texts = [r["prompt"] for r in mine]
            gens = [Generation(t, version, 4, 6, "stop") for t in texts]
            kept: Completions = record_generations(unit, prompt_texts, rows_digest(mine), None, gens)
            scored = unit_scores(scorer, spec, gens, mine, prompt_texts, Reasoning(None), kept=kept)
            result = ok_result(unit, scored.scores, scored.weight_versions, scored.answers,
                               lease_token=secrets.token_hex(16), kept=kept, **scored.result_fields())
            write_result(run.results, result)
    return run


def bench_rescore(points: int, prompts: int, shard_size: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run = synthetic_run(Path(tmp), points, prompts, shard_size)
        made_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        originals = ResultIndex(run.results).refresh()
        read_s = time.perf_counter() - t0
        rescoring = Rescoring(None, None)
        t0, c0 = time.perf_counter(), time.process_time()
        rescorer = Rescorer(run, run.manifest(), rescoring, open_or_create(run, "same", rescoring))
        units = rescorer.candidates("all", None)
        rescorer.run_all(units, 0.5, out=print)
        rescore_s, rescore_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        again = ResultIndex(run.path / "scorings" / "same" / "results").refresh()
        exact = len(again) == len(originals) and all(
            again[u].scores == r.scores and again[u].answers == r.answers for u, r in originals.items())
        samples = sum(len(r.scores) for r in originals.values())
        kept_total = sum(p.stat().st_size for p in run.results.rglob("*.completions.json.gz"))
    return {"points": points, "units": len(units), "samples": samples, "write_run_s": made_s, "read_results_s": read_s,
            "rescore_s": rescore_s, "rescore_cpu_s": rescore_cpu_s, "ratio": rescore_s / read_s, "exact": exact,
            "kept_bytes_per_sample": kept_total / samples, "units_per_s": len(units) / rescore_s}


def store_run(tmp: Path, name: str, base: Path, prompts: int) -> RunDir:
    from ckpteval.coord.snapshots.snapshot import publish_snapshot
    from ckpteval.jobs.reference.model import build_model
    from ckpteval.jobs.trainer.export.hf_files import write_hf_files

    run = RunDir.create(tmp / name)
    spec = write_addition_dataset(run, n=prompts, shard_size=max(1, prompts // 2))
    manifest = RunManifest(run_id=f"bench-{name}", eval=EvalSpec(entries=(spec,)),
                           snapshot_roots=(str(run.snapshots),), lease=LeaseSettings(60.0, 10.0))
    run = RunDir.create(run.path, manifest)
    publish_snapshot(run.snapshots, 0, lambda d: write_hf_files(d, build_model(seed=0).state_dict(), base),
                     run=run_key(manifest))  # as the trainer stamps it
    return run


def bench_store(prompts: int) -> dict[str, float]:
    """Two runs from one base, step 0 each, one store: the second run's cost against the first's."""
    import transformers  # noqa: F401  (imported before timing: the first run does not pay the imports)

    from ckpteval.jobs.eval.worker.main import prepare_worker
    from ckpteval.jobs.eval.worker.options import WorkerOptions
    from ckpteval.jobs.reference.model import save_base_model_dir

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = save_base_model_dir(Path(tmp) / "base")
        for name in ("first", "second"):
            run = store_run(Path(tmp), name, base, prompts)
            opts = WorkerOptions(run_dir=run.path, poll_interval_s=0.05, once=True, completion_store=Path(tmp) / "store")
            t0 = time.perf_counter()
            worker = prepare_worker(opts, out=lambda _line: None)
            try:
                worker.run()
            finally:
                worker.evaluator.close()
            out[f"{name}_wall_s"] = time.perf_counter() - t0
            got = ResultIndex(run.results).refresh().values()
            out[f"{name}_engine_s"] = sum(r.cost.get("engine_s", 0.0) + r.cost.get("load_s", 0.0) for r in got)
            out[f"{name}_store_hits"] = sum(r.cost.get("store_hits", 0.0) for r in got)
    out["ratio"] = out["second_wall_s"] / out["first_wall_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", type=int, default=1000)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--shard-size", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8, 256, 4096], metavar="TOKENS")
    ap.add_argument("--store-prompts", type=int, default=64, metavar="N", help="prompts of step 0 in the store "
                    "phase (0: skip it)")
    ap.add_argument("--json", type=Path, metavar="OUT")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    sizes = [kept_bytes(t) for t in args.lengths]
    for s in sizes:
        comp = f"{s['compression']:.2f}x" if s["compression"] else "-"
        print(f"kept completions, ~{s['tokens']} tokens: {s['kept_bytes_per_sample']:.0f} B/sample gzip'd "
              f"(text {s['text_bytes_per_sample']:.0f} B, compression {comp}); the result file: "
              f"{s['result_bytes_per_sample']:.0f} B/sample; ratio kept/result "
              f"{s['kept_bytes_per_sample'] / s['result_bytes_per_sample']:.2f}")
    r = bench_rescore(args.points, args.prompts, args.shard_size)
    print(f"rescore {r['points']} points x 1 set ({r['units']} units, {r['samples']} samples): {r['rescore_s']:.2f}s "
          f"({r['rescore_cpu_s']:.2f}s CPU, {r['units_per_s']:.0f} units/s) vs reading the results {r['read_results_s']:.2f}s: ratio "
          f"{r['ratio']:.1f}; exact re-score: {r['exact']}; kept {r['kept_bytes_per_sample']:.0f} B/sample")
    if not r["exact"]:
        raise SystemExit("re-scoring with the same scorer changed a score or an answer")
    st = bench_store(args.store_prompts) if args.store_prompts else {}
    if st:
        print(f"step 0 of a second run from the same base: {st['second_store_hits']:.0f} units from the store, engine + "
              f"load {st['second_engine_s']:.3f}s (first run {st['first_engine_s']:.2f}s), wall {st['second_wall_s']:.2f}s "
              f"vs {st['first_wall_s']:.2f}s: ratio {st['ratio']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"sizes": sizes, "rescore": r, "store": st}, indent=1))


if __name__ == "__main__":
    main()
