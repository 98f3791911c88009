"""Results: one file per unit, written once, and the points derived from them (docs/PROTOCOL.md §6-7)."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {
    "Result": "files", "ResultIndex": "files", "write_result": "files", "write_point_skip": "files",
    "Point": "points", "derive_point": "points", "point_metrics": "points",
})
