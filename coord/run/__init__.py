"""A run directory: run.json, its parsed manifest, the trainer's ledger and the run's identity (docs/PROTOCOL.md §1, §3, §8, §11)."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {
    "RunDir": "rundir", "RunManifest": "manifest", "EvalSpec": "manifest", "load_manifest": "manifest",
    "Ledger": "ledger", "run_key": "identity",
})
