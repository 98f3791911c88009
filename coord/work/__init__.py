"""Work units and their leases: what a worker claims and how (docs/PROTOCOL.md §5)."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {
    "WorkUnit": "workunit", "units_for_step": "units", "Claim": "claims", "UnitClaimer": "claims",
})
