"""The contamination gate: a run's eval rows against the trainer's own prompts (``ckpteval contamination``;
docs/USER_GUIDE.md "Contamination gate"). Its record: :mod:`ckpteval.coord.results.contamination`."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {
    "check": "gate", "EvalIndex": "index", "Settings": "index", "TIERS": "index", "data_files": "train_data",
})
