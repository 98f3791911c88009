"""A real wheel, installed into a fresh venv, works from outside the checkout.

Builds the wheel from a copy of the sources (``pip wheel --no-build-isolation --no-index``: offline, and
the checkout gets no ``build/``), installs it with ``--no-deps`` into a new venv whose only extra path is
this venv's site-packages (torch and friends, not reinstalled; that directory's editable-install hook is
not a ``.pth`` of the new venv, so ``jobs`` can only come from the wheel), then, from an unrelated
directory and without PYTHONPATH: ``ckpteval submit ... --dry-run`` must render the batch scripts the
wheel ships, and a short ``ckpteval demo`` must run end to end (trainer + one worker process).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "coord", "jobs", "sbatch")


def _run(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the freshly built wheel installed; returns its bin/ dir."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp / "dist"),
          str(src)], tmp, 300)
    (wheel,) = (tmp / "dist").glob("ckpteval-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, 120)
    _run([*pip, "--python", str(venv / "bin" / "python"), "install", "-q", "--no-deps", "--no-index", str(wheel)],
         tmp, 300)
    site = Path(_run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     tmp, 60).strip())
    (site / "ckpteval_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin"


def _outside_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def test_installed_wheel_imports_itself_and_ships_the_batch_scripts(installed: Path, tmp_path: Path) -> None:
    out = _run([str(installed / "python"), "-c", "import ckpteval.jobs.launch.submit as s; print(s.__file__); print(s.SBATCH_DIR)"],
               tmp_path, 60, _outside_env())
    module, scripts = (Path(line) for line in out.split())
    assert module.is_relative_to(installed.parent) and scripts.is_relative_to(installed.parent), out
    assert {p.name for p in scripts.iterdir()} == {p.name for p in (ROOT / "sbatch").iterdir()}
    # one import root (#22): ckpteval.jobs and ckpteval.coord, no top-level package another project could own
    roots = _run([str(installed / "python"), "-c", "import importlib.util as u; print([u.find_spec(m) is None for m in "
                  "('jobs', 'coord', 'ckpteval.coord.atomic')])"], tmp_path, 60, _outside_env())
    assert roots.strip() == "[True, True, False]", roots


def test_installed_wheel_submit_dry_run_from_outside_the_checkout(installed: Path, tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text("{}")  # backfill scores an existing run (checked on submit)
    out = _run([str(installed / "ckpteval"), "submit", "backfill", "--run-dir", str(tmp_path / "run"), "--tasks", "2",
                "--dry-run"], tmp_path, 60, _outside_env())
    (line,) = [x for x in out.splitlines() if x.startswith("export CKPTEVAL_SBATCH_DIR=")]
    shipped = Path(line.split("=", 1)[1])
    assert shipped.is_relative_to(installed.parent) and (shipped / "common.sh").is_file(), line
    assert "#SBATCH --array=0-1" in out and [p.name for p in (tmp_path / "run").iterdir()] == ["run.json"]


def test_installed_wheel_runs_a_short_demo_from_outside_the_checkout(installed: Path, tmp_path: Path) -> None:
    out = _run([str(installed / "ckpteval"), "demo", "--steps", "2", "--eval-interval", "2", "--eval-n-prompts", "4",
                "--workers", "1", "--staging", "run", "--run-dir", str(tmp_path / "demo")], tmp_path, 240,
               _outside_env())
    assert "points 2 scored of 2" in out and "every point pinned to its step: True" in out, out[-2000:]
