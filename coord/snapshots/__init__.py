"""Snapshots: markers, publication, verification, discovery and garbage collection (docs/PROTOCOL.md §4, §9)."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {
    "Marker": "snapshot", "publish_snapshot": "snapshot", "mark_complete": "snapshot", "read_marker": "snapshot",
    "SnapshotRef": "discovery", "SnapshotDiscovery": "discovery", "StagingGC": "gc",
})
