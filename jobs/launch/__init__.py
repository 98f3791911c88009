"""Launching on SLURM: ``ckpteval submit`` and the Python API (docs/USER_GUIDE.md "Running on an existing SLURM cluster")."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {
    "submit_fleet": "api", "submit_backfill": "api", "submit_service": "api", "submit_train_eval": "api",
})
