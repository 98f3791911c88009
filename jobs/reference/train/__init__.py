"""``ckpteval train``: the reference trainer, itself a user of the trainer library (``ckpteval.jobs.trainer``)."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {"run_training": "main", "main": "main"})
