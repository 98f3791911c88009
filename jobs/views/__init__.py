"""Read-only views of runs: ``status`` (``status/``), ``plot``, and the tables they print."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {"plot_run": "plot", "PlainTable": "tables"})
