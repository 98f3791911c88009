"""Inference engines behind one small interface (see :mod:`jobs.eval.engines.base`)."""
