"""Writing a step's weights as a snapshot: the background exporter and the HF/adapter/Megatron files it writes."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {"AsyncExporter": "async_export", "ExportOutcome": "async_export"})
