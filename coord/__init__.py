"""ckpteval's shared-filesystem protocol.

Everything two jobs agree on lives here, and nothing else does: this package imports nothing from
``jobs/``, knows no engine and no scheduler. See ``docs/PROTOCOL.md`` for the on-disk format.
"""

PROTOCOL_VERSION = 2
# Protocol versions this code reads and writes. 1: flat ``results/`` and ``leases/``; 2 (new runs): one
# directory per step under each (``results/step-<N>/``, ``leases/step-<N>/``, :mod:`ckpteval.coord.rundir`).
PROTOCOLS = (1, 2)
