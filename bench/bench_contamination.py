"""Training rows per second of the contamination gate (#41): each tier set against the exact tier alone,
measured in the same run on the same rows, and end to end from JSONL and parquet files.

Rows: ``tests/support/planted.py``'s prompts (English words by their frequency in Python's docs, 25-60
words and a question), ``--eval-rows`` eval rows; among the ``--train-rows`` training rows, 10 exact copies,
10 13-gram spans and 10 paraphrases of eval rows are planted, and the bench counts what each tier found
and every report that is no plant (false reports). One process, one core. The load average is printed
first: on a shared machine, numbers mean little when it is high.

    PYTHONPATH=. .venv/bin/python bench/bench_contamination.py [--train-rows 200000] [--eval-rows 500] [--procs 2]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from ckpteval.jobs.eval.contamination.gate import EvalSet, scan
from ckpteval.jobs.eval.contamination.index import EvalIndex, Settings
from tests.support.planted import exact_copy, ngram_copy, paraphrase, prompts

TIER_SETS = {"exact": ("exact",), "exact+ngram": ("exact", "ngram"), "all": ("exact", "ngram", "near")}
BATCH = 4096


def corpus(n_train: int, n_eval: int) -> tuple[list[str], list[str], dict[int, tuple[int, str]]]:
    """Eval rows, training rows and the plants: training row -> (eval row, tier that must find it)."""
    evals, train = prompts(n_eval, seed=1), prompts(n_train, seed=2)
    plants: dict[int, tuple[int, str]] = {}
    step = max(1, n_train // 31)
    for k in range(30):
        row, target = (k + 1) * step, k % n_eval
        tier = ("exact", "ngram", "near")[k % 3]
        if tier == "exact":
            train[row] = exact_copy(evals[target])
        elif tier == "ngram":
            train[row] = ngram_copy(evals[target], train[0])
        else:
            train[row] = paraphrase(evals[target], seed=k)
        plants[row] = (target, tier)
    return evals, train, plants


def in_memory(evals: list[str], train: list[str], tiers: tuple[str, ...]) -> tuple[float, list[Any]]:
    index = EvalIndex(evals, Settings())
    hits = []
    t0 = time.perf_counter()
    for first in range(0, len(train), BATCH):
        hits += [(first + h.train, h.eval_id, h.tier) for h in index.scan(train[first:first + BATCH], tiers)]
    return time.perf_counter() - t0, hits


def grade(hits: list[Any], plants: dict[int, tuple[int, str]]) -> dict[str, int]:
    found = {t: 0 for t in ("exact", "ngram", "near")}
    false = 0
    for row, eval_id, tier in hits:
        if plants.get(row, (None, None))[0] == eval_id:
            found[plants[row][1]] += tier == plants[row][1]
        else:
            false += 1
    return {**{f"found_{t}": n for t, n in found.items()}, "false_reports": false}


def from_files(evals: list[str], train: list[str], tmp: Path, procs: int) -> dict[str, float]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl, parquet = tmp / "train.jsonl", tmp / "train.parquet"
    jsonl.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in train))
    pq.write_table(pa.table({"prompt": [[{"role": "user", "content": t}] for t in train]}), parquet)
    out = {}
    runs = [(jsonl, 1), (parquet, 1)] + ([(jsonl, procs)] if procs > 1 else [])
    for path, n in runs:
        t0 = time.perf_counter()
        scan([EvalSet("e", evals)], [path], Settings(), procs=n)
        out[path.suffix.lstrip(".") + (f", {n} processes" if n > 1 else "")] = len(train) / (time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-rows", type=int, default=200_000)
    parser.add_argument("--eval-rows", type=int, default=500)
    parser.add_argument("--no-files", action="store_true", help="skip the end-to-end file runs")
    parser.add_argument("--procs", type=int, default=2, help="also the JSONL run with this many worker processes "
                        "(1: not)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    print(f"load average {os.getloadavg()}, {os.cpu_count()} cpus")
    t0 = time.perf_counter()
    evals, train, plants = corpus(args.train_rows, args.eval_rows)
    print(f"{args.train_rows:,} training rows, {args.eval_rows} eval rows, 30 plants (made in "
          f"{time.perf_counter() - t0:.1f} s)")
    result: dict[str, Any] = {"train_rows": args.train_rows, "eval_rows": args.eval_rows, "tiers": {}}
    for name, tiers in TIER_SETS.items():
        seconds, hits = in_memory(evals, train, tiers)
        graded = grade(hits, plants)
        result["tiers"][name] = {"rows_per_s": args.train_rows / seconds, **graded}
        print(f"{name:>12}: {args.train_rows / seconds:>10,.0f} rows/s  found exact {graded['found_exact']}/10, "
              f"ngram {graded['found_ngram']}/10, near {graded['found_near']}/10, false reports {graded['false_reports']}")
    if not args.no_files:
        with tempfile.TemporaryDirectory() as tmp:
            result["files_rows_per_s"] = from_files(evals, train, Path(tmp), args.procs)
        for kind, speed in result["files_rows_per_s"].items():
            print(f"{'all, ' + kind:>12}: {speed:>10,.0f} rows/s  (read from the file, end to end)")
        if args.procs > 1:
            procs, one = result["files_rows_per_s"][f"jsonl, {args.procs} processes"], result["files_rows_per_s"]["jsonl"]
            print(f"ratio {args.procs} processes / 1 (JSONL, all tiers): {procs / one:.2f}")
    base, full = result["tiers"]["exact"]["rows_per_s"], result["tiers"]["all"]["rows_per_s"]
    result["ratio_all_vs_exact"] = full / base
    print(f"ratio all tiers / exact tier alone: {full / base:.2f} ({full:,.0f} vs {base:,.0f} training rows/s)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
