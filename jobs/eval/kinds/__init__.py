"""The kinds of entry a unit evaluates: ``generate/`` (prompts, samples, scorers), ``lm_eval``, ``env/``.

docs/USER_GUIDE.md "Dataset kinds and engines"."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {"evaluate_pinned": "evaluate", "install_checks": "evaluate"})
