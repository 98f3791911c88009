"""Inference engines behind one small interface (see :mod:`jobs.engines.base`)."""
