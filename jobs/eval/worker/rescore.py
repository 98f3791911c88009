"""``ckpteval rescore RUN``: score a run's kept completions again, on CPU, as a new scoring beside the original.

For every ``ok`` unit of the chosen steps (``--steps``) and ``generate`` datasets (``--datasets``) it reads the
unit's kept completions (:mod:`ckpteval.coord.results.completions`), scores them with ``--scorer`` / ``--scorer-options``
(default: each dataset's own scorer and options from run.json) through the one scoring path of a fresh
generation (:func:`ckpteval.jobs.eval.kinds.generate.scoring.unit_scores`), and publishes the result in the scoring
``RUN/scorings/<name>/`` (:mod:`ckpteval.coord.results.scorings`; ``--name``, default ``<scorer>-<hash of scorer and
options>``). No engine is loaded; the original results and completions are never written.

Promises: exactly once per unit and scoring, array-task safe — units are claimed through the run's lease
machinery (:class:`ckpteval.coord.work.claims.UnitClaimer`, leases under the scoring) and results published first
writer wins, so N concurrent ``rescore`` processes (a SLURM array) share the work, a dead one's units are taken
over after its lease expires, and a second run finds nothing to do. A re-score with the scorer that produced a
result gives exactly its scores and answers (the completions, rows and prompts are the ones scored then). A unit is
passed over, with one line naming the file, when it has no kept completions, when they do not belong to the
result (lease token, sample count or versions differ), or when its rows changed since (rows' SHA-256): nothing is
ever scored against other text or other gold. A scorer that raises on a unit is that unit's ``crashed`` skip in
the scoring (``blame: "scorer"``); an outside service's failure (a judge down) writes nothing, so the next
rescore tries again.

Limits: ``lm_eval`` and ``env`` units keep no completions and are not re-scored; a scoring re-scores a unit's
newest result only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import dumps, publish_exclusive, read_json_object
from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.results.completions import (
    Completions,
    completions_path,
    content_digest,
    read_completions,
    rows_digest,
)
from ckpteval.coord.results.files import Result, ResultIndex, ok_result, skip_result, write_result
from ckpteval.coord.results.scorings import SCORING_FILE, check_name, scoring_dir
from ckpteval.coord.run.chat_settings import check_reasoning
from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.coord.snapshots.snapshot import producer_identity
from ckpteval.coord.work.claims import Claim, UnitClaimer
from ckpteval.coord.work.steps import parse_steps
from ckpteval.coord.work.units import WorkUnit, shard_range
from ckpteval.jobs.eval.kinds.evaluate import UserCodeFailed, user_code
from ckpteval.jobs.eval.kinds.generate.answering import Reasoning, resolve_reasoning
from ckpteval.jobs.eval.kinds.generate.budget import cut_at_budget, parse_budgets
from ckpteval.jobs.eval.kinds.generate.prompts import snapshot_tokenizer
from ckpteval.jobs.eval.kinds.generate.reasoning import TOKENIZER
from ckpteval.jobs.eval.kinds.generate.scoring import DatasetCache, kept_generations, unit_scores
from ckpteval.jobs.eval.kinds.generate.tokenizer_files import TokenizerMissing, tokenizer_dir
from ckpteval.jobs.eval.skips import WorkerSkip
from ckpteval.jobs.flags import Parser, fail, run_dir_from_args

PROG = "ckpteval rescore"


@dataclass(frozen=True)
class Rescoring:
    """What a scoring applies: a scorer (None: each dataset's own), its options (None: the dataset's own) and a
    reasoning strip (None: the dataset's own; :mod:`ckpteval.jobs.eval.kinds.generate.reasoning`, with a named delimiter — the
    snapshot tokenizer of ``"end": "tokenizer"`` is not at hand here; ``no_reasoning``: no strip at all)."""

    scorer: str | None
    scorer_options: dict[str, Any] | None
    reasoning: dict[str, Any] | None = None
    budget: int | None = None  # cut every kept completion at this many tokens first (jobs.eval.kinds.generate.budget)
    no_reasoning: bool = False  # --reasoning none: score the whole text, the dataset's strip off

    def __post_init__(self) -> None:
        check_reasoning(self.reasoning)
        if self.no_reasoning and self.reasoning is not None:
            raise ValueError("--reasoning: none, or a strip, not both")
        if self.reasoning is not None and self.reasoning.get("end") == TOKENIZER:
            raise ValueError("--reasoning: end 'tokenizer' needs the snapshot's tokenizer, which a rescore does "
                             "not load; name the delimiter (e.g. {\"end\": \"</think>\"})")

    def to_json(self) -> dict[str, Any]:
        return {"scorer": self.scorer, "scorer_options": self.scorer_options,
                "reasoning": "none" if self.no_reasoning else self.reasoning,
                **({"budget": self.budget} if self.budget is not None else {})}

    def default_name(self) -> str:
        digest = hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:10]
        base = (self.scorer or "own").replace(":", ".").replace("/", ".")[:60]
        base = base if self.budget is None else f"budget{self.budget}-{base}"
        return check_name(f"{base}-{digest}")

    def spec(self, spec: GenerateEntry) -> GenerateEntry:
        """``spec`` as this scoring scores it (its other fields unchanged; run.json's checks run again)."""
        changes: dict[str, Any] = {}
        if self.scorer is not None:
            changes["scorer"] = self.scorer
        if self.scorer_options is not None:
            changes["scorer_options"] = dict(self.scorer_options)
        if self.reasoning is not None or self.no_reasoning:
            changes["reasoning"] = None if self.no_reasoning else dict(self.reasoning)  # type: ignore[arg-type]
        return replace(spec, **changes) if changes else spec


def open_or_create(run: RunDir, name: str, rescoring: Rescoring) -> Path:
    """The scoring's directory with its ``scoring.json`` (first writer wins); ValueError when ``name`` is taken by
    a scoring that applies something else."""
    root = scoring_dir(run, name)
    (root / "results").mkdir(parents=True, exist_ok=True)
    (root / "leases").mkdir(exist_ok=True)
    record = {"name": name, **rescoring.to_json()}
    publish_exclusive(root / SCORING_FILE, dumps({**record, "created": time.time()}))
    found = read_json_object(root / SCORING_FILE)
    if {k: found.get(k) for k in [*record, "budget"]} != {"budget": None, **record}:
        raise ValueError(f"{root / SCORING_FILE}: scoring {name!r} applies {found.get('scorer')!r} with options "
                         f"{found.get('scorer_options')!r}, not this one; pick another --name")
    return root


class Unscorable(Exception):
    """A unit passed over: its kept completions are missing or do not match its result or its rows."""


class Rescorer:
    """Re-scores units of one run into one scoring (one process; several share the work through leases)."""

    def __init__(self, run: RunDir, manifest: RunManifest, rescoring: Rescoring, root: Path) -> None:
        self.run, self.manifest, self.rescoring, self.root = run, manifest, rescoring, root
        self.cache = DatasetCache(run, manifest)
        self.originals = ResultIndex(run.results, manifest)
        self.index = ResultIndex(root / "results", manifest)
        self.claimer = UnitClaimer(root / "leases", manifest.lease, root / "results")
        self._specs: dict[str, GenerateEntry] = {}
        self.written = self.passed = 0

    def candidates(self, steps_text: str, datasets: set[str] | None) -> list[WorkUnit]:
        """The ok units of ``generate`` entries in the selection, oldest step first."""
        selection = parse_steps(steps_text)
        originals = self.originals.refresh()
        steps = set(selection.select({u.step for u in originals}))
        names = {e.name for e in self.manifest.eval.entries if isinstance(e, GenerateEntry)}
        if datasets is not None:
            unknown = datasets - names
            if unknown:
                raise ValueError(f"--datasets: {sorted(unknown)} are not generate datasets of this run "
                                 f"(those are {sorted(names)})")
            names &= datasets
        units = [u for u, r in originals.items()
                 if u.step in steps and u.dataset in names and r.ok and not r.metrics]
        return sorted(units, key=lambda u: (u.step, u.dataset, u.shard, u.sample_start))

    def run_all(self, units: list[WorkUnit], poll_s: float, out: Any = print) -> int:
        """Claim and re-score ``units`` until each has a result in the scoring or was passed over: one pass in
        order (a claim checks for the unit's result after it is taken), then the steps of units others held are
        listed once and the rest tried again after ``poll_s`` (a dead process's claims expire and are taken over)."""
        pending = [u for u in units if u not in self.index.refresh()]
        while pending:
            missed = []
            for unit in pending:
                claim = self.claimer.try_claim(unit)
                if claim is None:  # held by another process, or done since
                    missed.append(unit)
                    continue
                self._one(claim, out)
                self.claimer.forget(unit)
            done = self.index.refresh(only_steps={u.step for u in missed}) if missed else {}
            pending = [u for u in missed if u not in done]
            if pending:
                time.sleep(poll_s)
        return 0

    def _one(self, claim: Claim, out: Any) -> None:
        """Re-score one claimed unit and publish its result, unless passed over or the claim was lost."""
        try:
            result = self.rescore(claim.unit)
            if result is None:
                return
            if not claim.still_ours():
                out(f"{claim.unit.id}: claim lost; nothing written")
                return
            stamped = replace(result, lease_token=claim.token, attempt=claim.attempt)
            self.written += write_result(self.root / "results", stamped)
        except Unscorable as e:
            self.passed += 1
            out(f"{claim.unit.id}: passed over: {e}")
        finally:
            claim.release()

    def reasoning(self, spec: GenerateEntry, original: Result) -> Reasoning:
        """The scoring's reasoning strip for ``spec``, with the tokenizer of the snapshot that generated ``original``
        (else the run's) to count reasoning tokens as the worker did; without one, no count."""
        try:
            where: str | None = str(tokenizer_dir(Path(original.snapshot) if original.snapshot else None,  # type: ignore[arg-type]
                                                  self.run.base))
        except (TokenizerMissing, OSError):
            where = None
        try:
            return resolve_reasoning(spec, where)
        except RuntimeError as e:
            raise Unscorable(f"reasoning setting: {e}") from None

    def tokenizer(self, original: Result) -> Any:
        """The tokenizer of the snapshot that generated ``original`` (else the run's, ``RUN/base``): what a
        budget counts tokens with."""
        try:
            where = tokenizer_dir(Path(original.snapshot) if original.snapshot else None, self.run.base)  # type: ignore[arg-type]
            return snapshot_tokenizer(str(where))
        except (TokenizerMissing, RuntimeError, OSError) as e:
            raise Unscorable(f"--budget counts tokens with the snapshot's tokenizer, which cannot be read ({e})") from None

    def spec(self, dataset: str) -> GenerateEntry:
        if dataset not in self._specs:
            self._specs[dataset] = self.rescoring.spec(self.manifest.entry(dataset))
        return self._specs[dataset]

    def rescore(self, unit: WorkUnit) -> Result | None:
        """The unit's re-scored result; None when an outside service failed (nothing written: retried later)."""
        original = self.originals.get(unit)
        if original is None or not original.ok:
            raise Unscorable("no ok result to re-score")
        kept = self.kept_of(unit, original)
        if self.rescoring.budget is not None:
            kept = cut_at_budget(kept, self.rescoring.budget, self.tokenizer(original))
        spec = self.spec(unit.dataset)
        rows = self.rows_of(unit, spec, kept)
        per_prompt = kept.per_prompt
        try:
            with user_code(f"scorer {spec.scorer!r}", "scorer"):
                scorer = self.cache.scorer(spec)  # the cache only ever sees this scoring's specs
                scored = unit_scores(scorer, spec, kept_generations(kept, list(original.weight_versions)),
                                     [r for r in rows for _ in range(per_prompt)], kept.sample_prompts(),
                                     self.reasoning(spec, original))
        except UserCodeFailed as e:
            return skip_result(unit, e.reason, str(e), blame=e.blame, worker=self.identity(original, unit))
        except WorkerSkip as e:  # a judge or sandbox down: not the unit's fault; the next rescore tries again
            print(f"{PROG}: {unit.id}: {e.reason}: {e} (nothing written; run rescore again)", file=sys.stderr)
            return None
        return ok_result(
            unit, scored.scores, list(original.weight_versions), scored.answers, message=original.message,
            timings={"score_s": scored.score_s}, cost={**original.cost, "score_s": scored.score_s},
            attest=original.attest, fidelity=original.fidelity, snapshot=original.snapshot, engine=original.engine,
            worker=self.identity(original, unit), **scored.result_fields(),
        )

    def identity(self, original: Result, unit: WorkUnit) -> dict[str, Any]:
        """Who wrote the re-scored result, and of which result and completions."""
        generation = self.originals.generation(unit)
        return {**producer_identity(), "rescore_of": unit.result_name_at(generation),
                "completions": completions_path(Path("results"), unit, generation).as_posix(),
                "original_lease_token": original.lease_token}

    def kept_of(self, unit: WorkUnit, original: Result) -> Completions:
        path = completions_path(self.run.results, unit, self.originals.generation(unit))
        try:
            kept = read_completions(path)
        except FileNotFoundError:
            raise Unscorable(f"{path}: no kept completions (kept off, or written before kept completions)") from None
        except ValueError as e:
            raise Unscorable(str(e)) from None
        if kept.unit != unit or kept.lease_token != original.lease_token:
            raise Unscorable(f"{path}: belongs to another result (unit {kept.unit.id}, lease token "
                             f"{kept.lease_token} vs the result's {original.lease_token})")
        if content_digest(kept) != original.completions_sha256:  # None: a result that bound no kept text
            raise Unscorable(f"{path}: its text does not match the completions_sha256 its result recorded "
                             "(rewritten after it was scored); not re-scored")
        if len(kept.text) != len(original.scores) or tuple(kept.weight_version) != tuple(original.weight_versions):
            raise Unscorable(f"{path}: {len(kept.text)} completions / versions do not match the result's "
                             f"{len(original.scores)} samples")
        return kept

    def check(self, datasets: set[str] | None) -> None:
        """Before any claim: the scorer of every selected dataset builds with its options (a typo is one error
        line, never a crashed skip per unit)."""
        for entry in self.manifest.eval.entries:
            if isinstance(entry, GenerateEntry) and (datasets is None or entry.name in datasets):
                self.cache.scorer(self.spec(entry.name))

    def rows_of(self, unit: WorkUnit, spec: GenerateEntry, kept: Completions) -> list[Any]:
        try:
            rows = [self.cache.rows(spec)[i] for i in shard_range(self.manifest, unit)]
        except (OSError, ValueError, IndexError) as e:
            raise Unscorable(f"the rows of {unit.id} cannot be read ({e})") from None
        if rows_digest(rows) != kept.rows_sha256:
            raise Unscorable(f"the rows of {unit.id} in {spec.path} changed since it was generated (rows' SHA-256 "
                             "differs): not re-scored against other gold")
        if len(rows) != len(kept.prompts):
            raise Unscorable(f"{len(kept.prompts)} prompts kept for {len(rows)} rows")
        return rows


def parse_options(text: str | None, flag: str = "--scorer-options") -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {text!r}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{flag} {text!r}: must be a JSON object")
    return obj


def build_parser() -> argparse.ArgumentParser:
    from ckpteval.jobs.flags import add_run_dir_argument

    ap = Parser(prog=PROG, description=__doc__.split("\n\n")[0].replace("``", ""))
    add_run_dir_argument(ap)
    ap.add_argument("--scorer", metavar="NAME", help="the scorer to apply (a registry name or module:function; "
                    "default: each dataset's own, e.g. after its code changed)")
    ap.add_argument("--scorer-options", metavar="JSON", help="the scorer's options as a JSON object (default: the "
                    "dataset's own scorer_options)")
    ap.add_argument("--reasoning", metavar="JSON", help="the reasoning strip to apply, e.g. '{\"end\": \"</think>\"}', "
                    "or none: score the whole text (default: the dataset's own; see the user guide's reasoning models)")
    ap.add_argument("--steps", default="all", metavar="SPEC", help="steps to re-score: all (default), latest, N, "
                    "START:STOP[:EVERY] (inclusive), or a comma list")
    ap.add_argument("--datasets", nargs="+", metavar="NAME", help="datasets to re-score (default: every generate "
                    "dataset)")
    ap.add_argument("--name", metavar="NAME", help="the scoring's name (default: <scorer>-<hash of scorer and "
                    "options>); status/plot/compare --scoring NAME show it")
    ap.add_argument("--budget", metavar="N[,N...]", help="cut every kept completion at N tokens (the snapshot's "
                    "tokenizer) before scoring, as if max_new_tokens had been N; several budgets: one scoring each, "
                    "named budget<N>-... (a length-budget curve: status/plot --scoring each; compare --budget N)")
    ap.add_argument("--poll-interval", type=float, default=2.0, metavar="S",
                    help="seconds between looks at units other rescore processes hold (default 2)")
    return ap


def main(argv: list[str]) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    run_dir = run_dir_from_args(ap, args)
    try:
        budgets: list[int | None] = [None] if args.budget is None else list(parse_budgets(args.budget))
        if len(budgets) > 1 and args.name:
            raise ValueError("--name names one scoring; several --budget values get one default name each")
        for budget in budgets:
            code = rescore_into(run_dir, args, budget)
            if code:
                return code
    except ValueError as e:
        return fail(PROG, e)
    return 0


def rescore_into(run_dir: Path, args: argparse.Namespace, budget: int | None) -> int:
    """One scoring of ``ckpteval rescore``'s flags (``budget``: one of ``--budget``'s)."""
    try:
        run = RunDir.open(run_dir)
        manifest = run.manifest()
        no_reasoning = args.reasoning is not None and args.reasoning.strip().lower() == "none"
        reasoning = None if args.reasoning is None or no_reasoning else parse_options(args.reasoning, "--reasoning")
        rescoring = Rescoring(args.scorer, parse_options(args.scorer_options), reasoning, budget, no_reasoning)
        name = check_name(args.name) if args.name else rescoring.default_name()
        datasets = set(args.datasets) if args.datasets else None
        rescorer = Rescorer(run, manifest, rescoring, scoring_dir(run, name))
        units = rescorer.candidates(args.steps, datasets)  # the selection, checked before anything is written
        rescorer.check(datasets)  # the scorer and its options, before anything is written
        open_or_create(run, name, rescoring)
    except (OSError, ValueError) as e:
        return fail(PROG, e)
    t0 = time.perf_counter()
    rescorer.run_all(units, args.poll_interval, out=lambda line: print(f"{PROG}: {line}", file=sys.stderr))
    print(f"scoring {name}: {rescorer.written} units re-scored here, {rescorer.passed} passed over, "
          f"{len(units)} selected, {time.perf_counter() - t0:.2f}s (status/plot/compare --scoring {name})")
    return 0
