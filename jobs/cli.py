"""The ``ckpteval`` console script: one subcommand per program in ``jobs/``.

Each subcommand lives in its own module exposing ``main(argv: list[str]) -> int``; this file only
routes, and imports the module lazily so ``ckpteval status`` never pays for importing torch.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys

from ckpteval.jobs.eval.kinds.evaluate import install_checks
from ckpteval.jobs.lifecycle import EXIT_INTERRUPTED, record_early_stops

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("ckpteval.jobs.reference.train.config", "reference trainer (tiny model on CPU) with the eval dispatcher"),
    "worker": ("ckpteval.jobs.eval.worker.main", "eval worker: fleet, service (--watch) or --once"),
    "backfill": ("ckpteval.jobs.eval.worker.backfill", "evaluate every pending unit of a run once (array-task safe)"),
    "rescore": ("ckpteval.jobs.eval.worker.rescore", "score kept completions again (new scorer/options) as a new scoring, on CPU"),
    "status": ("ckpteval.jobs.views.status.main", "show snapshots, units, points and health of a run"),
    "plot": ("ckpteval.jobs.views.plot", "plot score vs step (PNG)"),
    "compare": ("ckpteval.jobs.decide.compare", "paired difference of two steps or runs, with its interval"),
    "best": ("ckpteval.jobs.decide.best", "best step by a metric and the steps not distinguishable from it"),
    "contamination": ("ckpteval.jobs.eval.contamination.main", "check eval rows against the trainer's own prompts (exact, "
                      "n-gram, near-duplicate)"),
    "plan": ("ckpteval.jobs.decide.plan", "prompts or samples per prompt a target MDE needs, and their token cost"),
    "serve": ("ckpteval.jobs.reference.serve.main", "HTTP engine speaking sglang's native API subset (CPU stand-in)"),
    "submit": ("ckpteval.jobs.launch.submit", "render and sbatch the batch scripts"),
    "demo": ("ckpteval.jobs.reference.demo", "the embedded default: trainer + eval fleet on CPU"),
}


def _usage() -> str:
    lines = ["usage: ckpteval <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


PREEMPTIBLE = {"worker", "backfill"}  # may be preempted while still importing torch (see ckpteval.jobs.lifecycle)

SUBCOMMAND_HELP_EXTRA: dict[str, list[list[str]]] = {
    "submit": [["train-eval"], ["backfill"], ["service"]],
}


def _help_text(name: str, extra: list[str]) -> str:
    module = importlib.import_module(SUBCOMMANDS[name][0])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        module.main([*extra, "--help"])
    return out.getvalue().rstrip()


def flag_reference() -> str:
    """Every subcommand's ``--help``, as markdown (docs/FLAGS.md is this; a test keeps it current)."""
    os.environ["COLUMNS"] = "100"
    parts = ["# ckpteval command reference", "", "Generated from the commands' own `--help` "
             "(`python -m ckpteval.jobs.cli reference > docs/FLAGS.md`); a test fails when it drifts.", ""]
    for name in SUBCOMMANDS:
        for extra in [[], *SUBCOMMAND_HELP_EXTRA.get(name, [])]:
            title = " ".join(["ckpteval", name, *extra])
            parts += [f"## `{title}`", "", "```text", _help_text(name, extra), "```", ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name == "reference":
        print(flag_reference())
        return 0
    if name not in SUBCOMMANDS:
        print(f"ckpteval: unknown command {name!r}; commands: {', '.join(SUBCOMMANDS)} (see ckpteval --help)",
              file=sys.stderr)
        return 2
    if name in PREEMPTIBLE:
        record_early_stops()
    install_checks()  # the registries' checks of run.json's names, before any command reads one
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:  # Ctrl-C where the command has no handler of its own (e.g. importing torch)
        print(f"ckpteval {name}: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `ckpteval status --json | head`: the reader has what it wanted
        _stdout_to_devnull()
        return 0


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail on the closed pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
