"""Scoring one work unit on an engine: the shard's prompts, sampled and scored per the run's config.

Owns the mapping from a :class:`~coord.units.WorkUnit` to generations and scores; it pins nothing
and writes nothing (the worker, or the trainer's shared posture, does that around it). Every sample
keeps the weight version the engine reported for it.

Determinism: greedy sampling is deterministic; sampled decoding uses ``spec.seed`` so a rerun of the
same unit on the same engine draws the same samples where the engine honours seeds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from coord.manifest import DatasetSpec, RunManifest
from coord.rundir import RunDir
from coord.units import WorkUnit, shard_range
from jobs.eval.engines.base import Engine, SamplingParams
from jobs.eval.evalsets import Scorer, get_scorer, load_dataset


@dataclass
class UnitScores:
    scores: list[float]
    weight_versions: list[str | None]
    completions: list[str]
    generate_s: float
    n_tokens: int


class DatasetCache:
    """Rows and scorers of a run's datasets, loaded once per process."""

    def __init__(self, run: RunDir, manifest: RunManifest) -> None:
        self.run, self.manifest = run, manifest
        self._rows: dict[str, list[dict[str, str]]] = {}
        self._scorers: dict[str, Scorer] = {}

    def rows(self, spec: DatasetSpec) -> list[dict[str, str]]:
        if spec.name not in self._rows:
            self._rows[spec.name] = load_dataset(self.run, spec)
        return self._rows[spec.name]

    def scorer(self, spec: DatasetSpec) -> Scorer:
        if spec.name not in self._scorers:
            self._scorers[spec.name] = get_scorer(spec.scorer)
        return self._scorers[spec.name]


def sampling_params(spec: DatasetSpec) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=spec.max_new_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        seed=spec.seed if spec.temperature > 0 else None,
    )


def score_unit(engine: Engine, cache: DatasetCache, unit: WorkUnit) -> UnitScores:
    """Generate ``n_samples`` completions per prompt of the unit's shard and score them."""
    spec = cache.manifest.dataset(unit.dataset)
    rows = [cache.rows(spec)[i] for i in shard_range(cache.manifest, unit)]
    prompts = [r["prompt"] for r in rows for _ in range(spec.n_samples)]
    answers = [r["answer"] for r in rows for _ in range(spec.n_samples)]
    t0 = time.perf_counter()
    generations = engine.generate(prompts, sampling_params(spec))
    elapsed = time.perf_counter() - t0
    if len(generations) != len(prompts):
        raise RuntimeError(f"engine returned {len(generations)} generations for {len(prompts)} prompts")
    scorer = cache.scorer(spec)
    return UnitScores(
        scores=[float(scorer(g.text, a)) for g, a in zip(generations, answers, strict=True)],
        weight_versions=[g.weight_version for g in generations],
        completions=[g.text for g in generations],
        generate_s=elapsed,
        n_tokens=sum(g.n_tokens for g in generations),
    )
