"""Inference engines behind one small interface (see :mod:`ckpteval.jobs.eval.engines.base`)."""
