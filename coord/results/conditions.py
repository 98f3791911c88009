"""Targets on points: ``'eval/<ds>[/pass@k] >= X'`` (``backfill --until``, ``train --eval-stop-when``) and
the ranking of points by a metric (``--eval-keep-best``).

Grammar: a logged point metric name (``eval/...``), one of ``>= > <= <``, a number; spaces optional; then
optionally ``margin M`` (a number) or ``margin mde``: the point must pass the threshold by that much —
``value >= X + M`` for ``>=``/``>``, ``value <= X - M`` for ``<=``/``<`` — so a point inside its own noise of
the target does not count. ``mde`` is the point's own minimum detectable effect against a fixed target,
``(z_0.975 + z_0.8) * eval/<ds>/stderr`` (95 %, power 80 %; the standard error over prompts the point is
logged with): only for a dataset's mean (``eval/<ds>``), the metric that has a logged standard error. It
covers the prompts' sampling noise only: the engine's shared noise needs replays, which a single point has
not (``ckpteval compare`` and ``best`` use them).
Guarantee: :func:`parse_condition` accepts exactly that and raises one ValueError naming the flag
otherwise; :func:`first_passing` judges only *complete* points (every unit has a result), with the
metrics the point is logged with (:func:`ckpteval.coord.results.files.point_metrics`). :func:`top_steps` ranks steps by a metric value, best first. Limits: a metric
the point does not have (a dataset not due at that step, a skipped dataset) never passes nor ranks.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from statistics import NormalDist

from ckpteval.coord.results.files import Result
from ckpteval.coord.results.points import derive_point, point_metrics
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.work.units import WorkUnit

OPS: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, ">": operator.gt, "<=": operator.le,
                                                 "<": operator.lt}
NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
PATTERN = re.compile(rf"^\s*(eval/\S+?)\s*(>=|<=|>|<)\s*({NUMBER})(?:\s+margin\s+(mde|{NUMBER}))?\s*$")
MDE_FACTOR = NormalDist().inv_cdf(0.975) + NormalDist().inv_cdf(0.8)  # ``margin mde``: (z_0.975 + z_0.8) x stderr


@dataclass(frozen=True)
class Condition:
    metric: str  # a point metric name, e.g. eval/gsm8k or eval/gsm8k/pass@4
    op: str  # one of OPS
    threshold: float
    margin: float | str = 0.0  # by how much the threshold must be passed: a number, or "mde"

    @property
    def text(self) -> str:
        margin = "" if self.margin == 0.0 else f" margin {self.margin if self.margin == 'mde' else f'{self.margin:g}'}"
        return f"{self.metric} {self.op} {self.threshold:g}{margin}"

    def holds(self, metrics: Mapping[str, float]) -> bool:
        value = metrics.get(self.metric)
        margin = self._margin(metrics)
        if value is None or math.isnan(value) or margin is None:
            return False
        target = self.threshold + margin if self.op in (">=", ">") else self.threshold - margin
        return OPS[self.op](float(value), target)

    def _margin(self, metrics: Mapping[str, float]) -> float | None:
        """The margin for this point (None: ``mde`` and the point logs no standard error for the metric)."""
        if self.margin != "mde":
            return float(self.margin)
        stderr = metrics.get(f"{self.metric}/stderr")
        return None if stderr is None or math.isnan(stderr) else MDE_FACTOR * float(stderr)


def parse_condition(text: str, flag: str) -> Condition:
    """``'eval/<ds> >= 0.8'`` -> Condition; ValueError (one line, naming ``flag``) otherwise."""
    m = PATTERN.match(text)
    if m is None:
        raise ValueError(f"{flag} {text!r}: expected 'eval/<dataset>[/pass@k] OP NUMBER' with OP one of >= > <= < "
                         "(and optionally 'margin M' or 'margin mde')")
    margin: float | str = 0.0 if m.group(4) is None else ("mde" if m.group(4) == "mde" else float(m.group(4)))
    if margin == "mde" and m.group(1).count("/") != 1:
        raise ValueError(f"{flag} {text!r}: 'margin mde' needs a dataset's mean (eval/<dataset>): only it has a "
                         "logged standard error")
    if isinstance(margin, float) and margin < 0:
        raise ValueError(f"{flag} {text!r}: a margin must be >= 0")
    return Condition(m.group(1), m.group(2), float(m.group(3)), margin)


def eval_names(manifest: RunManifest) -> set[str]:
    """The dataset and lm-eval task names a point metric ``eval/<name>/...`` can start with."""
    return {root for e in manifest.eval.entries for root in e.metric_roots()}


def check_metric(condition: Condition, names: set[str], flag: str) -> None:
    """ValueError when the condition's metric names none of ``names`` (:func:`eval_names`)."""
    if condition.metric.split("/")[1] not in names:
        raise ValueError(f"{flag} {condition.text!r}: no dataset or task {condition.metric.split('/')[1]!r} in "
                         f"this run (has: {', '.join(sorted(names))})")


def first_passing(manifest: RunManifest, results: Mapping[WorkUnit, Result], condition: Condition) -> int | None:
    """The lowest step whose complete point satisfies ``condition`` (None: none yet)."""
    for step in sorted({u.step for u in results}):
        point = derive_point(manifest, step, dict(results))
        if point.complete and condition.holds(point_metrics(point)):
            return step
    return None


def point_value(manifest: RunManifest, results: Mapping[WorkUnit, Result], step: int, metric: str) -> float:
    """``metric`` of ``step``'s point as logged (NaN when the point does not have it)."""
    value = point_metrics(derive_point(manifest, step, dict(results))).get(metric)
    return math.nan if value is None else float(value)


def top_steps(values: Mapping[int, float], k: int, higher_is_better: bool = True) -> set[int]:
    """The ``k`` steps with the best values (NaN never ranks; ties go to the newer step)."""
    sign = 1.0 if higher_is_better else -1.0
    ranked = sorted((s for s, v in values.items() if not math.isnan(v)), key=lambda s: (sign * values[s], s),
                    reverse=True)
    return set(ranked[:k])
