"""ckpteval's shared-filesystem protocol.

Everything two jobs agree on lives here, and nothing else does: this package imports nothing from
``jobs/``, knows no engine and no scheduler. See ``docs/PROTOCOL.md`` for the on-disk format.
"""

# The one protocol this code reads and writes: 2, one directory per step under ``results/`` and ``leases/``
# (``results/step-<N>/``, ``leases/step-<N>/``, :mod:`ckpteval.coord.run.rundir`). A run dir of another version
# (1: flat, never released) is refused naming it (:func:`ckpteval.coord.run.manifest.parse_manifest`).
PROTOCOL_VERSION = 2

__all__ = ["PROTOCOL_VERSION"]
