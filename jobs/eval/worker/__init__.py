"""The eval worker process: poll, claim, evaluate, publish (``ckpteval worker``/``backfill``/``service``).

Promises (outcomes, leases, preemption, exit codes): docs/USER_GUIDE.md "Self-healing" and "Stopping things"."""

from ckpteval.coord.faces import face

__all__, __getattr__ = face(__name__, {
    "Worker": "loop", "RetryPolicy": "policy", "WorkerOptions": "options", "run_worker": "main",
    "EvalConfig": "evalconfig", "read_eval_config": "evalconfig",
})
