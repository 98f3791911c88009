"""``ckpteval status``: a run's progress, points and problems, read from its directory."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {"show": "main"})
