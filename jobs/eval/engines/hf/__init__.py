"""The in-process transformers engine (CPU or CUDA), and its LoRA variant."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {"HFEngine": "engine", "HFLoRAEngine": "lora"})
