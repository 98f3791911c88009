"""vLLM: the launched or attached server (its own venv), reloaded, stamped and checked per snapshot.
Guide: docs/USER_GUIDE.md "vLLM (--engine vllm)"."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {"VLLMEngine": "engine"})
