"""The trainer library: create (or resume) an eval run from any training loop and dispatch its steps.

``start_eval(EvalRun(...))`` returns the run's ``EvalDispatcher``; ``DispatchConfig`` (with its ``Waits``)
is the one eval config, the ``--eval-*`` flags. Guide: docs/USER_GUIDE.md "Your trainer"."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {
    "start_eval": "session", "EvalRun": "session", "DispatchConfig": "config", "Waits": "config",
    "EvalDispatcher": "dispatcher", "EvalDispatchCallback": "hf_callback",
})
