"""Who may run code in an eval process: the check before a run.json's ``module:function`` is imported.

A run.json may name a scorer ``module:function`` that every worker imports and calls on every
completion. Whoever can write run.json (or the run dir, where run.json can be replaced by a rename)
can therefore run code as every user whose worker, backfill or shared-posture trainer reads the run,
and can forge its results. The rule enforced here: such code is imported only when run.json and the
run dir are owned by this process's user and writable by nobody else (no group/other write bit), or
when the process was started with an explicit opt-in (``--trust-run-code``, or
``SharedEval(trust_run_code=True)`` for a trainer's shared posture).

The registered scorers (:data:`ckpteval.jobs.eval.scorers.SCORERS`: ``exact``, ``math``, ...) and environments
(:data:`ckpteval.jobs.eval.kinds.env.ENVIRONMENTS`) are not code named by run.json and always pass; an ``env`` entry's
``module:Class`` is. Limits:
POSIX mode bits and owners only (ACLs, a writable parent dir and the module's own file on sys.path are
not inspected); the check runs once, at start, against the files as they are then.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ckpteval.coord.run.manifest import RunManifest
from ckpteval.coord.run.rundir import RunDir
from ckpteval.jobs.eval.kinds.env import ENVIRONMENTS
from ckpteval.jobs.eval.scorers import SCORERS

OPT_IN = "--trust-run-code"


class UntrustedRunCode(ValueError):
    """run.json names code to import, and someone other than this user could have written it."""


def run_code(manifest: RunManifest) -> list[str]:
    """The ``module:function`` names run.json asks this process to import (empty: nothing to trust)."""
    named = {name for e in manifest.eval.entries for name in e.user_code()}
    return sorted(name for name in named if name not in SCORERS and name not in ENVIRONMENTS)


def foreign_writers(paths: list[Path]) -> list[str]:
    """Why each path could be written by someone other than this user (empty when none could)."""
    me = os.getuid()
    problems = []
    for path in paths:
        st = path.stat()
        if st.st_uid != me:
            problems.append(f"{path} is owned by uid {st.st_uid}, not this user (uid {me})")
        elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            who = "group" if st.st_mode & stat.S_IWGRP else "other users"
            problems.append(f"{path} is writable by {who} (mode {stat.filemode(st.st_mode)})")
    return problems


def check_run_code(run: RunDir, manifest: RunManifest, *, trusted: bool) -> None:
    """Refuse (UntrustedRunCode, one line) to import run.json's code unless only this user could have put it there."""
    code = run_code(manifest)
    if not code or trusted:
        return
    problems = foreign_writers([run.manifest_path, run.path])
    if problems:
        raise UntrustedRunCode(
            f"run.json names code to import ({', '.join(code)}) but {problems[0]}: anyone who can write it "
            f"could run code as you. Fix the permissions (chmod go-w), or pass {OPT_IN} if you trust them"
        )
