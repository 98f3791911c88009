"""The generate kind: prompts, sampling, answer extraction and scoring of one unit's samples.

docs/USER_GUIDE.md "Datasets: prompts, samples, scorers, cadence"."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {
    "DatasetCache": "scoring", "evaluate_generate": "scoring", "load_dataset": "evalsets",
})
