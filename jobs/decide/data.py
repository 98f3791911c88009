"""Per-prompt values of a run's points: what the paired statistics of :mod:`ckpteval.jobs.decide.stats` compare.

A metric name is ``eval/<ds>`` (mean over the prompt's samples), ``eval/<ds>/pass@k`` (the unbiased
pass@k of each prompt), ``eval/<ds>/pass^k`` (the unbiased pass^k of each prompt, C(c, k) / C(n, k):
:func:`ckpteval.coord.results.points.pass_hat_k`; logged for each k > 1 of ``pass_k``) or ``eval/<ds>/maj@n`` (majority
vote), the same per-prompt quantities whose average is the logged point (:func:`ckpteval.coord.results.points.dataset_score`). Prompts are the dataset's rows in
order; shard results are concatenated in shard order, so index ``i`` is the same prompt at every step.

Guarantee: a step is used only when its point has this dataset (every shard an ok result of this
run's weights, :func:`ckpteval.coord.results.files.derive_point`); values come from the results files as written.
Limits: two runs are paired only when their eval sets are the same bytes with the same sampling
(:func:`check_paired`); lm-eval harness tasks carry no per-sample scores and cannot be compared here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ckpteval.coord.entries import scored_per_sample
from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.results.points import (
    correct,
    derive_point,
    majority_score,
    pass_at_k,
    pass_hat_k,
    prompt_major,
)
from ckpteval.coord.results.scorings import scoring_results
from ckpteval.coord.run.identity import run_key, version_matches
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.grants import topups


@dataclass(frozen=True)
class Metric:
    """A parsed ``eval/<ds>[/pass@k|/pass^k|/maj@n]`` name."""

    dataset: str
    kind: str  # "mean", "pass", "pass^" (all k right) or "maj"
    k: int = 0

    @property
    def name(self) -> str:
        suffix = {"mean": "", "pass": f"/pass@{self.k}", "pass^": f"/pass^{self.k}", "maj": f"/maj@{self.k}"}
        return f"eval/{self.dataset}" + suffix[self.kind]


def default_metric(manifest: RunManifest) -> str:
    """What ``--metric`` defaults to: ``eval/<the first entry scored per sample>``."""
    return f"eval/{[e for e in manifest.eval.entries if scored_per_sample(e)][0].name}"


def parse_metric(text: str, manifest: RunManifest) -> Metric:
    """``eval/<ds>[/pass@k|/pass^k|/maj@n]`` checked against the run's datasets; ValueError names what is wrong."""
    parts = text.split("/")
    if parts[0] != "eval" or len(parts) not in (2, 3):
        raise ValueError(f"--metric {text!r}: expected eval/<dataset>, eval/<dataset>/pass@k, eval/<dataset>/pass^k "
                         "or eval/<dataset>/maj@n")
    names = [d.name for d in manifest.eval.entries if scored_per_sample(d)]
    if parts[1] not in names:
        raise ValueError(f"--metric {text!r}: no dataset {parts[1]!r} in this run (datasets: {', '.join(names)})")
    spec = manifest.entry(parts[1])
    if len(parts) == 2:
        return Metric(parts[1], "mean")
    if parts[2].startswith("pass^"):
        k = parts[2][len("pass^"):]
        if k.isdigit() and int(k) in spec.pass_k and int(k) > 1:
            return Metric(parts[1], "pass^", int(k))
        raise ValueError(f"--metric {text!r}: {parts[2]!r} is not logged for {parts[1]} (pass^k for each k > 1 of "
                         f"pass_k {list(spec.pass_k)}; pass^1 is pass@1)")
    kind, _, k = parts[2].partition("@")
    if kind == "pass" and k.isdigit() and int(k) in spec.pass_k:
        return Metric(parts[1], "pass", int(k))
    if kind == "maj" and k == str(spec.n_samples) and spec.n_samples > 1:
        return Metric(parts[1], "maj", spec.n_samples)
    raise ValueError(f"--metric {text!r}: {parts[2]!r} is not logged for {parts[1]} "
                     f"(pass_k {list(spec.pass_k)}, n_samples {spec.n_samples})")


@dataclass
class RunValues:
    """One run's results, read once: per-prompt values of any step and metric."""

    run: RunDir
    scoring: str | None = None  # a ckpteval rescore scoring's scores where it re-scored a unit (None: as generated)
    only_steps: Collection[int] | None = None  # read just these steps' results (None: every step)

    def __post_init__(self) -> None:
        self.manifest = self.run.manifest()
        self.results = scoring_results(self.run, self.scoring, self.only_steps)[0]
        self._steps: dict[str, list[int]] = {}

    def steps_with(self, dataset: str) -> list[int]:
        """Steps whose point has ``dataset`` (every shard ok and this run's); computed once per dataset."""
        if dataset not in self._steps:
            steps = sorted({u.step for u in self.results if u.dataset == dataset})
            self._steps[dataset] = [s for s in steps
                                    if dataset in derive_point(self.manifest, s, self.results).datasets]
        return self._steps[dataset]

    def values(self, step: int, metric: Metric, replay: int = 0) -> np.ndarray:
        """Per-prompt values of ``metric`` at ``step`` (of its ``replay``-th replay, :mod:`ckpteval.coord.results.replays`);
        ValueError when the step has no such point (or replay)."""
        if step not in self.steps_with(metric.dataset):
            raise ValueError(f"{self.run.path}: step {step} has no complete {metric.dataset} point "
                             f"(steps with one: {self.steps_with(metric.dataset) or 'none'})")
        spec = self.manifest.entry(metric.dataset)
        mine = [self.results.get(u.as_replay(replay)) for u in spec.units(step)]
        if any(r is None or not r.ok for r in mine):
            raise ValueError(f"{self.run.path}: replay {replay} of step {step} is not complete for {metric.dataset}")
        key = run_key(self.manifest)
        if replay and not all(version_matches(v, key, step) for r in mine for v in r.weight_versions):  # type: ignore[union-attr]
            raise ValueError(f"{self.run.path}: replay {replay} of step {step} was not all produced by step {step}'s "
                             "weights: not a replay of that point")
        extra = [] if replay else topups(spec.n_samples, step, spec.name, self.results, spec.n_shards)  # granted samples
        pooled = prompt_major(spec, mine + extra)  # type: ignore[arg-type, operator]
        scores, answers = pooled.scores, pooled.answers
        n = max([spec.n_samples] + [r.unit.sample_stop for r in extra])
        groups = [scores[i : i + n] for i in range(0, len(scores), n)]
        if metric.kind in ("pass", "pass^"):
            estimate = pass_at_k if metric.kind == "pass" else pass_hat_k
            return np.array([estimate(n, sum(correct(x, spec.pass_threshold) for x in g), metric.k) for g in groups])
        if metric.kind == "maj":
            if answers is None:
                raise ValueError(f"{self.run.path}: step {step} results carry no extracted answers for maj@{n}")
            return np.array([majority_score(answers[i : i + n], scores[i : i + n]) for i in range(0, len(scores), n)])
        return np.array([sum(g) / len(g) for g in groups])


    def replay_pairs(self, metric: Metric) -> list[tuple[np.ndarray, np.ndarray]]:
        """(the point's per-prompt values, a replay's) of every replayed step and copy of ``metric`` whose
        point and replay are both complete — what :func:`ckpteval.jobs.decide.noise.engine_noise` estimates from."""
        settings = self.manifest.eval.replay
        pairs = []
        for step in self.steps_with(metric.dataset) if settings.enabled else []:
            if not settings.due(step):
                continue
            for k in range(1, settings.copies + 1):
                try:
                    pairs.append((self.values(step, metric), self.values(step, metric, replay=k)))
                except ValueError:
                    continue  # that replay is not done (or was skipped): no pair
        return pairs


def _data_digest(run: RunDir, spec: GenerateEntry) -> str:
    try:
        return hashlib.sha256(run.resolve_data_path(spec.path).read_bytes()).hexdigest()
    except FileNotFoundError:
        return ""


def check_paired(a: RunValues, b: RunValues, dataset: str) -> None:
    """ValueError unless both runs evaluate ``dataset`` on the same rows with the same sampling."""
    sa, sb = a.manifest.entry(dataset), b.manifest.entry(dataset)
    fields = {"prompts": (sa.n_prompts, sb.n_prompts), "samples per prompt (n_samples)": (sa.n_samples, sb.n_samples),
              "seed": (sa.seed, sb.seed), "temperature": (sa.temperature, sb.temperature)}
    differ = [f"{name} {x} vs {y}" for name, (x, y) in fields.items() if x != y]
    if _data_digest(a.run, sa) != _data_digest(b.run, sb):
        differ.append("the rows' bytes (sha256 of the data file)")
    if differ:
        raise ValueError(f"{a.run.path} and {b.run.path}: dataset {dataset!r} differs ({'; '.join(differ)}): the "
                         "scores are not paired prompt by prompt")


def open_run(path: Path, scoring: str | None = None) -> RunValues:
    return RunValues(RunDir.open(path), scoring)
