"""ckpteval's programs (``coord/`` is the protocol they share).

Every program installs the registries' checks of run.json's names at start
(:func:`ckpteval.jobs.eval.kinds.evaluate.install_checks`), not by importing this package.
"""
