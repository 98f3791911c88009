"""The reference stack: a tiny model, its trainer (``train/``) and its server (``serve/``), and the demo."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {"ModelConfig": "model", "build_model": "model"})
