"""Published reference scores (``data/<set>/references.json``) and the step-0 check against them: first the
settings the run differs from the source's in, each named (a difference that moves the score refuses the
comparison), then the step-0 point, and any snapshot's with step 0's weights, as a z-score.
docs/USER_GUIDE.md "Published references"."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckpteval.coord.entries.catalog import CatalogEntry
from ckpteval.jobs.eval.catalog.sets import DATA, templates

REFERENCE_STEP = 0  # the base model's own point: every later step has trained on it


@dataclass(frozen=True)
class Reference:
    """One published score of ``model`` on a set, with the settings that produced it and where it is from."""

    model: str
    score: float
    metric: str
    harness: str
    template: str
    few_shot: int
    max_new_tokens: int
    temperature: float
    top_p: float
    n_samples: int
    think_opener: bool
    source: str
    url: str
    read_via: str


@dataclass(frozen=True)
class Difference:
    """A setting the run has otherwise than the source: ``refuses`` when it moves the score (no z-score then)."""

    setting: str
    run: Any
    reference: Any
    why: str
    refuses: bool

    def line(self) -> str:
        return f"{self.setting} {self.run!r}, the source's {self.reference!r} ({self.why})"


def references(catalog: str) -> list[Reference]:
    """The published scores of catalog set ``catalog`` ([] when it has none)."""
    path = DATA / catalog / "references.json"
    if not path.is_file():
        return []
    try:
        return [Reference(**r) for r in json.loads(path.read_text(encoding="utf-8"))]
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a list of references ({e})") from None


def reference_for(entry: CatalogEntry) -> Reference | None:
    """The published score of the entry's ``model`` on its set, None when the entry names no model or the
    catalog has none for it."""
    return next((r for r in references(entry.catalog) if r.model == entry.model), None) if entry.model else None


def differences(entry: CatalogEntry, ref: Reference) -> list[Difference]:
    """Every setting of ``entry`` that differs from the source's, in the order the guide lists them."""
    found: list[Difference] = []

    def differ(setting: str, run: Any, source: Any, why: str, refuses: bool = True) -> None:
        if run != source:
            found.append(Difference(setting, run, source, why, refuses))

    if entry.max_new_tokens < ref.max_new_tokens:
        differ("max_new_tokens", entry.max_new_tokens, ref.max_new_tokens, "a budget below the source's cuts answers off")
    else:
        differ("max_new_tokens", entry.max_new_tokens, ref.max_new_tokens, "a larger budget: at most more answers finish",
               refuses=False)
    template = templates()[entry.template]
    differ("template", entry.template, ref.template, "another prompt")
    if entry.template == ref.template:
        differ("system_prompt", entry.system_prompt, template.system_prompt, "the template's system turn was changed")
    differ("few-shot count", template.few_shot, ref.few_shot, "another prompt")
    differ("think opener", "<think>" if entry.reasoning is not None else "none", "<think>" if ref.think_opener else "none",
           "the source's answers begin in their reasoning (<think>): set reasoning, e.g. {\"end\": \"</think>\"}"
           if ref.think_opener else "the source scored whole completions")
    differ("temperature", entry.temperature, ref.temperature, "another sampling distribution")
    differ("top_p", entry.top_p, ref.top_p, "another sampling distribution")
    differ("subset", entry.subset, None, "the source scored every row")
    differ("n_samples", entry.n_samples, ref.n_samples, "fewer or more samples: the same mean, another stderr",
           refuses=False)
    return found


def base_steps(snapshots: Sequence[dict[str, Any]]) -> list[int]:
    """The steps whose point is the base model's: step 0, and every snapshot holding step 0's weights (the same
    :func:`~ckpteval.coord.snapshots.digests.weights_id`: a re-evaluation of the base at another step, a run
    that saved it again). Without step 0's snapshot, or without tensor digests in its marker, step 0 alone."""
    ids = {s["step"]: s.get("weights") for s in snapshots}
    base = ids.get(REFERENCE_STEP)
    return [REFERENCE_STEP] + sorted(s for s, w in ids.items() if base is not None and w == base and s != REFERENCE_STEP)


def scored(ref: Reference, step: int, point: dict[str, Any]) -> dict[str, Any]:
    """One base point against the published score: its score, stderr (over prompts) and z-score."""
    score, stderr = float(point["score"]), float(point["stderr"])
    z = (score - ref.score) / stderr if math.isfinite(stderr) and stderr > 0 else None
    return {"step": step, "score": score, "stderr": stderr, "z": z}


def check(entry: CatalogEntry, ref: Reference, points: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """What status shows: the differences, then (none refusing) each scored base point (``points``: step ->
    the dataset's complete point, step 0 first) as a z-score against the published score; the first one's
    also at the top level (``step``, ``score``, ``stderr``, ``z``)."""
    diffs = differences(entry, ref)
    out: dict[str, Any] = {
        "model": ref.model, "reference": ref.score, "metric": ref.metric, "source": ref.source, "url": ref.url,
        "differences": [d.line() for d in diffs if d.refuses], "warnings": [d.line() for d in diffs if not d.refuses],
        "step": REFERENCE_STEP, "score": None, "stderr": None, "z": None, "base_points": [],
    }
    if any(d.refuses for d in diffs) or not points:
        return out
    out["base_points"] = [scored(ref, step, point) for step, point in points.items()]
    out.update(out["base_points"][0])
    return out


def reference_status(manifest: Any, points: list[dict[str, Any]],
                     snapshots: Sequence[dict[str, Any]] = ()) -> dict[str, dict[str, Any]]:
    """Each catalog entry with a published reference for its ``model``: :func:`check` against the base points
    (step 0 and the snapshots with its weights, :func:`base_steps`) that are complete."""
    steps = base_steps(snapshots)
    complete = {p["step"]: p for p in points if p["step"] in steps and p.get("complete")}
    out = {}
    for entry in manifest.eval.entries:
        if not (isinstance(entry, CatalogEntry) and entry.model):
            continue
        if (ref := reference_for(entry)) is None:
            known = sorted({r.model for r in references(entry.catalog)})
            out[entry.name] = {"model": entry.model, "unknown": f"no published score of {entry.model} on "
                               f"{entry.catalog} in the catalog (it has: {', '.join(known) or 'none'})"}
            continue
        base = {s: complete[s]["datasets"][entry.name] for s in steps
                if s in complete and entry.name in complete[s].get("datasets", {})}
        out[entry.name] = check(entry, ref, base)
    return out


def reference_warnings(entries: Sequence[Any]) -> list[str]:
    """When a run is created: one line per catalog entry whose ``model`` has a published score and whose
    settings differ from the source's, naming each difference (:func:`differences`, as status will)."""
    lines = []
    for entry in entries:
        if not isinstance(entry, CatalogEntry) or (ref := reference_for(entry)) is None:
            continue
        if diffs := differences(entry, ref):
            refuses = any(d.refuses for d in diffs)
            lines.append(f"dataset {entry.name!r}: its settings differ from the published {ref.metric} of {ref.model} "
                         f"({ref.url}): " + "; ".join(d.line() for d in diffs)
                         + ("; status will not compare its base points with it" if refuses else ""))
    return lines
