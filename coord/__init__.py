"""ckpteval's shared-filesystem protocol.

Everything two jobs agree on lives here, and nothing else does: this package imports nothing from
``jobs/``, knows no engine and no scheduler. See ``docs/PROTOCOL.md`` for the on-disk format.
"""

PROTOCOL_VERSION = 1
