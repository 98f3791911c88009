"""Fault-injection suite: real processes, real signals, real filesystems (see tests/chaos/harness.py)."""
