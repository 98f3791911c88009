"""Proof of which weights scored: pinning, attestation, the canary, and the trust check of run code.

docs/USER_GUIDE.md "Proving which weights scored"; docs/PROTOCOL.md §3 (trust model) and §4."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {
    "pin": "pinning", "PinViolation": "pinning", "attest": "attest", "Attestation": "attest",
    "TrainerCanary": "canary", "check_run_code": "trust",
})
