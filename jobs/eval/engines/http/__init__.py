"""The engine protocol over sglang's native HTTP API: a client of a server someone else runs."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {"HTTPEngine": "engine"})
