"""``ckpteval backfill``: evaluate every pending unit of a run once — offline, array-task safe.

It is ``ckpteval worker --once --catchup all`` with a tqdm progress bar over the run's pending units
(units finished by *any* worker advance it). The eval config comes from the run's own ``run.json``,
never from flags. It takes every worker flag except ``--once`` and ``--catchup`` (``--engine``,
``--watch``, ``--verify``, ``--max-units``, ...).

Promises: idempotent — a unit with a result is never evaluated again, so a second run finds nothing
to do, says so and exits 0. Safe as N concurrent SLURM array tasks over one run: units are claimed
through leases, so each is evaluated once (a rare double evaluation after a stall lands in
``results/duplicates/``); every task ends only when every unit of the snapshots present has a result,
taking over the units of a dead task once its lease expires. Exit codes are the worker's
(``jobs.eval.worker``): 0 done, 2 usage, 3 preempted (requeue), 4 engine dead.

Limits: snapshots published while it runs are picked up (a running trainer's backfill chases it), but
it does not wait for steps that have no snapshot yet.
"""

from __future__ import annotations

from tqdm import tqdm

from jobs.eval.options import add_worker_flags, options_from_args
from jobs.eval.worker import run_worker
from jobs.flags import Parser
from jobs.lifecycle import EXIT_CODES_HELP, EXIT_DONE


class Progress:
    """Turns the worker's per-poll count of outstanding units into a tqdm bar."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None
        self.total = 0  # units outstanding at start, plus any that appeared later

    def __call__(self, outstanding: int) -> None:
        if self.bar is None:
            if not outstanding:
                return
            self.total = outstanding
            self.bar = tqdm(total=outstanding, unit="unit", desc="backfill", dynamic_ncols=True)
        done = self.bar.total - outstanding
        if done < self.bar.n:  # new snapshots appeared: grow the bar
            self.bar.total += self.bar.n - done
            self.total = self.bar.total
            done = self.bar.n
        self.bar.update(done - self.bar.n)

    def write(self, line: str) -> None:
        (self.bar.write if self.bar is not None else tqdm.write)(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: list[str]) -> int:
    parser = Parser(
        prog="ckpteval backfill", description=__doc__.split("\n\n")[0], epilog=EXIT_CODES_HELP
    )
    add_worker_flags(parser, pass_flags=False)
    args = parser.parse_args(argv)
    try:
        opts = options_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    opts.once, opts.catchup = True, "all"
    progress = Progress()
    try:
        code = run_worker(opts, exit_process=True, out=progress.write, on_poll=progress)
    finally:
        progress.close()
    if code == EXIT_DONE:
        if not progress.total:
            print(f"backfill: nothing to do — every unit of {opts.run_dir} already has a result", flush=True)
        else:
            print(f"backfill: done — {progress.total} units had no result when it started", flush=True)
    return code
