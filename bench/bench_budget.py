"""Length-budget curves (issue 40 §2): CPU seconds per 1,000 kept samples of ``ckpteval rescore --budget N``, against
plain ``rescore`` of the same run measured in the same process (the ratio); and the CPU seconds of ``ckpteval plot``'s
budget-curve part (reading the scorings, deriving every point at each budget, drawing) per 1,000 kept samples.

A synthetic run of ``--points`` steps x ``--prompts`` rows (one sample each, a reasoning set ``<think>...</think>``),
its results and kept completions written as a worker writes them; completions of about ``--tokens`` tokens (the
reference character tokenizer in ``RUN/base``: one token a character; windows of this repository's prose), half of
them longer than the budget (``--tokens`` / 2), so half are cut by the tokenizer's offsets.

    .venv/bin/python bench/bench_budget.py [--points 20] [--prompts 64] [--tokens 2048] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from ckpteval.coord.results.completions import record_generations, rows_digest
from ckpteval.coord.results.files import ok_result, write_result
from ckpteval.coord.run.identity import run_key, weight_version
from ckpteval.coord.run.manifest import EvalSpec, LeaseSettings, RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import shard_range, units_for_step
from ckpteval.jobs.eval.engines.base import Generation
from ckpteval.jobs.eval.kinds.generate.answering import resolve_reasoning
from ckpteval.jobs.eval.kinds.generate.evalsets import write_addition_dataset
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache, unit_scores
from ckpteval.jobs.eval.worker.rescore import Rescorer, Rescoring, open_or_create
from ckpteval.jobs.reference.model import save_tokenizer

CORPUS = "".join(p.read_text() for p in sorted((Path(__file__).parents[1] / "docs").glob("*.md")))
CORPUS = "".join(c for c in CORPUS if c.isdigit() or c in " +=")  or "12 + 34 = 46 " * 1000


def synthetic_run(root: Path, points: int, prompts: int, tokens: int) -> RunDir:
    run = RunDir.create(root / "run")
    spec = replace(write_addition_dataset(run, n=prompts, shard_size=32), max_new_tokens=tokens,
                   reasoning={"end": "</think>", "start": "<think>"})
    manifest = RunManifest(run_id="bench-budget", eval=EvalSpec(entries=(spec,)), snapshot_roots=(str(run.snapshots),),
                           lease=LeaseSettings(60.0, 10.0))
    run = RunDir.create(run.path, manifest)
    save_tokenizer(run.base, model_max_length=1 << 20)
    cache, rng = DatasetCache(run, manifest), random.Random(1)
    scorer, key, rows = cache.scorer(spec), run_key(manifest), cache.rows(spec)
    reasoning = resolve_reasoning(spec, str(run.base))
    for step in range(points):
        for unit in units_for_step(manifest, step):
            mine = [rows[i] for i in shard_range(manifest, unit)]
            gens = []
            for r in mine:
                think = rng.randint(tokens // 4, tokens - 20)
                start = rng.randrange(max(1, len(CORPUS) - think))
                text = "<think>" + (CORPUS * 2)[start : start + think] + "</think>" + r["answer"]
                gens.append(Generation(text, weight_version(key, step), len(text), 6, "stop"))
            prompts = [r["prompt"] for r in mine]
            kept = record_generations(unit, prompts, rows_digest(mine), None, gens)
            scored = unit_scores(scorer, spec, gens, mine, prompts, reasoning, kept=kept)
            write_result(run.results, ok_result(unit, scored.scores, scored.weight_versions, scored.answers,
                                                lease_token=secrets.token_hex(16), kept=kept, **scored.result_fields()))
    return run


def cpu_rescore(run: RunDir, rescoring: Rescoring, name: str) -> tuple[float, int]:
    c0 = time.process_time()
    rescorer = Rescorer(run, run.manifest(), rescoring, open_or_create(run, name, rescoring))
    units = rescorer.candidates("all", None)
    rescorer.run_all(units, 0.5, out=print)
    return time.process_time() - c0, rescorer.written


def cpu_curve(run: RunDir, out: Path) -> float:
    """``ckpteval plot``'s budget-curve part over the scorings made: read, derive, draw (CPU seconds)."""
    from ckpteval.jobs.views.budget_curve import budget_curves, curve_figure

    c0 = time.process_time()
    curves = budget_curves(run.path)
    if not curves:
        raise RuntimeError("no budget curve drawn: the budget scoring re-scored nothing")
    curve_figure(curves, "bench").savefig(out, dpi=100)
    return time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = synthetic_run(Path(tmp), args.points, args.prompts, args.tokens)
        samples = args.points * args.prompts
        plain_s, _ = cpu_rescore(run, Rescoring(None, None), "plain")
        budget_s, _ = cpu_rescore(run, Rescoring(None, None, budget=args.tokens // 2), "budget")
        curve_s = cpu_curve(run, Path(tmp) / "curve.png")
    out = {"samples": samples, "tokens": args.tokens, "budget": args.tokens // 2,
           "plain_cpu_s_per_1000": plain_s / samples * 1000, "budget_cpu_s_per_1000": budget_s / samples * 1000,
           "curve_cpu_s_per_1000": curve_s / samples * 1000, "ratio_budget_over_plain": budget_s / plain_s}
    print(json.dumps(out, indent=1))
    print(f"ratio budget/plain (CPU s per 1,000 kept samples): {out['ratio_budget_over_plain']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
