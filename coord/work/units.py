"""Which work units (:class:`~ckpteval.coord.work.workunit.WorkUnit`) a step has, asked of the entries, and the
prompts and samples each covers.

Who holds a unit (leases, claims, attempts, claim order) is :mod:`ckpteval.coord.work.claims`. Guarantee: pure
functions of run.json (every node, every reader derives the same units). Limits: a step's units are those of
the entries due at it; an entry that is not due has none there (it is not skipped).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpteval.coord.entries import SamplesEntry, scored_per_sample
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.work.workunit import WorkUnit

if TYPE_CHECKING:
    from ckpteval.coord.work.grants import Grants


def units_for_step(manifest: RunManifest, step: int, grants: Grants | None = None) -> list[WorkUnit]:
    """Every unit of one eval point: the units of each entry due at ``step`` (:meth:`Entry.units`), in
    run.json order, then its replays (:func:`replay_units`; scored apart, never pooled into the point). An
    entry with ``every`` > 1 has no units at the steps it is not due (it is not skipped there: it is simply
    not part of that point). With ``grants`` (adaptive evaluation, :mod:`ckpteval.coord.work.grants`), the
    units granted to the step come last."""
    granted = grants.units(manifest, step) if grants is not None else []
    return [u for e in manifest.eval.entries if e.due(step) for u in e.units(step)] + replay_units(manifest, step) + granted


def replay_units(manifest: RunManifest, step: int) -> list[WorkUnit]:
    """The replays of ``step`` (``eval.replay``, :mod:`ckpteval.coord.results.replays`): ``copies`` of every unit of each
    per-sample entry due at the step, copy-major; none when the step is not replayed."""
    settings = manifest.eval.replay
    if not settings.due(step):
        return []
    return [u.as_replay(k) for k in range(1, settings.copies + 1)
            for e in manifest.eval.entries if e.due(step) and scored_per_sample(e) for u in e.units(step)]


def shard_range(manifest: RunManifest, unit: WorkUnit) -> range:
    """The prompt indices a unit covers."""
    return prompt_range(manifest.entry(unit.dataset), unit.shard)


def prompt_range(ds: SamplesEntry, shard: int) -> range:
    """The prompt indices of shard ``shard`` of ``ds``."""
    start = shard * ds.shard_size
    return range(start, min(start + ds.shard_size, ds.n_prompts))


def unit_samples(manifest: RunManifest, unit: WorkUnit) -> range:
    """The sample indices (of each prompt) a unit generates."""
    return unit.sample_range(manifest.entry(unit.dataset).n_samples)


def expected_scores(manifest: RunManifest, unit: WorkUnit) -> int | None:
    """How many scores an ok result of ``unit`` carries: (prompts in its shard) x (samples in its range); None
    for a kind scored per unit (its point reads the unit's metrics: ``lm_eval``). A replay counts like its unit.
    KeyError naming the run if it has no entry of the unit's dataset."""
    entry = manifest.entry(unit.dataset)
    if not scored_per_sample(entry):
        return None
    prompts, samples = _shape(entry, unit)
    return prompts * samples


def check_score_count(spec: SamplesEntry, unit: WorkUnit, n: int) -> None:
    """ValueError unless ``n`` is the number of scores ``unit`` of ``spec`` carries (:func:`expected_scores`):
    a wrong count would regroup samples across prompts."""
    prompts, samples = _shape(spec, unit)
    if n != prompts * samples:
        raise ValueError(f"{n} scores, but unit {unit.id} has {prompts} prompts x {samples} samples = {prompts * samples}")


def _shape(spec: SamplesEntry, unit: WorkUnit) -> tuple[int, int]:
    """(prompts in the unit's shard, samples of each prompt in its range)."""
    return len(prompt_range(spec, unit.shard)), len(unit.sample_range(spec.n_samples))
