"""Scorer ``code``: a completion's program run against its row's tests in the sandbox (the test harness runs
in a process of its own). Guide: docs/USER_GUIDE.md "Code (sandboxed execution)"."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {"CodeScorer": "scorer", "CodeOptions": "scorer"})
