"""From points to decisions: paired comparisons of steps or runs, and the best checkpoint.

``stats`` holds the statistics (scipy's distributions), ``noise`` the engine's noise from replays and the minimum
detectable effect, ``data`` reads per-prompt values out of a run's results, ``compare`` and ``best`` are the
``ckpteval compare`` / ``ckpteval best`` commands.
"""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {"compare_sides": "compare", "best_record": "best", "EngineNoise": "noise"})
