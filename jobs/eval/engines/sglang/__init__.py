"""sglang: the launched engine, its LoRA variants, deterministic mode and the versions ckpteval speaks."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {
    "SGLangEngine": "engine", "HTTPLoRAEngine": "lora", "SGLangLoRAEngine": "lora", "SUPPORTED_SGLANG": "version",
})
