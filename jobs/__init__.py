"""ckpteval's programs (``coord/`` is the protocol they share).

Importing ``jobs`` installs the scorer registry's check into the run.json parser
(:func:`ckpteval.coord.run.manifest.set_scorer_check`, see :mod:`ckpteval.jobs.eval.scorers`), so every ckpteval program
validates a dataset's ``scorer`` and ``scorer_options`` against the same registry.
"""

import ckpteval.jobs.eval.scorers  # noqa: F401 — installs the scorer check (light: no engine, no torch)
