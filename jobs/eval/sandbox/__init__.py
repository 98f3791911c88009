"""The code sandbox: bubblewrap-isolated runs of model-written programs (docs/USER_GUIDE.md "Code")."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {"Sandbox": "core", "shared_sandbox": "core"})
