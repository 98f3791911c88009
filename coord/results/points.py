"""Points (views): one step's metrics, derived from its units' results by any reader — trainer, status,
plot, backfill — and the metric names they are logged under (docs/PROTOCOL.md §7).

A point is complete when every unit of the step has a result. Sharding does not change a point: every
metric is derived from the per-sample data pooled over the shards in prompt order (the pooled mean,
pass@k, maj@n, the standard error over prompts), never averaged per shard; a dataset whose samples are
split over units (``samples_per_unit``) is pooled per prompt across its units first (:func:`prompt_major`),
so its point equals the unsplit one. Each entry's point rule (:attr:`~ckpteval.coord.entries.Entry.POINT_RULE`)
picks how: ``samples`` (:func:`dataset_score`) or ``metrics`` (:func:`unit_metrics`).

A dataset's units are pooled only when they agree on the scorer identity (two judge models are two
measurements: ``mixed_scorers``) and on the engine identity (:mod:`ckpteval.coord.results.engine_identity`: engine,
version, dtype, parallel layout, deterministic mode, concurrency — ``mixed_engines`` names the fields
that differ); a unit that recorded neither is not compared (results written before they existed).

Guarantee: a point is a pure function of run.json and the results read (the same on every reader); a result
attributed to another run's weights is not scored (:func:`_attributed`). Limits: an incomplete point is
returned as such (``complete`` False); callers decide whether to log it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckpteval.coord.entries import Entry, SamplesEntry, scored_per_sample
from ckpteval.coord.results import censoring
from ckpteval.coord.results.censoring import stderr as _stderr
from ckpteval.coord.results.engine_identity import differing_fields, parse_identity
from ckpteval.coord.results.files import Result, skip_result
from ckpteval.coord.run.identity import run_key, version_matches, version_runs, version_step
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.work.grants import topups
from ckpteval.coord.work.units import WorkUnit, check_score_count, prompt_range, units_for_step


@dataclass(frozen=True)
class DatasetScore:
    score: float  # pooled mean over every sample (mean@n)
    n: int  # samples
    weight_version_mean: float
    mixed_version_ratio: float
    stderr: float = math.nan  # standard error of the mean over prompts (of per-prompt means)
    derived: dict[str, float] = field(default_factory=dict)  # "pass@k", "pass^k" for each k, "maj@n" when n > 1
    grader_timeouts: int = 0
    counters: dict[str, int] = field(default_factory=dict)  # the scorer's counts, summed over the shards
    extras: dict[str, float] = field(default_factory=dict)  # the scorer's per-sample numbers, averaged
    attested: float = math.nan  # fraction of the shards whose weights were attested (nan: none recorded)
    censoring: dict[str, float] = field(default_factory=dict)  # coord.results.censoring.summary ({}: unknown)


@dataclass(frozen=True)
class Point:
    step: int
    complete: bool
    datasets: dict[str, DatasetScore]
    skips: dict[str, int]  # reason -> number of units skipped for it
    units_total: int
    units_done: int
    completed_at: float | None
    metrics: dict[str, float] = field(default_factory=dict)  # lm-eval tasks: "<task>/<metric>" -> value
    mixed_scorers: tuple[str, ...] = ()  # datasets whose units disagree on the scorer identity: not pooled
    cost: dict[str, float] = field(default_factory=dict)  # every unit's cost summed (eval/cost/*)
    fidelity: dict[str, float] = field(default_factory=dict)  # the worst canary comparison (eval/fidelity/*)
    replays: dict[str, float] = field(default_factory=dict)  # replay facts (replay_facts), never in the scores
    mixed_engines: dict[str, tuple[str, ...]] = field(default_factory=dict)  # dataset -> the engine identity
    # fields its units differ in (coord.engine_identity.differing_fields): not pooled

    @property
    def skipped(self) -> bool:
        return bool(self.skips)


def _version_stats(key: str, step: int, versions: list[str | None]) -> tuple[float, float]:
    """Mean step the samples' versions name (``<key>@<step>`` or plain), and the share not this step's."""
    numeric = [float(n) for v in versions if (n := version_step(v)) is not None]
    mean = sum(numeric) / len(numeric) if numeric else math.nan
    mixed = sum(not version_matches(v, key, step) for v in versions) / len(versions) if versions else 0.0
    return mean, mixed


def _attributed(result: Result, key: str) -> Result:
    """An ok result whose samples name another run's weights is never part of this run's point: it
    counts as a ``pin_violation`` skip (the file itself is left as it is, a fact for audit)."""
    if result.ok and any(version_runs(v) - {key} for v in result.weight_versions):
        return skip_result(result.unit, "pin_violation", "samples carry another run's weight version")
    return result


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct of ``n`` samples: 1 - C(n-c, k) / C(n, k)
    (Chen et al. 2021), exact in integers."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Unbiased pass^k of one prompt with ``c`` correct of ``n`` samples: the chance that ``k`` samples drawn
    without replacement are *all* correct, C(c, k) / C(n, k) (tau-bench, Yao et al. 2024), exact in integers."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass^k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return math.comb(c, k) / math.comb(n, k)


def majority_score(answers: Sequence[str | None], scores: Sequence[float]) -> float:
    """maj@n of one prompt: the score of the most frequent extracted answer.

    Samples without an answer (``None``) do not vote; none at all scores 0. Ties go to the answer that
    appears first in sample order, and the majority answer scores what its first sample scored.
    """
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, answer in enumerate(answers):
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
            first.setdefault(answer, i)
    if not counts:
        return 0.0
    best = max(counts, key=lambda a: (counts[a], -first[a]))
    return float(scores[first[best]])


def correct(score: float, threshold: float = 1.0) -> bool:
    """A sample counts as correct for pass@k when it got full credit (an ``env`` entry: its ``pass_threshold``)."""
    return score >= threshold


@dataclass(frozen=True)
class PromptMajor:
    """A dataset's samples at one step in prompt-major order: every prompt's ``n_samples`` together, in
    sample order, prompts in dataset order — the order an unsplit run's shards concatenate to."""

    scores: list[float]
    versions: list[str | None]
    answers: list[str | None] | None  # None: some unit carries no answers (results from before them)
    truncated: list[float | None] | None = None  # None: some unit recorded no per-sample truncated flags


def prompt_major(spec: SamplesEntry, units: list[Result]) -> PromptMajor:
    """The samples of a dataset's unit results (in :meth:`~ckpteval.coord.entries.Entry.units` order) pooled per
    prompt across the units of a shard's sample ranges (``samples_per_unit``); unsplit: concatenated.
    ValueError naming the unit if a result's number of scores is not its unit's (it would regroup samples
    across prompts; :class:`~ckpteval.coord.results.files.ResultIndex` refuses such a file when it is read)."""
    for r in units:
        check_score_count(spec, r.unit, len(r.scores))
    with_answers = all(len(r.answers) == len(r.scores) for r in units)
    with_cut = all(len(r.truncated) == len(r.scores) for r in units)
    by_shard: dict[int, list[Result]] = {}  # a shard's sample ranges in order: split parts, then granted top-ups
    for r in units:
        by_shard.setdefault(r.unit.shard, []).append(r)
    if all(len(parts) == 1 for parts in by_shard.values()):
        return PromptMajor([s for r in units for s in r.scores], [v for r in units for v in r.weight_versions],
                           [a for r in units for a in r.answers] if with_answers else None,
                           [c for r in units for c in r.truncated] if with_cut else None)
    out = PromptMajor([], [], [] if with_answers else None, [] if with_cut else None)
    for shard, parts in by_shard.items():
        for p in range(len(prompt_range(spec, shard))):
            for r in parts:
                w = len(r.unit.sample_range(spec.n_samples))
                out.scores.extend(r.scores[p * w : (p + 1) * w])
                out.versions.extend(r.weight_versions[p * w : (p + 1) * w])
                if out.answers is not None:
                    out.answers.extend(r.answers[p * w : (p + 1) * w])
                if out.truncated is not None:
                    out.truncated.extend(r.truncated[p * w : (p + 1) * w])
    return out


def dataset_score(spec: SamplesEntry, key: str, step: int, shards: list[Result], n_samples: int | None = None) -> DatasetScore:
    """Every metric of one dataset at one step from its units' results (in :meth:`~ckpteval.coord.entries.Entry.units`
    order, then any granted top-ups: ``n_samples`` per prompt in all), pooled per prompt (:func:`prompt_major`)."""
    pooled = prompt_major(spec, shards)
    scores, versions = pooled.scores, pooled.versions
    mean_v, mixed = _version_stats(key, step, versions)
    n = n_samples or spec.n_samples
    threshold = spec.pass_threshold
    prompts = [scores[i : i + n] for i in range(0, len(scores), n)]
    derived: dict[str, float] = {}
    if prompts and all(len(p) == n for p in prompts):
        right = [sum(correct(x, threshold) for x in p) for p in prompts]
        for k in spec.pass_k:
            derived[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in right) / len(prompts)
            if k > 1:  # pass^1 is pass@1
                derived[f"pass^{k}"] = sum(pass_hat_k(n, c, k) for c in right) / len(prompts)
        if n > 1 and (answers := pooled.answers) is not None:  # old results carry no answers
            votes = [majority_score(answers[i : i + n], scores[i : i + n]) for i in range(0, len(scores), n)]
            derived[f"maj@{n}"] = sum(votes) / len(votes)
    return DatasetScore(
        score=sum(scores) / len(scores) if scores else math.nan,
        n=len(scores),
        weight_version_mean=mean_v,
        mixed_version_ratio=mixed,
        stderr=_stderr([sum(p) / len(p) for p in prompts if p]),
        derived=derived,
        grader_timeouts=sum(r.grader_timeouts for r in shards),
        counters=_sum_counters(shards),
        extras=_mean_extras(shards),
        attested=_attested(shards),
        censoring=censoring.summary(censoring.per_prompt(scores, pooled.truncated, n)),
    )


def _attested(shards: list[Result]) -> float:
    """The fraction of shards whose result says its weights were attested; nan if none says either way."""
    known = [bool(r.attest.get("attested")) for r in shards if r.attest]
    return sum(known) / len(known) if known else math.nan


def point_fidelity(done: list[Result]) -> dict[str, float]:
    """The worst comparison of a point's units: the canary's largest ``max_abs_logprob_diff``, smallest
    ``argmax_agreement``, ``flagged`` 1 if any unit was over the threshold and kept; and each other field (the
    cross-engine check's, ``cross_engine/...``) at its worst: the smallest ``agree``/``agreement``, else the largest
    ({} when no unit compared)."""
    compared = [r.fidelity for r in done if r.fidelity]
    canary = [f for f in compared if "max_abs_logprob_diff" in f]
    worst: dict[str, float] = {}
    if canary:
        worst = {"max_abs_logprob_diff": max(f["max_abs_logprob_diff"] for f in canary),
                 "argmax_agreement": min(f["argmax_agreement"] for f in canary)}
    if any("flagged" in f for f in canary):  # eval.canary.on_fail flag: 1 when a unit was over the threshold
        worst["flagged"] = max(f.get("flagged", 0.0) for f in canary)
    for f in compared:
        for key, value in f.items():
            if "/" in key:  # a named comparison (cross_engine/<dataset>/<engines>/<field>)
                pick = min if key.endswith(("/agree", "/agreement")) else max
                worst[key] = value if key not in worst else pick(worst[key], value)
    return worst


def point_cost(done: list[Result]) -> dict[str, float]:
    """Every unit's ``cost`` summed (``gpus``: the largest engine seen), plus the verification seconds —
    replays included (they are eval compute); with replays also their own sums ``replay_<name>`` and
    ``replay_share``, their part of the step's engine seconds (:func:`replay_share`)."""
    total = _cost_sum(done)
    replayed = [r for r in done if r.unit.replay]
    if replayed and total:
        total.update({f"replay_{name}": v for name, v in _cost_sum(replayed).items() if name != "gpus"})
        total["replay_share"] = replay_share(total)
    return total


def replay_share(cost: dict[str, float]) -> float:
    """The replays' part of a step's eval compute: their GPU-seconds over all (engine seconds when no
    GPU-seconds were recorded, as on CPU); 0 when nothing was timed."""
    for name in ("gpu_s", "engine_s"):
        if cost.get(name, 0.0) > 0:
            return cost.get(f"replay_{name}", 0.0) / cost[name]
    return 0.0


def _cost_sum(done: list[Result]) -> dict[str, float]:
    total: dict[str, float] = {}
    for r in done:
        for name, value in r.cost.items():
            total[name] = max(total.get(name, 0.0), value) if name == "gpus" else total.get(name, 0.0) + value
    if total:
        total["verify_s"] = sum(r.timings.get("verify_s", 0.0) for r in done)
    return total


def _sum_counters(shards: list[Result]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in shards:
        for name, n in r.counters.items():
            out[name] = out.get(name, 0) + n
    return out


def _mean_extras(shards: list[Result]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for r in shards:
        for name, acc in r.extras.items():
            total = sums.setdefault(name, [0.0, 0.0])
            total[0] += acc["sum"]
            total[1] += acc["n"]
    return {name: s / n for name, (s, n) in sums.items() if n}


def scorers_agree(shards: list[Result]) -> bool:
    """Whether every shard that recorded a scorer identity recorded the same one."""
    ids = {json.dumps(r.scorer, sort_keys=True) for r in shards if r.scorer}
    return len(ids) <= 1


def engines_differ(shards: list[Result]) -> tuple[str, ...]:
    """The engine-identity fields in which the shards that recorded one differ (``()``: one identity, or
    none recorded); a shard without a record is not compared, as with :func:`scorers_agree`."""
    ids = {i.key(): i for r in shards if (i := parse_identity(r.engine)) is not None}
    if len(ids) <= 1:
        return ()
    first, *rest = ids.values()
    return tuple(dict.fromkeys(f for other in rest for f in differing_fields(first, other)))


def derive_point(manifest: RunManifest, step: int, results: dict[WorkUnit, Result]) -> Point:
    """The point of ``step`` from whatever results exist (possibly incomplete).

    Only the datasets due at ``step`` (their ``every``) belong to it.
    """
    key = run_key(manifest)
    units = units_for_step(manifest, step)
    given = results
    results = {u: _attributed(results[u], key) for u in units if u in results}
    done = [results[u] for u in units if u in results]
    skips: dict[str, int] = {}
    for r in done:
        if not r.ok and not r.unit.replay:  # a replay's skip is the replay's (replay_facts), not the point's
            skips[r.skip_reason or "unknown"] = skips.get(r.skip_reason or "unknown", 0) + 1
    datasets, mixed, metrics = {}, [], {}
    mixed_engines: dict[str, tuple[str, ...]] = {}
    granted: list[Result] = []
    for entry in manifest.eval.entries:
        if not entry.due(step):
            continue
        mine = [results.get(u) for u in entry.units(step)]
        if not scored_per_sample(entry):
            metrics.update(unit_metrics(entry, key, step, mine))
        elif all(r is not None and r.ok for r in mine):
            if not scorers_agree(mine):  # type: ignore[arg-type]
                mixed.append(entry.name)
                continue
            if differ := engines_differ(mine):  # type: ignore[arg-type]
                mixed_engines[entry.name] = differ
                continue
            extra = topups(entry.n_samples, step, entry.name, given, entry.n_shards)  # granted samples (coord.work.grants)
            granted += extra
            n = max([entry.n_samples] + [r.unit.sample_stop for r in extra])
            datasets[entry.name] = dataset_score(entry, key, step, mine + [_attributed(r, key) for r in extra], n)  # type: ignore[operator]
    complete = len(done) == len(units)
    return Point(
        metrics=metrics,
        step=step,
        complete=complete,
        datasets=datasets,
        skips=skips,
        units_total=len(units),
        units_done=len(done),
        completed_at=max((r.written_at for r in done), default=None) if complete else None,
        mixed_scorers=tuple(mixed),
        cost=point_cost(done + granted),
        fidelity=point_fidelity(done),
        replays=replay_facts(manifest, step, results),
        mixed_engines=mixed_engines,
    )


def replay_facts(manifest: RunManifest, step: int, results: dict[WorkUnit, Result]) -> dict[str, float]:
    """What a replayed step's replays say (:mod:`ckpteval.coord.results.replays`), each replay copy ``k`` against the
    point's own units, per dataset whose units and copy all have ok results: ``<ds>/replay/diff`` (the copy's
    mean minus the point's, the largest in absolute value over the copies) and ``<ds>/replay/changed`` (the
    largest fraction of prompts whose score moved); ``replay_skipped_<reason>`` counts replays skipped. These
    are facts for the noise estimates and the logs; the point's scores never include a replay."""
    out: dict[str, float] = {}
    for r in results.values():
        if r.unit.replay and not r.ok:
            name = f"replay_skipped_{r.skip_reason or 'unknown'}"
            out[name] = out.get(name, 0.0) + 1.0
    settings = manifest.eval.replay
    if not settings.due(step):
        return out
    for entry in manifest.eval.entries:
        if not entry.due(step) or not scored_per_sample(entry):
            continue
        own = _prompt_means(entry, [results.get(u) for u in entry.units(step)])
        if own is None:
            continue
        for k in range(1, settings.copies + 1):
            again = _prompt_means(entry, [results.get(u.as_replay(k)) for u in entry.units(step)])
            if again is None or len(again) != len(own):
                continue
            diff = (sum(again) - sum(own)) / len(own)
            changed = sum(a != b for a, b in zip(again, own, strict=True)) / len(own)
            if abs(diff) >= abs(out.get(f"{entry.name}/replay/diff", 0.0)):
                out[f"{entry.name}/replay/diff"] = diff
            out[f"{entry.name}/replay/changed"] = max(out.get(f"{entry.name}/replay/changed", 0.0), changed)
    return out


def _prompt_means(spec: SamplesEntry, results: list[Result | None]) -> list[float] | None:
    """Per-prompt mean scores of one evaluation of a dataset (None unless every unit has an ok result)."""
    if not results or any(r is None or not r.ok for r in results):
        return None
    scores = prompt_major(spec, results).scores  # type: ignore[arg-type]
    n = spec.n_samples  # type: ignore[attr-defined]
    return [sum(scores[i : i + n]) / n for i in range(0, len(scores), n)]


def unit_metrics(entry: Entry, key: str, step: int, results: list[Result | None]) -> dict[str, float]:
    """The point rule ``metrics``: ``"<root>/<metric>"`` for every unit of ``entry`` (in :meth:`Entry.units`
    order, unit ``i`` under ``entry.metric_roots()[i]``: an lm-eval task) with an ok result, plus its pin evidence."""
    out: dict[str, float] = {}
    for task, r in zip(entry.metric_roots(), results, strict=True):
        if r is None or not r.ok:
            continue
        out.update({f"{task}/{name}": value for name, value in r.metrics.items()})
        mean_v, mixed = _version_stats(key, step, list(r.weight_versions))
        out[f"{task}/weight_version/mean"] = mean_v
        out[f"{task}/weight_version/mixed_version_ratio"] = mixed
    return out


def point_metrics(point: Point) -> dict[str, float]:
    """The metric names of one point (docs/PROTOCOL.md §7; ``eval/lag_steps`` is added by the ingester)."""
    metrics: dict[str, float] = {"eval/step": point.step}
    for name, ds in point.datasets.items():
        metrics[f"eval/{name}"] = ds.score
        metrics[f"eval/{name}/weight_version/mean"] = ds.weight_version_mean
        metrics[f"eval/{name}/weight_version/mixed_version_ratio"] = ds.mixed_version_ratio
        metrics[f"eval/{name}/stderr"] = ds.stderr
        metrics[f"eval/{name}/grader_timeouts"] = ds.grader_timeouts
        for key, value in {**ds.derived, **ds.counters, **ds.extras}.items():
            metrics[f"eval/{name}/{key}"] = value
        if not math.isnan(ds.attested):
            metrics[f"eval/{name}/attested"] = ds.attested
        for key in ("lower", "completed", "censored") if ds.censoring else ():  # coord.results.censoring
            metrics[f"eval/{name}/{key}"] = ds.censoring[key]
            metrics[f"eval/{name}/{key}/stderr"] = ds.censoring[f"{key}_stderr"]
    for key, value in point.cost.items():
        metrics[f"eval/cost/{key}"] = value
    for key, value in point.fidelity.items():
        metrics[f"eval/fidelity/{key}"] = value
    for key, value in point.replays.items():
        metrics[f"eval/{key}"] = value
    for name in point.mixed_scorers:
        metrics[f"eval/{name}/scorer_mixed"] = 1.0
    for name in point.mixed_engines:
        metrics[f"eval/{name}/engine_mixed"] = 1.0
    metrics.update({f"eval/{name}": value for name, value in point.metrics.items()})
    for reason, n in point.skips.items():
        metrics[f"eval/skipped_{reason}"] = n
    return metrics
