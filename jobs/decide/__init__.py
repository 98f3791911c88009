"""From points to decisions: paired comparisons of steps or runs, and the best checkpoint.

``stats`` holds the statistics (numpy only), ``data`` reads per-prompt values out of a run's results,
``compare`` and ``best`` are the ``ckpteval compare`` / ``ckpteval best`` commands.
"""
