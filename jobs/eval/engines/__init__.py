"""Inference engines behind one small interface (:mod:`ckpteval.jobs.eval.engines.base`); ``--engine`` specs
are built by :func:`~ckpteval.jobs.eval.engines.factory.make_engine` from the ``ENGINES`` registry. Guide:
docs/USER_GUIDE.md "Dataset kinds and engines"."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {
    "Engine": "base", "EngineError": "base", "SamplingParams": "base", "Generation": "base",
    "ENGINES": "factory", "make_engine": "factory", "EnginePool": "factory",
})
