"""``compare --budget N``: two steps compared as if both had been generated with ``max_new_tokens = N``, from the
scoring ``ckpteval rescore --budget N`` made of their kept completions (docs/USER_GUIDE.md "Length-budget curves")."""

from __future__ import annotations

from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.results.files import ResultIndex
from ckpteval.coord.results.scorings import budget_scorings, open_scoring
from ckpteval.coord.run.rundir import RunDir


def budget_scoring(run: RunDir, budget: int, steps: list[int]) -> str:
    """The name of ``run``'s budget-``budget`` scoring, checked to have re-scored every generate unit of ``steps``
    (a unit it passed over would silently show its uncut score); ValueError naming the command that makes it."""
    fix = f"run: ckpteval rescore {run.path} --budget {budget} --steps {','.join(map(str, sorted(set(steps))))}"
    name = budget_scorings(run).get(budget)
    if name is None:
        raise ValueError(f"{run.path}: no scoring cut at {budget} tokens; {fix}")
    manifest = run.manifest()
    done = ResultIndex(open_scoring(run, name) / "results", manifest).refresh(only_steps=set(steps))
    originals = ResultIndex(run.results, manifest).refresh(only_steps=set(steps))
    missing = [u.id for u, r in originals.items()
               if r.ok and u not in done and isinstance(manifest.entry(u.dataset), GenerateEntry)]
    if missing:
        raise ValueError(f"{run.path}: scoring {name} (budget {budget}) has not re-scored {', '.join(sorted(missing)[:4])}"
                         f"{' ...' if len(missing) > 4 else ''}; {fix}")
    return name
