"""One import root: the installed code is ``ckpteval.jobs`` and ``ckpteval.coord`` (issue #22 item 5).

The top-level folders ``jobs/`` and ``coord/`` install under ``ckpteval`` (setup.py), so a user's own
``jobs/`` or ``coord/`` package — a common name in ML repositories, and SLURM runs batch scripts in the
submit directory — can neither shadow ckpteval nor be loaded by it. Checked here:

- nothing in the project still names the old roots (an ``import jobs...`` that works from the checkout
  would load a second copy of a module next to ``ckpteval.jobs...``): imports, ``"module:Class"`` strings,
  ``-m`` targets, in code, tests, benchmarks, examples, docs and batch scripts; the batch scripts run
  python with ``-P`` (never import from the working directory);
- from a submit directory holding decoy ``jobs/`` and ``coord/`` packages (each exits 97 with "DECOY" when
  imported): the CLI (``python -m`` and the installed entry point), the notebook import of the launch API,
  and a rendered backfill batch script run with bash (stand-ins for ``srun``/``scontrol``: no SLURM here)
  run ckpteval's code, and no module named ``jobs``/``coord`` gets loaded.

Limits: a folder named ``ckpteval/`` in the working directory of ``python -c``/a notebook (not with ``-P``
or the entry point) joins the ``ckpteval`` namespace; it shadows nothing unless it has a ``jobs/``
or ``coord/`` of its own.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckpteval.jobs.launch import submit

ROOT = Path(__file__).parents[1]
OLD = ("jobs", "coord")
_OLD = "|".join(OLD)
# a module path under an old root, as a whole string: "<old>.x.y" or "<old>.x:Name"
OLD_MODULE_STRING = re.compile(rf"^(?:{_OLD})(?:\.\w+)+(?::\w+)?$")
OLD_IN_TEXT = [
    re.compile(rf"^\s*(?:from|import)\s+(?:{_OLD})\b", re.M),  # an import line (docs code blocks)
    re.compile(rf"-m\s+(?:{_OLD})\."),  # python -m <old>.cli
    re.compile(rf"[\"'](?:{_OLD})\.\w[\w.]*(?::\w+)?[\"']"),  # a quoted module path or registry string
    re.compile(rf"(?<![\w./$-])(?:{_OLD})\.\w+:\w+"),  # an unquoted "module:Class"
]
TEXT_SUFFIXES = {".md", ".sh", ".sbatch", ".toml", ".cfg", ".yaml", ".yml", ".json", ".txt", ""}
DECOY = 'import sys\nprint("DECOY {name} imported", file=sys.stderr)\nsys.exit(97)\n'


def project_files() -> list[Path]:
    """Every file git tracks (or, outside a git checkout, every file but the venv and caches)."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True, timeout=60).stdout.decode()
        files = [ROOT / p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        files = [p for p in ROOT.rglob("*") if not {".git", ".venv", "__pycache__"} & set(p.parts)]
    return [p for p in files if p.is_file() and not p.is_symlink()]


def old_root_references_in_python(path: Path) -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and OLD_MODULE_STRING.match(node.value):
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: string {node.value!r}")
        bad += [f"{path.relative_to(ROOT)}:{node.lineno}: import {n}" for n in names if n.split(".")[0] in OLD]
    return bad


def old_root_references_in_text(path: Path, patterns: list[re.Pattern[str]]) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return []
    bad = []
    for pattern in patterns:
        for m in pattern.finditer(text):
            bad.append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0).strip()!r}")
    return bad


def test_nothing_names_the_old_import_roots() -> None:
    """No import of an old root (``import <old>...``, ``from <old> import``), no ``"<old>.x:Class"`` string, no
    ``-m <old>.x`` anywhere (code, tests, bench, examples, docs, batch scripts, pyproject): every reference
    uses ``ckpteval.``. Python files are parsed (imports, whole-string constants; plus ``-m`` in their text)."""
    bad = []
    for path in project_files():
        if path.suffix == ".py":
            bad += old_root_references_in_python(path) + old_root_references_in_text(path, OLD_IN_TEXT[1:2])
        elif path.suffix in TEXT_SUFFIXES:
            bad += old_root_references_in_text(path, OLD_IN_TEXT)
    assert not bad, "old import roots (use ckpteval.jobs / ckpteval.coord):\n" + "\n".join(bad)


def test_batch_scripts_run_python_with_dash_p() -> None:
    """Every ``python -m ckpteval...`` of the batch scripts carries ``-P``: the job's working directory (the
    submit dir) is never on the import path."""
    for path in sorted((ROOT / "sbatch").iterdir()):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for m in re.finditer(r"(\S+)\s+-m\s+ckpteval\.", line):
                assert m.group(1) == "-P", f"{path.name}:{lineno}: python without -P: {line.strip()}"


@pytest.fixture
def submit_dir(tmp_path: Path) -> Path:
    """A user's submit dir with decoy ``jobs/`` and ``coord/`` packages, shaped like ckpteval's own."""
    for package in (*OLD, "jobs/launch", "jobs/eval"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text(DECOY.format(name=package))
    for module in ("jobs/cli.py", "jobs/launch/api.py", "jobs/launch/slurm_env.py", "coord/atomic.py"):
        (tmp_path / module).write_text(DECOY.format(name=module))
    return tmp_path


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith(("SLURM_", "CKPTEVAL_"))}
    return {**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _run(cmd: list[str], cwd: Path, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=kw.pop("env", None) or _env(), capture_output=True, text=True,
                          timeout=120, **kw)  # type: ignore[call-overload]


def test_cli_from_a_submit_dir_with_decoys_runs_ckpteval(submit_dir: Path) -> None:
    """``python -m ckpteval.jobs.cli`` (the working directory is on sys.path then) and the installed entry point."""
    entry = Path(sys.executable).parent / "ckpteval"
    commands = [[sys.executable, "-m", "ckpteval.jobs.cli", "--help"]]
    if entry.is_file():
        commands.append([str(entry), "--help"])
    for cmd in commands:
        proc = _run(cmd, submit_dir)
        assert proc.returncode == 0 and "DECOY" not in proc.stderr, (cmd, proc.stderr[-2000:])
        assert "submit" in proc.stdout and "backfill" in proc.stdout, proc.stdout  # ckpteval's own command list


def test_notebook_import_of_the_launch_api_ignores_decoys(submit_dir: Path) -> None:
    """``from ckpteval.jobs.launch import api`` with the working directory first on sys.path (as ``python -c``
    and a notebook have it): ckpteval's module, and no module of the old roots loaded at all."""
    code = ("import sys\nfrom ckpteval.jobs.launch import api\nprint(api.__file__)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {OLD!r}))")
    proc = _run([sys.executable, "-c", code], submit_dir)
    assert proc.returncode == 0 and "DECOY" not in proc.stderr, proc.stderr[-2000:]
    module, loaded = proc.stdout.splitlines()
    assert not Path(module).is_relative_to(submit_dir) and Path(module).name == "api.py", module
    assert loaded == "[]", f"modules of the old roots loaded: {loaded}"


STAND_IN = "#!/bin/bash\n# {name} stand-in: drop the options, run the command\n" \
           'while [[ $# -gt 0 && $1 == -* ]]; do shift; done\n"$@"\n'


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_rendered_batch_script_from_a_submit_dir_with_decoys_runs_ckpteval(submit_dir: Path) -> None:
    """A real rendered backfill script, run with bash in the submit dir (SLURM's working directory) with the real
    python: its programs are ckpteval's (the run's unreadable run.json is reported by ckpteval's backfill), never
    the decoys. ``srun`` and ``scontrol`` are stand-ins (no SLURM here)."""
    bin_dir = submit_dir / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol"):
        (bin_dir / name).write_text(STAND_IN.format(name=name))
        (bin_dir / name).chmod(0o755)
    run = submit_dir / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")  # exists (submit checks that), but no run: backfill must say so
    prepared = submit.prepare(["backfill", "--run-dir", str(run), "--python", sys.executable, "--gpus-per-worker", "0",
                               "--grace", "5"])
    script = submit_dir / "backfill.sbatch"
    script.write_text(prepared.script)
    env = {**_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "901", "SLURMD_NODENAME": "n1",
           "SLURM_SUBMIT_DIR": str(submit_dir), "CKPTEVAL_WORKER_RESTARTS": "0", "CKPTEVAL_MAX_REQUEUES": "0"}
    proc = _run(["bash", str(script)], submit_dir, env=env)
    out = proc.stdout + proc.stderr
    assert "DECOY" not in out, out[-3000:]
    assert f"{run / 'run.json'}:" in out and "Traceback" not in out, out[-3000:]  # ckpteval's one line about it
    assert "-P -m ckpteval.jobs.cli backfill" in out, out[-3000:]  # the step's command, as slurm_env exec logs it
