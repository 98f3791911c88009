"""ckpteval's programs (``coord/`` is the protocol they share).

Every program installs the registries' checks of run.json's names at start
(:func:`ckpteval.jobs.eval.kinds.evaluate.install_checks`), not by importing this package.
"""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {"main": "cli"})  # the ``ckpteval`` command
