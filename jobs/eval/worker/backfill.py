"""``ckpteval backfill``: evaluate every pending unit of a run once — offline, array-task safe.

It is ``ckpteval worker --once --catchup all`` with a tqdm progress bar over the run's pending units
(units finished by *any* worker advance it). The eval config comes from the run's own ``run.json``,
never from flags. It takes every worker flag except ``--once`` and ``--catchup`` (``--engine``,
``--watch``, ``--verify``, ``--max-units``, ...).

Promises: idempotent — a unit with a result is never evaluated again, so a second run finds nothing
to do, says so and exits 0; except a unit skipped because an outside service failed (``judge_failed``,
``sandbox_failed``, ``env_failed``, ``overloaded``: :data:`ckpteval.coord.results.files.INFRA_SKIPS`), which each
backfill evaluates once more, superseding the skip (``results/<unit>.retry<k>.json``) — a judge that came
back fills it; an ``overloaded`` one no sooner than ``--retry-backoff`` after it was written (the backfill
waits for that). Safe as N concurrent SLURM array tasks over one run: units are claimed
through leases, so each is evaluated once (a rare double evaluation after a stall lands in
``results/duplicates/``); every task ends only when every unit of the snapshots present has a result,
taking over the units of a dead task once its lease expires. Exit codes are the worker's
(``ckpteval.jobs.eval.worker.main``): 0 done, 2 usage, 3 preempted (requeue), 4 engine dead.

Re-evaluating another run on a new benchmark: ``--from-run OLD --eval-config FILE [--steps S]`` first
creates ``--run-dir`` as a new run over OLD's snapshots (:mod:`ckpteval.jobs.eval.worker.reeval`; OLD is never written
to), then backfills it; ``--wandb`` then logs into OLD's wandb run (its run id unless
``--wandb-run-id``). ``--steps``: ``all`` (default), ``latest``, ``N``, ``START:STOP[:EVERY]`` (inclusive),
or a comma list of those.

First passing checkpoint (MLPerf-style "evaluate saved checkpoints in order until one passes"):
``--until 'eval/<ds>[/pass@k] >= X'`` (``--order ascending``, the default, required) claims units oldest
step first and starts no unit of a step above the lowest step whose complete point passes
(:func:`ckpteval.coord.results.conditions.first_passing`), in every array task, since each reads the shared
results; units already running finish, and earlier steps still running are finished (one of them may
pass first). When it ends it writes ``RUN/until.json`` (condition, passing step or null, the steps
evaluated) and prints the passing step. ``--order descending`` is ``--newest-first``.

Limits: snapshots published while it runs are picked up (a running trainer's backfill chases it), but
it does not wait for steps that have no snapshot yet.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ckpteval.coord.atomic import write_json_atomic
from ckpteval.coord.entries.generate import GenerateEntry
from ckpteval.coord.results.conditions import (
    Condition,
    check_metric,
    eval_names,
    first_passing,
    parse_condition,
)
from ckpteval.coord.results.files import INFRA_SKIPS, Result, ResultIndex
from ckpteval.coord.results.summary import write_step_summary
from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.eval.worker.main import run_worker
from ckpteval.jobs.eval.worker.options import WorkerOptions, add_worker_flags, options_from_args
from ckpteval.jobs.eval.worker.reeval import ReevalPlan, create_reeval_run, plan_reeval
from ckpteval.jobs.flags import Parser, fail, run_dir_from_args
from ckpteval.jobs.lifecycle import EXIT_CODES_HELP, EXIT_DONE, EXIT_ERROR

JUDGED = ("judge", "reward_model")  # scorers that ask a judge server (ckpteval.jobs.eval.scorers.judge.scorer)


class Progress:
    """Turns the worker's per-poll count of outstanding units into a tqdm bar on a terminal, and into a
    line per tenth done in a log file (a batch job's ``.out``: no bar redrawn into it)."""

    def __init__(self, tty: bool | None = None) -> None:
        self.bar: tqdm | None = None
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.total = 0  # units outstanding at start, plus any that appeared later
        self.done = 0
        self._said = 0  # tenths reported (no terminal)

    def __call__(self, outstanding: int) -> None:
        if not self.total:
            if not outstanding:
                return
            self.total = outstanding
            if self.tty:
                self.bar = tqdm(total=outstanding, unit="unit", desc="backfill", dynamic_ncols=True)
        done = self.total - outstanding
        if done < self.done:  # new snapshots appeared: grow the total
            self.total += self.done - done
            done = self.done
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.update(done - self.done)
        self.done = done
        tenths = 10 * done // self.total
        if self.bar is None and tenths > self._said:
            self._said = tenths
            print(f"backfill: {done}/{self.total} units", flush=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def judge_problem(opts: WorkerOptions) -> str | None:
    """A judged dataset with no judge anywhere (no ``scorer_options.url``, no ``--judge-url``, no
    ``RUN/judge.json``): what an offline backfill says before claiming anything (no run judge server
    will publish one), instead of sitting at 0% for the judge's ``wait_s``."""
    run = RunDir(opts.run_dir)
    try:
        if not run.manifest_path.is_file() or opts.judge_url or run.judge_path.is_file():
            return None
    except OSError:
        return None
    try:
        entries = run.manifest().eval.entries
    except (ValueError, OSError):
        return None  # a bad or unreadable run.json: the worker reports it, in one line, where it opens the run
    judged = [d.name for d in entries if isinstance(d, GenerateEntry) and d.scorer in JUDGED
              and not d.scorer_options.get("url")]
    if not judged:
        return None
    return (f"dataset(s) {', '.join(judged)} are judged but no judge is known: no scorer_options.url, no --judge-url, "
            f"no {run.judge_path}; start a judge and give --judge-url http://HOST:PORT/v1")


def add_reeval_flags(parser: argparse.ArgumentParser) -> None:
    """``--from-run`` and ``--steps`` (with the worker's ``--eval-config``): re-evaluate another run."""
    g = parser.add_argument_group("re-evaluating another run (creates --run-dir over its snapshots)")
    g.add_argument("--from-run", type=Path, metavar="OLD",
                   help="evaluate OLD's snapshots with --eval-config into the new run --run-dir (OLD is only read)")
    g.add_argument("--steps", metavar="S",
                   help="with --from-run: all (default), latest, N, START:STOP[:EVERY] (inclusive), or a comma list")


def reeval_plan_from_args(args: argparse.Namespace) -> ReevalPlan | None:
    """The validated re-evaluation of ``--from-run`` (None without it); fills in OLD's wandb run id."""
    if args.from_run is None:
        if args.steps is not None:
            raise ValueError("--steps selects steps of another run: use it with --from-run OLD --eval-config FILE")
        if args.eval_config is not None and not args.watch:
            raise ValueError("--eval-config needs --from-run OLD (re-evaluate OLD's snapshots) or --watch DIR")
        return None
    if args.eval_config is None:
        raise ValueError("--from-run needs --eval-config FILE: the benchmark to evaluate OLD's snapshots on")
    if args.watch:
        raise ValueError("--from-run evaluates OLD's snapshots: --watch does not apply")
    plan = plan_reeval(args.run_dir, args.from_run, args.eval_config, "all" if args.steps is None else args.steps)
    if args.wandb and not args.wandb_run_id:
        args.wandb_run_id = plan.old_manifest.run_id  # the reference trainer's wandb id is its run id
    return plan


def add_until_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("first passing checkpoint")
    g.add_argument("--order", choices=("ascending", "descending"), default="ascending",
                   help="claim order by step (descending: same as --newest-first)")
    g.add_argument("--until", metavar="COND",
                   help="stop at the first step whose point passes COND, e.g. 'eval/gsm8k >= 0.8' (ascending only); "
                   "'... margin 0.02' or '... margin mde' (the point's own MDE): it must pass by that much")


def until_plan(args: argparse.Namespace) -> Condition | None:
    """The --until condition (None without it); ValueError for a bad one or with --order descending."""
    if args.order == "descending":
        if args.until is not None:
            raise ValueError("--until evaluates steps in order to find the first passing one: use --order ascending")
        args.newest_first = True
    if args.until is not None and args.newest_first:
        raise ValueError("--until evaluates steps oldest first to find the first passing one: drop --newest-first")
    return None if args.until is None else parse_condition(args.until, "--until")


def write_until_record(opts: WorkerOptions, condition: Condition) -> int | None:
    """``RUN/until.json``: the condition, the first passing step (or None) and the steps evaluated."""
    run = RunDir(opts.run_dir)
    manifest = run.manifest()
    results = ResultIndex(run.results, manifest).refresh()
    passing = first_passing(manifest, results, condition)
    evaluated = sorted({u.step for u in results if passing is None or u.step <= passing})
    write_json_atomic(run.until_path, {"condition": condition.text, "order": "ascending", "passing_step": passing,
                                       "evaluated_steps": evaluated,
                                       "also_evaluated_above": sorted({u.step for u in results} - set(evaluated)),
                                       "time": time.time()})
    return passing


def main(argv: list[str]) -> int:
    parser = Parser(
        prog="ckpteval backfill", description=__doc__.split("\n\n")[0], epilog=EXIT_CODES_HELP
    )
    add_worker_flags(parser, pass_flags=False)
    add_reeval_flags(parser)
    add_until_flags(parser)
    args = parser.parse_args(argv)
    run_dir_from_args(parser, args)
    try:
        plan = reeval_plan_from_args(args)
        condition = until_plan(args)
    except (ValueError, FileNotFoundError) as e:
        return fail("ckpteval backfill", e)
    if plan is not None:
        args.eval_config = None  # consumed by the plan: the worker opens the run it creates
    try:
        opts = options_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    if plan is not None:
        create_reeval_run(plan)
        print(f"backfill: re-evaluating {len(plan.selected)} step(s) of {plan.old.path} into {plan.new.path}",
              flush=True)
    opts.once, opts.catchup, opts.retry_infra_skips = True, "all", True
    extra: dict[str, Any] = {}
    if condition is not None:
        try:
            check_metric(condition, eval_names(RunDir.open(opts.run_dir).manifest()), "--until")
        except (ValueError, FileNotFoundError) as e:
            return fail("ckpteval backfill", e)
        manifest = RunDir(opts.run_dir).manifest()
        extra["step_limit"] = lambda results: first_passing(manifest, results, condition)
    if (problem := judge_problem(opts)) is not None:
        return fail("ckpteval backfill", problem)
    progress = Progress()
    tally = Tally()
    try:
        code = run_worker(opts, exit_process=True, prog="ckpteval backfill", out=progress.write, on_poll=progress,
                          on_result=tally, **extra)
    finally:
        progress.close()
    if condition is not None and code == EXIT_DONE:
        passing = write_until_record(opts, condition)
        print(f"backfill: first step passing {condition.text}: "
              f"{passing if passing is not None else 'none of the steps evaluated'}", flush=True)
    if code == EXIT_DONE:
        write_summaries(RunDir(opts.run_dir), tally.steps)
        if not progress.total and not tally.results:
            print(f"backfill: nothing to do — every unit of {opts.run_dir} already has a result", flush=True)
        else:
            print(f"backfill: done — {progress.total} units had no result when it started; {tally.summary()}",
                  flush=True)
        if left := tally.infra_skips():  # not done: a job marked done would hide it (never 4: no node cures it)
            return fail("ckpteval backfill", f"{left} unit(s) not scored: an outside service failed ("
                        f"{', '.join(sorted(set(tally.skipped) & INFRA_SKIPS))}); fix it and run backfill again",
                        EXIT_ERROR)
    return code


def write_summaries(run: RunDir, steps: set[int]) -> None:
    """The step summaries status and plot read (:mod:`ckpteval.coord.results.summary`) of the steps this backfill
    evaluated units of, when it ends with nothing left to do: a backfill run has no ingester to write them (a trainer
    that already ingested a step wrote its summary, which a retry here made stale). Each step's results are
    read once more; a step still changing gets none (readers then read its results)."""
    if not steps:
        return
    manifest = run.manifest()
    index = ResultIndex(run.results, manifest)
    index.refresh(only_steps=steps)
    for step in sorted(steps):
        write_step_summary(index, manifest, step)


class Tally:
    """What this backfill's own results were, one per unit (a unit retried here — an infrastructure skip
    evaluated once more — counts once, by its last result): how many scored, how many skipped and why."""

    def __init__(self) -> None:
        self.last: dict[Any, Result] = {}  # unit -> its last result written here

    def __call__(self, result: Result) -> None:
        self.last[result.unit] = result

    @property
    def results(self) -> int:
        return len(self.last)

    @property
    def ok(self) -> int:
        return sum(1 for r in self.last.values() if r.ok)

    def infra_skips(self) -> int:
        """How many units this backfill left skipped because an outside service failed (:data:`INFRA_SKIPS`)."""
        return sum(1 for r in self.last.values() if r.skip_reason in INFRA_SKIPS)

    @property
    def steps(self) -> set[int]:
        """The steps of the units evaluated here."""
        return {u.step for u in self.last}

    @property
    def skipped(self) -> dict[str, tuple[int, str]]:
        """reason -> (count, first message)."""
        out: dict[str, tuple[int, str]] = {}
        for r in self.last.values():
            if not r.ok:
                reason = r.skip_reason or "skipped"
                count, message = out.get(reason, (0, r.message))
                out[reason] = (count + 1, message)
        return out

    def summary(self) -> str:
        """``"6 evaluated here: 2 scored, 4 skipped (ckpt_missing x4: <first message>)"``; nothing scored
        because an outside service failed says so and how to finish."""
        if not self.results:
            return "other workers evaluated them"
        text = f"{self.results} evaluated here: {self.ok} scored"
        skipped = self.skipped
        if skipped:
            n = sum(count for count, _ in skipped.values())
            why = "; ".join(f"{reason} x{count}: {message}" for reason, (count, message) in skipped.items())
            text += f", {n} skipped ({why})"
        if not self.ok and skipped and set(skipped) <= INFRA_SKIPS:
            text += " — NOTHING SCORED: an outside service failed; fix it and run backfill again (it retries these)"
        return text
