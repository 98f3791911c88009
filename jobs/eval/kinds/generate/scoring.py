"""Scoring one work unit on an engine: the shard's prompts, sampled and scored per the run's config.

Owns the mapping from a :class:`~ckpteval.coord.work.units.WorkUnit` to generations and scores; it pins nothing
and writes nothing (the worker, or the trainer's shared posture, does that around it). Every sample
keeps the weight version the engine reported for it and the answer its scorer extracted.

Prompts are rendered by :func:`ckpteval.jobs.eval.kinds.generate.prompts.render_prompts` (raw, or the snapshot's chat
template), so every engine receives the same text for the same row. Completions are scored by
:func:`ckpteval.jobs.eval.kinds.generate.answering.score_generations`: the scorer sees each answer with its reasoning
stripped, and every sample carries ``truncated``/``no_answer``/token counts.

Seeds: greedy decoding (``temperature == 0``) is deterministic and sends no seeds. Sampled decoding
gives sample ``j`` of prompt row ``i`` (``i`` the row's index in the whole dataset and ``j`` the sample's
index among the prompt's ``n_samples``, so neither sharding nor splitting samples over units changes it) the seed :func:`sample_seed` ``(spec.seed, i, j)``: the ``n_samples`` copies of a prompt
get distinct seeds, and a rerun draws the same samples wherever the engine honours per-sample seeds.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.results.completions import Completions, record_generations, rows_digest
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import WorkUnit, shard_range, unit_samples
from ckpteval.jobs.eval.engines.base import Engine, Generation, SamplingParams
from ckpteval.jobs.eval.kinds.evaluate import Evaluation
from ckpteval.jobs.eval.kinds.generate.answering import (
    Reasoning,
    resolve_reasoning,
    score_generations,
    scoring_identity,
)
from ckpteval.jobs.eval.kinds.generate.evalsets import Row, load_dataset
from ckpteval.jobs.eval.kinds.generate.prompts import render_prompts
from ckpteval.jobs.eval.proof.pinning import check_pinned
from ckpteval.jobs.eval.scorers import Sample, Scorer, ScorerContext, UnitTally, make_scorer
from ckpteval.jobs.eval.worker.options import scorer_options

SEED_MASK = 0x7FFFFFFF  # 31 bits: a non-negative int32 every engine accepts


def sample_seed(dataset_seed: int, prompt_index: int, sample_index: int, turn: int | None = None) -> int:
    """The seed of one sample: a stable 31-bit hash of (dataset seed, global prompt index, sample index);
    ``turn``: of one model turn of an episode (``env`` sets: episode = sample)."""
    key = f"ckpteval-sample:{dataset_seed}:{prompt_index}:{sample_index}{'' if turn is None else f':{turn}'}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") & SEED_MASK


def unit_seeds(spec: GenerateEntry, prompt_indices: range, samples: range | None = None) -> list[int] | None:
    """Per-sample seeds of a unit, prompt-major (None for greedy datasets: nothing to seed). ``samples``: the
    unit's sample indices (default: all ``n_samples``); a seed depends on the absolute index, never on the
    position in the unit, so splitting samples over units (``samples_per_unit``) draws the same samples."""
    if spec.temperature == 0:
        return None
    return [sample_seed(spec.seed, i, j) for i in prompt_indices for j in (samples or range(spec.n_samples))]


@dataclass
class UnitScores:
    scores: list[float]
    weight_versions: list[str | None]
    completions: list[str]
    generate_s: float
    n_tokens: int
    prompt_tokens: int
    score_s: float  # the scorer's seconds (a judge's or a sandbox's time included)
    answers: list[str | None]
    tally: UnitTally
    scorer: dict[str, Any]  # the scorer's identity()
    kept: Completions | None = None  # the completions as generated (ckpteval.coord.results.completions), kept beside the result

    def result_fields(self) -> dict[str, Any]:
        """The result fields besides scores/versions/answers (:func:`ckpteval.coord.results.files.ok_result` keywords)."""
        return {**self.tally.as_result_fields(), "scorer": self.scorer}


class DatasetCache:
    """Rows and scorers of a run's datasets, loaded once per process. ``ctx``: what the scorers are told
    of this process (default: the run dir and the scoring options' defaults)."""

    def __init__(self, run: RunDir, manifest: RunManifest, ctx: ScorerContext | None = None) -> None:
        self.run, self.manifest = run, manifest
        self.ctx = ctx or ScorerContext(run.path, scorer_options())
        self._rows: dict[str, list[Row]] = {}
        self._scorers: dict[str, Scorer] = {}

    def rows(self, spec: GenerateEntry) -> list[Row]:
        if spec.name not in self._rows:
            self._rows[spec.name] = load_dataset(self.run, spec)
        return self._rows[spec.name]

    def scorer(self, spec: GenerateEntry) -> Scorer:
        if spec.name not in self._scorers:
            self._scorers[spec.name] = make_scorer(spec, self.ctx)
        return self._scorers[spec.name]


def sampling_params(spec: GenerateEntry) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=spec.max_new_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        seed=spec.seed if spec.temperature > 0 else None,
        timeout_s=spec.generate_timeout_s,
    )


@dataclass(frozen=True)
class UnitInput:
    """What a unit asks of an engine: the prompt text of each sample, its seed, its gold answer."""

    spec: GenerateEntry
    prompt_indices: range
    prompts: list[str]  # one per sample (prompt-major)
    seeds: list[int] | None
    rows: list[Row]  # one per sample (prompt-major)
    samples: range  # the sample indices of each prompt this unit generates (all n_samples unless split)


def unit_input(cache: DatasetCache, unit: WorkUnit, snapshot_dir: str | None) -> UnitInput:
    """Render the unit's rows for the snapshot at ``snapshot_dir`` and derive their seeds."""
    spec = cache.manifest.entry(unit.dataset)
    indices = shard_range(cache.manifest, unit)
    rows = [cache.rows(spec)[i] for i in indices]
    texts = render_prompts(spec, rows, snapshot_dir)
    samples = unit_samples(cache.manifest, unit)
    return UnitInput(
        spec=spec,
        prompt_indices=indices,
        prompts=[t for t in texts for _ in samples],
        seeds=unit_seeds(spec, indices, samples),
        rows=[r for r in rows for _ in samples],
        samples=samples,
    )


def score_unit(engine: Engine, cache: DatasetCache, unit: WorkUnit, snapshot_dir: str | None = None) -> UnitScores:
    """Generate the unit's samples (all ``n_samples``, or its sample range) of each prompt of its shard and
    score them.

    ``snapshot_dir``: the snapshot being evaluated (its tokenizer renders ``chat`` datasets).
    """
    work = unit_input(cache, unit, snapshot_dir)
    reasoning = resolve_reasoning(work.spec, snapshot_dir)  # a setting the snapshot cannot resolve: before generating
    t0 = time.perf_counter()
    params = sampling_params(work.spec)
    # greedy: no seeds, so an engine that predates per-sample seeds still serves raw greedy sets
    generations = (
        engine.generate(work.prompts, params) if work.seeds is None
        else engine.generate(work.prompts, params, seeds=work.seeds)
    )
    elapsed = time.perf_counter() - t0
    if len(generations) != len(work.prompts):
        raise RuntimeError(f"engine returned {len(generations)} generations for {len(work.prompts)} prompts")
    per_prompt = len(work.samples)
    kept = record_generations(unit, work.prompts[::per_prompt], rows_digest(work.rows[::per_prompt]), work.seeds,
                              generations)
    return unit_scores(cache.scorer(work.spec), work.spec, generations, work.rows, work.prompts,
                       reasoning, generate_s=elapsed, kept=kept)


def kept_generations(kept: Completions, versions: list[str | None] | None = None) -> list[Generation]:
    """Kept completions as the engine's generations (``versions``: each sample's weight version, else the kept ones)."""
    versions = list(kept.weight_version) if versions is None else versions
    return [Generation(text, version, n, prompt_tokens=p, finish_reason=finish) for text, version, n, p, finish
            in zip(kept.text, versions, kept.n_tokens, kept.prompt_tokens, kept.finish_reason, strict=True)]


def unit_scores(scorer: Scorer, spec: GenerateEntry, generations: list[Generation], rows: list[Row], prompts: list[str],
                reasoning: Reasoning, *, generate_s: float = 0.0, kept: Completions | None = None) -> UnitScores:
    """Score a unit's generations (one per sample, prompt-major, with its row and prompt) through ``reasoning``
    (answers only, :mod:`ckpteval.jobs.eval.kinds.generate.answering`): the one scoring path of a fresh generation, a re-score
    of kept completions and a completion-store hit alike."""
    samples = [Sample(g.text, r, p) for g, r, p in zip(generations, rows, prompts, strict=True)]
    t1 = time.perf_counter()
    scored = score_generations(scorer, samples, generations, reasoning)
    score_s = time.perf_counter() - t1
    return UnitScores(
        scores=[s.score for s in scored],
        weight_versions=[g.weight_version for g in generations],
        completions=[g.text for g in generations],
        generate_s=generate_s,
        n_tokens=sum(g.n_tokens for g in generations),
        prompt_tokens=sum(g.prompt_tokens or 0 for g in generations),
        score_s=score_s,
        answers=[s.answer for s in scored],
        tally=UnitTally.of(scored),
        scorer=scoring_identity(scorer, spec, reasoning),
        kept=kept,
    )


def evaluate_generate(
    engine: Engine, cache: DatasetCache, spec: GenerateEntry, unit: WorkUnit, snapshot: str, want: str
) -> Evaluation:
    """The ``generate`` kind (:mod:`ckpteval.jobs.eval.kinds.evaluate`): score the unit, then check every sample's version."""
    scored = score_unit(engine, cache, unit, snapshot)
    check_pinned(engine, want, scored.weight_versions)
    cost = {"generated_tokens": float(scored.n_tokens), "prompt_tokens": float(scored.prompt_tokens),
            "score_s": scored.score_s}
    return Evaluation(scored.scores, scored.weight_versions, answers=scored.answers, scored=scored.result_fields(),
                      generate_s=scored.generate_s, cost=cost, kept=scored.kept)


def check_generate(cache: DatasetCache, spec: GenerateEntry) -> None:
    """At start: the rows load (and meet the scorer's needs) and the scorer builds."""
    cache.rows(spec)
    cache.scorer(spec)
