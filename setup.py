"""Build hook: the packages under one import root, and the top-level ``sbatch/`` batch scripts inside them.

Everything else is declared in pyproject.toml. The top-level folders ``jobs/`` and ``coord/`` install as
``ckpteval.jobs`` and ``ckpteval.coord`` (``package_dir``; issue #22): one distinctive root, so a user's own
``jobs/`` or ``coord/`` package (in the submit directory, on ``sys.path``, or another distribution's) can
neither shadow ckpteval nor be shadowed by it. ``ckpteval`` itself is an implicit namespace package (no
``__init__.py``): the editable install (``pip install -e``) maps ``ckpteval.jobs`` to ``jobs/`` itself, a
wheel holds ``ckpteval/jobs/``; a checkout on ``PYTHONPATH`` alone does not provide ``ckpteval`` (install it).
Every import in the project uses that root (``tests/test_import_root.py`` checks it).

A wheel gets a copy of ``sbatch/*.sbatch`` and ``sbatch/common.sh`` as ``ckpteval/jobs/launch/sbatch/``, where
``ckpteval.jobs.launch.submit.sbatch_dir`` finds them in an installed package; an editable install uses
``sbatch/`` itself (the copy is skipped in editable builds). ``tests/test_wheel.py`` builds and installs a real
wheel to check both.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).parent
ROOT_PACKAGE = "ckpteval"
FOLDERS = ("jobs", "coord")  # top-level folders, installed as ckpteval.<folder>
SBATCH_SOURCE = HERE / "sbatch"
SBATCH_IN_PACKAGE = Path(ROOT_PACKAGE) / "jobs" / "launch" / "sbatch"


def packages() -> list[str]:
    """``ckpteval.jobs``, ``ckpteval.jobs.eval``, ...: every package under the folders, under the root."""
    found = find_packages(where=str(HERE), include=[f"{f}{tail}" for f in FOLDERS for tail in ("", ".*")])
    return [f"{ROOT_PACKAGE}.{name}" for name in found]


class BuildPyWithSbatch(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / SBATCH_IN_PACKAGE
        self.mkpath(str(target))
        for src in sorted(SBATCH_SOURCE.iterdir()):
            if src.is_file() and src.suffix in {".sbatch", ".sh"}:
                self.copy_file(str(src), str(target / src.name))


setup(
    packages=packages(),
    package_dir={f"{ROOT_PACKAGE}.{f}": f for f in FOLDERS},
    package_data={f"{ROOT_PACKAGE}.jobs.eval.catalog": ["data/*.json", "data/*/*"]},  # the vendored eval sets
    cmdclass={"build_py": BuildPyWithSbatch},
)
