"""``ckpteval serve``: the reference model behind an sglang-shaped HTTP API (docs/USER_GUIDE.md)."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {"main": "main"})
