"""Build hook: ship the top-level ``sbatch/`` batch scripts inside the package.

Everything else is declared in pyproject.toml. A wheel gets a copy of ``sbatch/*.sbatch`` and
``sbatch/common.sh`` as ``jobs/launch/sbatch/``, where ``jobs.launch.submit.sbatch_dir`` finds them in an
installed package; an editable install or a checkout on PYTHONPATH uses ``sbatch/`` itself (the copy is
skipped in editable builds). ``tests/test_wheel.py`` builds and installs a real wheel to check it.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SBATCH_SOURCE = Path(__file__).parent / "sbatch"
SBATCH_IN_PACKAGE = Path("jobs") / "launch" / "sbatch"


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


setup(cmdclass={"build_py": BuildPyWithSbatch})
