"""Scorings: the results of a run re-scored from kept completions, beside the original ones.

``ckpteval rescore`` (:mod:`ckpteval.jobs.eval.worker.rescore`) applies another scorer (or other scorer options) to the
kept completions (:mod:`ckpteval.coord.results.completions`) of chosen steps and datasets and publishes each unit's new
result under ``RUN/scorings/<name>/``::

    RUN/scorings/<name>/scoring.json            {"name", "scorer", "scorer_options", "created"}: what it applies
    RUN/scorings/<name>/results/step-<N>/<unit>.json   the unit's re-scored result (first writer wins)
    RUN/scorings/<name>/leases/step-<N>/<unit>.lock    the re-scoring claims (the run's lease settings)

A re-scored result is a result (:mod:`ckpteval.coord.results.files`): the same weight versions as the original (the
generation is the same), new scores, answers and ``scorer`` identity. The original results are never touched.

A *view of a scoring* (status, plot, compare ``--scoring NAME``) takes each unit's re-scored result where the
scoring has one and the original elsewhere (:func:`overlay`), so a point re-scored on some datasets shows the
new scores there; a dataset re-scored on only some of its units mixes two scorer identities, which a point
flags (``eval/<ds>/scorer_mixed``) instead of pooling. Guarantee: a view without a scoring reads exactly what
it read before scorings existed. Limits: a scoring's results are not summarised (``step.summary``): a view of
a scoring reads the re-scored steps' result files.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from pathlib import Path

from ckpteval.coord.atomic import read_json_object
from ckpteval.coord.results.files import Result, ResultIndex
from ckpteval.coord.results.summary import StepFacts, read_step_facts, step_facts
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.work.units import WorkUnit

SCORINGS = "scorings"
SCORING_FILE = "scoring.json"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise ValueError(f"scoring name {name!r}: letters, digits, '_', '.', '-' (at most 100), starting with a "
                         "letter or digit")
    return name


def scoring_dir(run: RunDir, name: str) -> Path:
    return run.path / SCORINGS / check_name(name)


def scoring_names(run: RunDir) -> list[str]:
    """The scorings of ``run`` that have a ``scoring.json``."""
    root = run.path / SCORINGS
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if NAME_RE.match(p.name) and (p / SCORING_FILE).is_file())


def budget_scorings(run: RunDir) -> dict[int, str]:
    """The scorings ``ckpteval rescore --budget N`` made with each dataset's own scorer, options and reasoning:
    budget -> name (the first by name when two share a budget)."""
    found: dict[int, str] = {}
    for name in scoring_names(run):
        rec = read_json_object(scoring_dir(run, name) / SCORING_FILE)
        own = all(rec.get(k) is None for k in ("scorer", "scorer_options", "reasoning"))
        if own and isinstance(rec.get("budget"), int):
            found.setdefault(rec["budget"], name)
    return found


def open_scoring(run: RunDir, name: str) -> Path:
    """The directory of an existing scoring; FileNotFoundError naming the scorings there otherwise."""
    path = scoring_dir(run, name)
    if not (path / SCORING_FILE).is_file():
        known = ", ".join(scoring_names(run)) or "none"
        raise FileNotFoundError(f"{path}: no scoring {name!r} in this run (scorings: {known}; ckpteval rescore makes one)")
    return path


def scoring_label(name: str | None) -> str:
    """`` (scoring NAME)`` for a view of a scoring (titles name what they show), ``""`` for the original."""
    return f" (scoring {name})" if name else ""


def overlay(original: Mapping[WorkUnit, Result], rescored: Mapping[WorkUnit, Result]) -> dict[WorkUnit, Result]:
    """Each unit's re-scored result where there is one, else its original."""
    return {**original, **rescored}


def scoring_results(run: RunDir, name: str | None,
                    only_steps: Collection[int] | None = None) -> tuple[dict[WorkUnit, Result], dict[str, str]]:
    """Every unit's result (of ``only_steps``; None: every step) as the scoring ``name`` shows it (None: the
    original results), and the malformed result files read (name -> why)."""
    manifest = run.manifest()
    base = ResultIndex(run.results, manifest)
    results = dict(base.refresh(only_steps=only_steps))
    if name is None:
        return results, dict(base.errors)
    index = ResultIndex(open_scoring(run, name) / "results", manifest)
    merged = overlay(results, index.refresh(only_steps=only_steps))
    return merged, {**base.errors, **{f"{SCORINGS}/{name}/{k}": v for k, v in index.errors.items()}}


def scoring_step_facts(run: RunDir, manifest: RunManifest,
                       name: str | None) -> tuple[dict[int, StepFacts], dict[str, str]]:
    """:func:`ckpteval.coord.results.summary.read_step_facts` of the view of scoring ``name`` (None: the original)."""
    facts, errors = read_step_facts(run.results, manifest)
    if name is None:
        return facts, errors
    index = ResultIndex(open_scoring(run, name) / "results", manifest)
    rescored = index.refresh()
    steps = {u.step for u in rescored}
    base = ResultIndex(run.results, manifest)
    base.refresh(only_steps=steps)
    for step in steps:
        mine = {u: r for u, r in rescored.items() if u.step == step}
        facts[step] = step_facts(manifest, step, overlay(base.for_step(step), mine))
    return facts, {**errors, **{f"{SCORINGS}/{name}/{k}": v for k, v in index.errors.items()}}
