"""Every package's face (``__init__``): a docstring, and each name its ``__all__`` lists resolves."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FACES = sorted(  # every package of coord/ and jobs/: its __init__ is its face
    "ckpteval." + ".".join(p.parent.relative_to(ROOT).parts)
    for p in [*ROOT.glob("coord/**/__init__.py"), *ROOT.glob("jobs/**/__init__.py")])


@pytest.mark.parametrize("package", FACES)
def test_every_name_a_face_lists_resolves(package: str) -> None:
    module = importlib.import_module(package)
    assert module.__doc__ and module.__doc__.strip(), f"{package}: no docstring"
    assert module.__all__, f"{package}: empty __all__"
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{package}.{name}"
    with pytest.raises(AttributeError, match="not_a_name"):
        module.not_a_name  # noqa: B018


def test_the_trainer_library_face_is_the_guides_four_names() -> None:
    from ckpteval.jobs.trainer import DispatchConfig, EvalRun, Waits, start_eval
    from ckpteval.jobs.trainer.config import DispatchConfig as Config
    from ckpteval.jobs.trainer.session import start_eval as start

    assert (start_eval, DispatchConfig) == (start, Config) and EvalRun.__name__ == "EvalRun" and Waits.__name__ == "Waits"


def test_a_face_imports_nothing_until_a_name_is_used() -> None:
    """Importing every face loads no torch and none of the modules it names (the re-exports are lazy)."""
    code = ("import sys, importlib\n"
            f"for p in {sorted(FACES)!r}: importlib.import_module(p)\n"
            "print('torch' in sys.modules, 'ckpteval.jobs.trainer.session' in sys.modules,"
            " 'ckpteval.jobs.eval.worker.loop' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.split() == ["False", "False", "False"], out
