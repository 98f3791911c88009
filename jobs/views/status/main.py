"""``ckpteval status RUN [RUN ...]``: what a run's files say, as tables or JSON.

Read-only: it never writes to the run dir, so it is safe to run anywhere, any time, as often as
you like. The data is :func:`ckpteval.jobs.views.status.data.collect_status` (the ``--json`` object), the
text :func:`ckpteval.jobs.views.status.text.render`, fitted to the console's width (``COLUMNS``; 80 when
piped). Both modules' public names are importable from here too (the views' one import point).

Limits: those of the two modules (lease ages on this machine's clock; a word longer than the width).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rich.cells import cell_len

from ckpteval.jobs.flags import Parser, add_run_dir_argument, fail, positive_float, run_dirs_from_args, wrap
from ckpteval.jobs.views.status.data import (  # noqa: F401  (re-exported: the views' one import point)
    collect_status,
    cost_summary,
    eval_lags,
    finite,
    harness_columns,
    read_metrics,
)
from ckpteval.jobs.views.status.text import (  # noqa: F401  (re-exported)
    DATASET_LINES,
    NOT_POOLED,
    RUN_LINES,
    UNPOOLED,
    attestation_line,
    cost_line,
    derived_keys,
    fit,
    health_line,
    health_lines,
    points_table,
    points_tables,
    render,
    waiting_table,
)

DEFAULT_WATCH_S = 2.0


def watch_interval(ap: Parser, args: Any) -> float | None:
    """``--watch [S]``: the refresh interval, or None. ``status --watch RUN`` reads RUN as a run dir
    (argparse hands the optional value to ``--watch``), not as a malformed interval."""
    if args.watch is None:
        return None
    try:
        return positive_float(args.watch)
    except argparse.ArgumentTypeError as e:
        if args.run_dir is None and not args.watch[:1].isdigit():
            args.run_dir_pos = [Path(args.watch), *(args.run_dir_pos or [])]
            return DEFAULT_WATCH_S
        ap.error(f"--watch {args.watch}: {e}")


def show(console: Any, statuses: list[dict[str, Any]], as_json: bool) -> None:
    """Print each run's status: its tables one run after the other (a rule naming the run between
    several), or JSON — one object for one run, a list of them for several."""
    if as_json:
        obj = finite(statuses[0] if len(statuses) == 1 else statuses)
        print(json.dumps(obj, indent=1, default=str, allow_nan=False), flush=True)
        return
    with console:  # one write per refresh: a reader (or a watch's Ctrl-C) never sees half of one
        for status in statuses:
            if len(statuses) > 1:  # the run's name whole: under a plain rule when too long for a titled one
                name = f"run {status['run_id']} ({status['run_dir']})"
                console.rule(name if cell_len(name) + 4 <= console.width else "")
                for line in [] if cell_len(name) + 4 <= console.width else wrap(name, console.width):
                    console.print(line, soft_wrap=True)
            for item in render(status, console.width):
                console.print(item, soft_wrap=isinstance(item, str))  # a one-line section stays one line


def main(argv: list[str]) -> int:
    ap = Parser(prog="ckpteval status", description=__doc__.split("\n")[0])
    add_run_dir_argument(ap, many=True)
    ap.add_argument("--scoring", metavar="NAME", help="show this ckpteval rescore scoring's scores (default: as generated)")
    ap.add_argument("--json", action="store_true",
                    help="print machine-readable JSON instead of tables (a list of objects for several RUNs)")
    ap.add_argument("--watch", nargs="?", const=str(DEFAULT_WATCH_S), default=None, metavar="S",
                    help=f"refresh every S seconds until Ctrl-C (S defaults to {DEFAULT_WATCH_S:g})")
    args = ap.parse_args(argv)
    interval = watch_interval(ap, args)
    run_dirs = run_dirs_from_args(ap, args)
    from rich.console import Console

    console = Console()
    if interval is not None:  # SIGTERM (kill, timeout) ends a watch as quietly as Ctrl-C
        signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
        # and Ctrl-C always does: a shell starting a job in the background (``&``, nohup) leaves SIGINT ignored,
        # which Python keeps, so the watch would never end on SIGINT
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        while True:
            try:
                statuses = [collect_status(d, args.scoring) for d in run_dirs]
            except (OSError, ValueError) as e:  # missing, unreadable or malformed run files
                return fail("ckpteval status", e)
            if interval and not args.json:
                console.clear()
            show(console, statuses, args.json)
            if not interval:
                return 0
            time.sleep(interval)
    except KeyboardInterrupt:
        if not interval:
            raise  # a one-shot status: the CLI's one line (ckpteval.jobs.cli)
        print(file=sys.stderr)  # Ctrl-C is the way out of --watch: a clean end
        return 0
