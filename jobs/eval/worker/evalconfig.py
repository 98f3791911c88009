"""Eval-config files: read and checked in one place, and a run created from one.

The eval-config file (format in :mod:`ckpteval.jobs.eval.worker.main`) is read by :func:`read_eval_config` for every
command that takes one: ``ckpteval worker --eval-config``, ``ckpteval train --eval-config`` (and the trainer
library, :mod:`ckpteval.jobs.trainer.session`), ``ckpteval backfill --from-run ... --eval-config`` and
``ckpteval submit`` on the submit host. Paths in it are relative to the file: JSONL datasets are copied into
``RUN/data/<name>.jsonl`` (:func:`install_eval_data`; a ``{"catalog": NAME}`` entry is made whole first and its
vendored rows rendered with its template: :mod:`ckpteval.jobs.eval.catalog`), an ``lm_eval`` entry's ``include_path`` is made absolute
(its task configs stay where they are).

Guarantee: everything is validated before anything is written, and ``run.json`` is written last (first
creator wins; an existing run must have the same eval). Limits: a data file changed between the read and
the copy is copied as it is then. This module imports no worker loop (the trainer library reads configs too).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import dumps, publish_exclusive, read_json_object, write_bytes_atomic
from ckpteval.coord.entries.catalog import CatalogEntry
from ckpteval.coord.entries.rows import subset_rows
from ckpteval.coord.run.manifest import EvalSpec, Fields, LeaseSettings, RunManifest, parse_manifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.eval.catalog.expand import expand_entry, rendered_rows
from ckpteval.jobs.eval.kinds.generate.evalsets import load_entry_rows


@dataclass(frozen=True)
class EvalConfig:
    """An eval-config file, read and checked: the run.json ``eval`` section it yields, and its data files."""

    path: Path
    raw: dict[str, Any]  # the whole file (run_id, lease, ... as given)
    eval: dict[str, Any]  # dataset paths rewritten to data/<name>.jsonl, include_path made absolute
    sources: dict[str, Path]  # dataset name -> the file install_eval_data copies into RUN/data/
    spec: EvalSpec  # the validated eval section
    lease: LeaseSettings | None  # the file's lease settings, None when it gives none


CONFIG_KEYS = ("run_id", "eval", "lease")  # the keys of an eval-config file


def read_eval_config(config_path: Path) -> EvalConfig:
    """Read and validate an eval-config file and its dataset files (nothing is written); errors name the
    file and field (unknown keys too, with the closest valid one). A generate dataset's ``n_prompts``
    may be left out: it is filled from the file (or its ``subset``). Also run on the submit host by
    ``ckpteval submit ... --eval-config``."""
    config_path = Path(config_path)
    cfg = read_json_object(config_path)
    Fields(config_path, cfg, "").reject_unknown(CONFIG_KEYS, "an eval config")
    if not isinstance(cfg.get("eval"), dict):
        raise ValueError(f"{config_path}: field eval must be an object (the eval section of run.json)")
    sources: dict[str, Path] = {}
    eval_section = json.loads(json.dumps(cfg["eval"]))
    for i, ds in enumerate(eval_section.get("datasets") or []):
        if not isinstance(ds, dict):
            continue
        if "catalog" in ds:  # a catalog benchmark: its settings and vendored rows (jobs/eval/catalog)
            ds = eval_section["datasets"][i] = expand_entry(ds, f"{config_path}: field eval.datasets[{i}]")
        if isinstance(ds.get("path"), str) and isinstance(ds.get("name"), str):
            src = Path(ds["path"])
            sources[ds["name"]] = src = src if src.is_absolute() else config_path.parent / src
            ds["path"] = f"data/{ds['name']}.jsonl"
            if "n_prompts" not in ds:
                ds["n_prompts"] = _rows_of(config_path, i, ds, src)
        if isinstance(ds.get("include_path"), str):  # an lm_eval entry's task configs stay in place
            ds["include_path"] = str((config_path.parent / ds["include_path"]).resolve())
    checked = parse_manifest(
        {"run_id": cfg.get("run_id", "eval-config"), "snapshot_roots": [], "eval": eval_section, "lease": cfg.get("lease", {})},
        config_path,
    )
    for name, src in sources.items():  # every row is read now, so a bad file fails before anything is written
        spec = checked.entry(name)
        rows = load_entry_rows(_existing(config_path, name, src), spec)
        try:
            want = len(subset_rows(len(rows), spec))
        except ValueError as e:
            raise ValueError(f"{config_path}: {e} ({src})") from None
        if isinstance(spec, CatalogEntry):
            try:
                rendered_rows(spec)  # a template that cannot render is refused before anything is written
            except ValueError as e:
                raise ValueError(f"{config_path}: {e}") from None
        if want != spec.n_prompts:
            raise ValueError(f"{config_path}: dataset {name!r} file {src} has {len(rows)} rows, n_prompts says "
                             f"{spec.n_prompts}{'' if spec.subset is None else f' (subset {spec.subset})'}")
    check_task_names(config_path, checked.eval.entries)
    check_names_resolve(config_path, checked.eval)
    return EvalConfig(config_path, cfg, eval_section, sources, checked.eval, checked.lease if "lease" in cfg else None)


def check_task_names(config_path: Path, entries: tuple[Any, ...]) -> None:
    """lm_eval entries' task names, checked where lm-eval is installed (train, submit and backfill hosts as
    well as workers): a misspelt task is refused at start, naming the config, never left to the fleet."""
    harness = tuple(e for e in entries if e.kind == "lm_eval")
    if not harness or importlib.util.find_spec("lm_eval") is None:
        return
    from ckpteval.jobs.eval.kinds.lm_eval import check_harness  # lm-eval's task index: only when needed

    try:
        check_harness(RunDir(config_path.parent), harness)
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"{config_path}: {e}") from None


def check_names_resolve(config_path: Path, spec: EvalSpec) -> None:
    """What a worker would refuse only after a run dir exists, refused here first, naming the config:
    ``eval.base_model`` that is not a directory, a ``module:function`` scorer whose module is not importable
    (found, not executed)."""
    if spec.base_model is not None and not Path(spec.base_model).is_dir():
        raise FileNotFoundError(f"{config_path}: field eval.base_model: {spec.base_model} is not a directory")
    for entry in spec.entries:
        module, _, function = str(getattr(entry, "scorer", "") or "").partition(":")
        if not (module and function):
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package that does not exist, a bad name
            found = False
        if not found:
            raise ValueError(f"{config_path}: dataset {entry.name!r}: scorer {entry.scorer!r}: no module named "
                             f"{module!r} here (a module:function scorer must be importable where workers run)")


def _existing(config_path: Path, name: str, src: Path) -> Path:
    if not src.is_file():
        raise FileNotFoundError(f"{config_path}: dataset {name!r} file {src} not found")
    return src


def _rows_of(config_path: Path, i: int, ds: dict[str, Any], src: Path) -> Any:
    """What ``n_prompts`` is when the config leaves it out: ``subset``, else the file's row count (the rows
    themselves are checked after the entry is parsed)."""
    if ds.get("subset") is not None:
        return ds["subset"]
    path = _existing(config_path, str(ds["name"]), src)
    try:
        rows = sum(1 for line in path.read_text().splitlines() if line.strip())
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path}: field eval.datasets[{i}].path: cannot read {path} ({e})") from None
    if rows == 0:
        raise ValueError(f"{config_path}: dataset {ds['name']!r}: {path} is empty (no JSONL rows): one JSON object "
                         "per line, e.g. {\"prompt\": \"2+2=\", \"answer\": \"4\"}")
    return rows


def install_eval_data(run: RunDir, config: EvalConfig) -> None:
    """Copy the config's JSONL datasets into ``RUN/data/<name>.jsonl`` (atomic per file), when a run is created;
    a catalog entry whose settings differ from its model's published reference is said then, once, on stderr."""
    # imported here: the trainer library's import stays light (tests/test_session.py)
    from ckpteval.jobs.eval.catalog.reference import reference_warnings

    for line in reference_warnings(config.spec.entries):
        print(f"ckpteval: warning: {line}", file=sys.stderr, flush=True)
    for name, src in config.sources.items():
        entry = config.spec.entries[[e.name for e in config.spec.entries].index(name)]
        data = rendered_rows(entry) if isinstance(entry, CatalogEntry) else src.read_bytes()
        write_bytes_atomic(run.data / f"{name}.jsonl", data)


def create_run_from_config(run_dir: Path, config_path: Path, roots: tuple[Path, ...]) -> RunDir:
    """Create (or check) a run from an eval-config file; see the module docstring for the format.

    Everything is validated first (:func:`read_eval_config`); only then are the run dir, the dataset
    copies and run.json written (run.json last), so a rejected config leaves nothing behind.
    """
    config = read_eval_config(config_path)
    root_list = [str(Path(r).expanduser().resolve()) for r in roots]
    obj = {
        "run_id": config.raw.get("run_id", RunDir(run_dir).path.name),
        "eval": config.eval,
        "snapshot_roots": root_list,
        "trainer": {"kind": "external", "foreign_roots": root_list},
        "lease": config.raw.get("lease", {}),
        "created": time.time(),
    }
    return publish_run(run_dir, parse_manifest(obj, config.path), config)


def publish_run(run_dir: Path, manifest: RunManifest, config: EvalConfig) -> RunDir:
    """Create the run dir, its data files and ``run.json`` (first creator wins); an existing run must
    have the same eval, else ValueError."""
    run = RunDir(run_dir)
    if run.manifest_path.exists():
        if run.manifest().eval != manifest.eval:
            raise ValueError(f"{run.manifest_path} exists with a different eval config than {config.path}")
        return run
    run = RunDir.create(run_dir)
    install_eval_data(run, config)
    publish_exclusive(
        run.manifest_path, dumps(manifest.to_json())
    )  # a concurrent creator may win: same content
    return run
