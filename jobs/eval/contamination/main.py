"""``ckpteval contamination``: check a run's eval rows against the trainer's own prompts, once per run.

Exact, n-gram and near-duplicate tiers; the matches go to ``RUN/contamination.json`` and the ingesters log
``eval/<ds>/clean`` beside each point from then on. docs/USER_GUIDE.md "Contamination gate".
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path
from typing import Any

from ckpteval.coord.layouts import AUTO, LAYOUTS, get_layout, resolve_layout
from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.eval.contamination.gate import check
from ckpteval.jobs.eval.contamination.index import TIERS, Settings
from ckpteval.jobs.eval.contamination.train_data import VERIFIERS
from ckpteval.jobs.flags import Parser

PROG = "ckpteval contamination"


def read_config(path: Path) -> dict[str, Any]:
    """A trainer's config file (YAML, TOML or JSON) as a dict; errors name the file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: trainer config not found")
    try:
        data = _parse(path.suffix, path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"{path}: not a readable trainer config ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a trainer config must be a mapping at its top level")
    return data


def _parse(suffix: str, text: str) -> Any:
    if suffix == ".toml":
        return tomllib.loads(text)
    if suffix not in (".yaml", ".yml"):
        return json.loads(text)
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(str(e)) from None


def config_sources(config_path: Path, layout: str) -> list[str]:
    """The training data a trainer config names, by its layout; relative paths are the config directory's."""
    found = get_layout(layout).train_data(read_config(config_path))
    if not found:
        keys = get_layout(layout).train_data_keys or "no key known to this layout"
        raise ValueError(f"{config_path}: names no training data for layout {layout} (looked at: {keys}); give --train PATH")
    out = []
    for source in found:
        if source.startswith(VERIFIERS):
            out.append(source)
            continue
        path = Path(source).expanduser()
        path = path if path.is_absolute() else config_path.parent / path
        if not path.exists():
            raise FileNotFoundError(f"{path}: training data named by {config_path} ({layout}) not found "
                                    "(a hub id is never downloaded: give its local files with --train)")
        out.append(str(path))
    return out


def watched_sources(run: RunDir, layout: str | None) -> list[str]:
    """The training data named by the config a watched trainer keeps in its saves (NeMo-RL's
    ``step_N/config.yaml``), for each of the run's watched dirs (``trainer.foreign_roots``)."""
    found = []
    for root in [Path(r) for r in run.manifest().trainer.get("foreign_roots", []) if isinstance(r, str)]:
        chosen = resolve_layout(root, layout or AUTO)
        if chosen is not None and (config := chosen.saved_config(root)) is not None:
            found += config_sources(config, chosen.name)
    if not found:
        raise ValueError("contamination: no training data named: give --train PATH or --trainer-config FILE --layout "
                         "NAME (no watched trainer of this run keeps its config in its saves)")
    return found


def summary(record: dict[str, Any], run: RunDir) -> list[str]:
    """The text ``ckpteval contamination`` prints for a record."""
    files = len(record["sources"])
    lines = [f"contamination: {record['train_rows']:,} training rows ({files} source{'s' * (files != 1)}) in "
             f"{record['seconds']} s ({record['rows_per_s'] or 0:,.0f} rows/s); matches in {run.path / 'contamination.json'}"]
    for name, d in record["datasets"].items():
        tiers: dict[str, int] = {}
        for m in d["matched"]:
            tiers[m["tier"]] = tiers.get(m["tier"], 0) + 1
        by = ", ".join(f"{t} {tiers[t]}" for t in TIERS if t in tiers)
        lines.append(f"  {name}: {len(d['matched'])} of {d['rows']} rows matched" + (f" ({by})" if by else ""))
        for m in d["matched"][:10]:
            ex = m["examples"][0]
            lines.append(f"    row {m['row']} {m['tier']}: {ex['file']} row {ex['train_row']}"
                         + (f" (Jaccard {ex['similarity']})" if m["tier"] == "near" else ""))
        if len(d["matched"]) > 10:
            lines.append(f"    ... {len(d['matched']) - 10} more (the file lists all)")
    lines += [f"  not checked: {s}" for s in record["skipped"]]
    return lines


def main(argv: list[str]) -> int:
    parser = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, metavar="RUN")
    parser.add_argument("--train", type=Path, action="append", default=[], metavar="PATH",
                        help="training data: a JSONL, JSON or parquet file, or a directory of them (repeatable)")
    parser.add_argument("--trainer-config", type=Path, metavar="FILE", help="the trainer's config (verl's "
                        ".hydra/config.yaml, TRL's --config YAML, prime-rl's TOML): its layout finds the data "
                        "(default, with no --train: the config a watched trainer keeps in its saves, NeMo-RL's)")
    parser.add_argument("--layout", choices=[n for n in LAYOUTS if get_layout(n).train_data_keys],
                        help="the trainer of --trainer-config (without it: of the run's watched dirs, as detected)")
    parser.add_argument("--field", metavar="NAME", help="the training rows' prompt field (default: prompt, "
                        "messages, question, problem, ... the first present)")
    parser.add_argument("--tiers", default=",".join(TIERS), help=f"comma-separated, of {', '.join(TIERS)} (default all)")
    parser.add_argument("--ngram", type=int, default=Settings.ngram, help="words per n-gram (default 13)")
    parser.add_argument("--jaccard", type=float, default=Settings.jaccard,
                        help="near-duplicate threshold on word-set Jaccard similarity (default 0.6)")
    parser.add_argument("--procs", type=int, default=1, help="worker processes scanning the training rows (default 1)")
    parser.add_argument("--force", action="store_true", help="check again even if the inputs are unchanged")
    parser.add_argument("--fail-on-match", action="store_true", help="exit 1 when any eval row is matched")
    parser.add_argument("--json", action="store_true", help="print the record (RUN/contamination.json)")
    args = parser.parse_args(argv)
    if args.procs < 1:
        parser.error(f"--procs must be >= 1, got {args.procs}")
    if args.trainer_config is not None and args.layout is None:
        parser.error("--trainer-config needs --layout (the trainer that wrote it)")
    try:
        run = RunDir.open(args.run)
        sources = [str(p) for p in args.train]
        if args.trainer_config is not None:
            sources += config_sources(args.trainer_config, args.layout)
        elif not sources:
            sources = watched_sources(run, args.layout)
        settings = Settings(ngram=args.ngram, min_span=min(Settings.min_span, args.ngram), jaccard=args.jaccard)
        record = check(run, sources, settings, [t for t in args.tiers.split(",") if t], args.field, args.force,
                       args.procs)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(record, indent=1) if args.json else "\n".join(summary(record, run)))
    matched = any(d["matched"] for d in record["datasets"].values())
    return 1 if matched and args.fail_on_match else 0
