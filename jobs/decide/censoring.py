"""Whether a difference between two steps is within what censoring (answers cut at the length limit) alone could
explain: the rule of docs/USER_GUIDE.md "Cut-off answers (censoring)", for ``compare`` and ``best``.

Per dataset and pair of steps (A, B; same prompts) three paired intervals of B - A (:func:`paired_interval`, per-prompt
values of :mod:`ckpteval.coord.results.censoring`): the lower bound (cut-off counted wrong: the score every other
decision reads), the completed-only score, the censored share. The lower bound's difference is *within censoring*
when it is distinguishable and (a) the completed-only difference has the other sign (``flips``), or (b) its interval
contains 0 (``vanishes``), or (c) the step behind on the lower bound lost at least the difference to more cut-offs
(``share``: ``-sign(d_lower) * d_censored >= |d_lower|``, so counting its extra cut-offs right would close the gap).
Its difference is *hidden by censoring* when the lower bound's is not distinguishable but the completed-only one is.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckpteval.coord.results import censoring
from ckpteval.coord.results.points import prompt_major
from ckpteval.jobs.decide.data import Metric, RunValues
from ckpteval.jobs.decide.stats import Best, Interval, paired_interval

WHY = {"flips": "the completed-only difference has the other sign",
       "vanishes": "the completed-only difference is not distinguishable from 0",
       "share": "the step behind lost at least the difference to more cut-off answers"}


def per_prompt(side: RunValues, step: int, dataset: str) -> censoring.PerPrompt | None:
    """The censoring of ``dataset`` at ``step`` per prompt (None: some sample's cut-off was not recorded);
    ValueError when the step has no complete point of it."""
    side.values(step, Metric(dataset, "mean"))  # the point is complete and this run's (else ValueError)
    spec = side.manifest.entry(dataset)
    pooled = prompt_major(spec, [side.results[u] for u in spec.units(step)])
    return censoring.per_prompt(pooled.scores, pooled.truncated, spec.n_samples)


def arrays(pp: censoring.PerPrompt) -> dict[str, np.ndarray]:
    """The per-prompt values of the three numbers (``completed``: linearised, empty when nothing completed)."""
    return {"lower": np.array(pp.lower), "completed": np.array(censoring.completed_values(pp)),
            "censored": np.array(pp.censored)}


def rule(a: censoring.PerPrompt, b: censoring.PerPrompt, level: float) -> dict[str, Any] | None:
    """The three paired intervals of B - A and the module docstring's verdict (None when one side completed
    nothing, so it has no completed-only score)."""
    va, vb = arrays(a), arrays(b)
    if not va["completed"].size or not vb["completed"].size:
        return None
    iv: dict[str, Interval] = {k: paired_interval(va[k], vb[k], level) for k in va}
    low, done, cut = iv["lower"], iv["completed"], iv["censored"]
    reasons = []
    if low.distinguishable:
        if np.sign(done.estimate) == -np.sign(low.estimate) != 0:
            reasons.append("flips")
        elif not done.distinguishable:
            reasons.append("vanishes")
        if -np.sign(low.estimate) * cut.estimate >= abs(low.estimate):
            reasons.append("share")
    return {**{k: v.to_json() for k, v in iv.items()}, "within_censoring": bool(reasons), "why": reasons,
            "hidden_by_censoring": not low.distinguishable and done.distinguishable}


def note(found: dict[str, Any] | None) -> str | None:
    """One line on a compared pair's censoring (None when there is nothing to say)."""
    if found is None:
        return None
    d = {k: found[k]["estimate"] for k in ("lower", "completed", "censored")}
    numbers = f"lower {d['lower']:+.4f}, completed-only {d['completed']:+.4f}, censored share {d['censored']:+.4f}"
    if found["within_censoring"]:
        return f"within what censoring alone could explain ({numbers}: {'; '.join(WHY[w] for w in found['why'])})"
    if found["hidden_by_censoring"]:
        return f"censoring may hide a difference ({numbers}: the completed-only difference is distinguishable)"
    return f"censoring does not explain it ({numbers})" if d["censored"] else None


def for_compare(a: RunValues, step_a: int, b: RunValues, step_b: int, dataset: str, level: float) -> dict[str, Any]:
    """A compare row's ``censoring`` fields ({} when either side's cut-offs were not recorded)."""
    pa, pb = per_prompt(a, step_a, dataset), per_prompt(b, step_b, dataset)
    if pa is None or pb is None or len(pa.lower) != len(pb.lower) or len(pa.lower) < 2:
        return {}
    found = rule(pa, pb, level)
    return {"censoring": found, "censoring_note": note(found)} if found is not None else {}


def for_best(side: RunValues, dataset: str, best: Best, level: float) -> dict[str, Any] | None:
    """What ``best`` says of censoring (None when some step's cut-offs were not recorded): the best step on
    completed answers, each step's three numbers, and the steps that trail the best on the lower bound only within
    what censoring could explain (the rule at the family level of :func:`best_step`)."""
    steps = sorted([best.step, *best.differences])
    pps = {s: per_prompt(side, s, dataset) for s in steps}
    if any(pp is None or len(pp.lower) < 2 for pp in pps.values()):
        return None
    numbers = {str(s): {k: v if np.isfinite(v) else None for k, v in censoring.summary(pp).items()}
               for s, pp in pps.items()}
    done = {s: n["completed"] for s, n in numbers.items() if n["completed"] is not None}
    within: dict[str, list[str]] = {}
    for s, iv in best.differences.items():
        found = rule(pps[s], pps[best.step], iv.level) if iv.distinguishable else None  # type: ignore[arg-type]
        if found is not None and found["within_censoring"]:
            within[str(s)] = found["why"]
    best_done = int(max(done, key=lambda s: (done[s], -int(s)))) if done else None
    return {"best_completed": best_done, "steps": numbers, "within_censoring": within}


def best_lines(found: dict[str, Any] | None, best: int) -> list[str]:
    """What ``best``'s text says of censoring."""
    if not found:
        return []
    lines = []
    if found["best_completed"] is not None and found["best_completed"] != best:
        top, own = found["steps"][str(found["best_completed"])], found["steps"][str(best)]
        lines.append(f"censoring: on completed answers step {found['best_completed']} scores highest "
                     f"({_num(top['completed'])}, censored share {_num(top['censored'])}) against step {best}'s "
                     f"{_num(own['completed'])} (censored {_num(own['censored'])})")
    for s, why in found["within_censoring"].items():
        lines.append(f"censoring: step {s} trails step {best} only within what censoring alone could explain "
                     f"({'; '.join(WHY[w] for w in why)})")
    return lines


def _num(x: float | None) -> str:
    return "none completed" if x is None else f"{x:.4f}"
