"""The eval side: the worker process (``worker/``), the kinds it evaluates (``kinds/``), scorers, engines,
proof of weights (``proof/``) and the code sandbox. docs/ARCHITECTURE.md maps the rooms."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {"WorkerSkip": "skips"})
