"""The dispatcher's side of adaptive evaluation: read the complete points, ask :func:`open_steps` where the
decision is open, keep within the GPU budget, and record each choice as a grant (``RUN/grants.jsonl``,
:mod:`ckpteval.coord.work.grants`) that the fleet evaluates as ordinary units. Guide: docs/USER_GUIDE.md
"Adaptive evaluation".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from ckpteval.coord.entries import scored_per_sample
from ckpteval.coord.results.conditions import Condition
from ckpteval.coord.results.files import Result
from ckpteval.coord.results.points import prompt_major
from ckpteval.coord.run.ledger import LedgerState
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.work.grants import Grant, Grants, topups
from ckpteval.coord.work.workunit import WorkUnit
from ckpteval.jobs.trainer.adaptive.policy import (
    AdaptiveSettings,
    StepValues,
    Want,
    open_steps,
    parse_adaptive,
)

Results = Mapping[WorkUnit, Result]


def open_spender(text: str, run_path: Path, manifest: RunManifest, target: Condition | None) -> AdaptiveSpender:
    """``--eval-adaptive TEXT``'s spender for the run at ``run_path`` (its ``grants.jsonl``)."""
    return AdaptiveSpender(parse_adaptive(text, "--eval-adaptive"), manifest, Grants.of(run_path), target)


class AdaptiveSpender:
    """One run's adaptive evaluation of one dataset (:class:`AdaptiveSettings`)."""

    def __init__(self, settings: AdaptiveSettings, manifest: RunManifest, grants: Grants,
                 target: Condition | None = None) -> None:
        try:
            entry = manifest.entry(settings.dataset)
        except KeyError:
            names = ", ".join(e.name for e in manifest.eval.entries)
            raise ValueError(f"--eval-adaptive {settings.text!r}: no dataset {settings.dataset!r} in this run (has: {names})") from None
        if not scored_per_sample(entry):
            raise ValueError(f"--eval-adaptive {settings.text!r}: {settings.dataset!r} is not scored per sample "
                             "(an lm_eval task): only generate and env sets can be given more samples")
        self.settings, self.manifest, self.grants, self.target, self.entry = settings, manifest, grants, target, entry
        self.cap = settings.max_samples or 8 * entry.n_samples

    def outstanding(self, step: int, results: Results) -> bool:
        """Some unit granted to ``step`` has no result yet (its point waits for it)."""
        return any(u not in results for u in self.grants.units(self.manifest, step))

    def values(self, step: int, results: Results) -> StepValues | None:
        """The step's per-prompt means over its samples, granted ones pooled (None: not complete and ok)."""
        mine = [results.get(u) for u in self.entry.units(step)] if self.entry.due(step) else []
        if not mine or any(r is None or not r.ok for r in mine):
            return None
        extra = topups(self.entry.n_samples, step, self.entry.name, results, self.entry.n_shards)
        n = max([self.entry.n_samples] + [r.unit.sample_stop for r in extra])
        scores = np.asarray(prompt_major(self.entry, mine + extra).scores, dtype=float)  # type: ignore[operator]
        return StepValues(step, scores.reshape(-1, n).mean(axis=1), n)

    def spend(self, by_step: Mapping[int, Results], state: LedgerState,
              can_grant: Callable[[int], bool], final: bool = False) -> list[Grant]:
        """Grant more samples to the open steps among ``by_step`` (complete points) within the budget, most urgent
        first; returns (and records) the grants."""
        points = [v for s, r in sorted(by_step.items()) if (v := self.values(s, r)) is not None]
        spent = math.fsum(r.cost.get("gpu_s", 0.0) for results in by_step.values() for r in results.values())
        made = []
        for want in open_steps(self.settings, points, self.cap, self.target, final=final):
            if not can_grant(want.step) or self.outstanding(want.step, by_step[want.step]):
                continue
            cost = self._cost(by_step[want.step], want)
            if not self._affordable(spent + cost, state, len(by_step)):
                continue
            start = max(self.entry.n_samples, self.grants.samples(want.step, self.entry.name))
            grant = Grant(want.step, self.entry.name, start, start + want.add, want.reason)
            self.grants.append(grant)
            spent += cost
            made.append(grant)
        return made

    def _cost(self, results: Results, want: Want) -> float:
        """The grant's GPU-seconds, estimated from the step's own units of the dataset (per sample)."""
        base = math.fsum(r.cost.get("gpu_s", 0.0) for u, r in results.items()
                         if u.dataset == self.entry.name and not u.replay and u.sample_start < self.entry.n_samples)
        return base * want.add / self.entry.n_samples

    def _affordable(self, total_gpu_s: float, state: LedgerState, points: int) -> bool:
        if self.settings.gpu_s_per_point is not None:
            return total_gpu_s <= self.settings.gpu_s_per_point * max(points, 1)
        if self.settings.fraction is not None:
            trained = max((float(r["train_gpu_s"]) for r in state.dispatched.values()
                           if isinstance(r.get("train_gpu_s"), int | float)), default=0.0)
            return total_gpu_s <= self.settings.fraction * trained
        return True
