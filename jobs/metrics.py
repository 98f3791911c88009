"""The trainer's metrics sink: ``metrics.jsonl`` always, wandb optionally.

What this module owns and promises:

- Every metric the trainer logs is appended to ``RUN/metrics.jsonl`` as one JSON object per line
  with its ``step`` (one ``write`` of the whole line + fsync). ``train/*`` lines carry the trainer
  step; an eval point's line carries its *dispatch* step (``step == eval/step``), whenever it lands.
- Eval points are logged **exactly once** per ``eval/step`` in ``metrics.jsonl``: the sink reads the
  file on open and refuses (returns False for) a second point with an ``eval/step`` already present.
  That closes the crash window of the ingestion protocol (metrics line written, trainer killed before
  the ledger's ``ingested`` record): the requeued trainer re-ingests the point and the sink drops the
  duplicate line. A torn last line (crash mid-write) is cut off on open, as the ledger does
  (:func:`ckpteval.coord.atomic.read_jsonl_numbered`, the one JSONL policy).
- wandb (optional): ``eval/step`` is defined as the step metric of ``eval/*`` and ``train/step`` of
  ``train/*``, and ``wandb.log`` is never given ``step=``, so a late point lands at its dispatch step
  on the eval axis and never trips wandb's "step must increase" rule. ``WANDB_MODE=offline`` works
  without a network (the run is written under ``RUN/wandb/``).

Limits: wandb is at-least-once, not exactly-once: a point is sent to wandb before its jsonl line, so
a crash between the two sends it again after a restart (it lands on the same ``eval/step``; a
duplicate there is invisible in charts). ``train/*`` lines are not deduplicated: a trainer resumed
from its checkpoint at step C re-logs steps C+1.. it had already logged before being killed; readers
take the last line per step. One writer per run (the trainer).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import append_line, read_jsonl_numbered

EVAL_STEP = "eval/step"
TRAIN_STEP = "train/step"


class MetricsSink:
    """Appends metrics to ``metrics.jsonl`` and, if given a wandb run, logs them there too."""

    def __init__(self, path: Path, wandb_run: Any | None = None) -> None:
        self.path = Path(path)
        self.wandb_run = wandb_run
        self.repaired_bytes = 0
        self._eval_steps = self._replay()
        if wandb_run is not None:
            define_wandb_metrics(wandb_run)

    # -- reading back -------------------------------------------------------------------------------
    def _replay(self) -> set[int]:
        """The ``eval/step`` values already in the file (cutting off a torn last line first)."""
        records, self.repaired_bytes = read_jsonl_numbered(self.path, repair=True, what="metrics line")
        return {int(rec[EVAL_STEP]) for _lineno, rec in records if EVAL_STEP in rec}

    def has_eval_step(self, step: int) -> bool:
        return step in self._eval_steps

    # -- writing ------------------------------------------------------------------------------------
    def log_train(self, step: int, metrics: dict[str, float]) -> None:
        """Trainer metrics of ``step`` (names should start with ``train/``)."""
        record = {TRAIN_STEP: step, **metrics}
        if self.wandb_run is not None:
            self.wandb_run.log(record)
        self._append({"step": step, **metrics})

    def log_eval(self, metrics: dict[str, float]) -> bool:
        """One eval point (must hold ``eval/step``); False (and nothing written) if already logged."""
        if EVAL_STEP not in metrics:
            raise ValueError(f"an eval point must carry {EVAL_STEP!r}: {sorted(metrics)}")
        step = int(metrics[EVAL_STEP])
        if step in self._eval_steps:
            return False
        if self.wandb_run is not None:
            self.wandb_run.log(dict(metrics))
        self._append({"step": step, **metrics})
        self._eval_steps.add(step)
        return True

    def record_config(self, values: dict[str, Any]) -> None:
        """Put ``values`` into the wandb run's config (latest wins), e.g. ``eval/scorer/<ds>``: what scored a
        dataset (a judge's model id, template hash, sampling) — learned only once a point is scored."""
        if self.wandb_run is not None and values:
            self.wandb_run.config.update(values, allow_val_change=True)

    def _append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(_finite(record), sort_keys=True) + "\n").encode()
        append_line(self.path, line)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf are not JSON: they are written as null."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def define_wandb_metrics(run: Any) -> None:
    """Eval metrics are plotted against ``eval/step`` and train metrics against ``train/step``."""
    run.define_metric(EVAL_STEP)
    run.define_metric("eval/*", step_metric=EVAL_STEP)
    run.define_metric(TRAIN_STEP)
    run.define_metric("train/*", step_metric=TRAIN_STEP)


WANDB_JOIN_MODES = ("resume", "shared")
WANDB_LOCAL_MODES = ("offline", "dryrun", "disabled")  # wandb modes that need no login
WANDB_NO_LOGIN = ("wandb is not logged in on this machine: run `wandb login` (or set WANDB_API_KEY), "
                  "or set WANDB_MODE=offline to log locally and `wandb sync` later")


def check_wandb_login(flag: str = "--wandb") -> None:
    """Refuse, before anything is written, a wandb run that would need a login this machine lacks
    (ValueError, one line naming ``wandb login`` and ``WANDB_MODE=offline``). Reads wandb's own
    credential sources (WANDB_API_KEY, .netrc, its settings files) without a network or a prompt;
    ValueError too when wandb is not installed."""
    try:
        from wandb.errors import AuthenticationError
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth
    except ImportError:
        raise ValueError(f"{flag} needs the wandb package: pip install 'ckpteval[wandb]'") from None
    settings = wandb_setup.singleton().settings
    if settings.mode in WANDB_LOCAL_MODES:
        return
    host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
    try:
        auth = wbauth.authenticate_session(host=host, source="ckpteval", prompt=False, verify=False,
                                           update_session=False)
    except AuthenticationError as e:  # a key of the wrong form, WANDB_API_KEY beside a token file
        raise ValueError(f"{flag}: wandb credentials unusable ({e}); fix them with `wandb login`, "
                         "or set WANDB_MODE=offline") from None
    if auth is None:
        raise ValueError(f"{flag}: {WANDB_NO_LOGIN}")


def init_wandb(
    run_dir: Path, run_id: str, config: dict[str, Any], project: str = "ckpteval", join: str = "resume",
    label: str = "trainer",
) -> Any:
    """Start (or resume, same ``run_id``) a wandb run writing under ``run_dir/wandb``.

    ``join="resume"`` (the trainer, or a service logging after training ended) resumes the run with
    that id. ``join="shared"`` lets a second process (the eval service) write into a run the trainer
    is still writing, with wandb's shared mode: this process is a non-primary writer labelled
    ``label`` and does not mark the run finished. Shared mode needs a wandb server; under
    ``WANDB_MODE=offline`` it falls back to an offline resume of the same id (synced later).
    Honours ``WANDB_MODE`` (``offline`` needs no network). Raises ``RuntimeError`` when wandb is not
    installed (``pip install 'ckpteval[wandb]'``).
    """
    if join not in WANDB_JOIN_MODES:
        raise ValueError(f"wandb join mode must be one of {WANDB_JOIN_MODES}, got {join!r}")
    try:
        import wandb
    except ImportError:
        raise RuntimeError("--wandb needs the wandb package: pip install 'ckpteval[wandb]'") from None
    kwargs: dict[str, Any] = {"resume": "allow"}
    if join == "shared" and os.environ.get("WANDB_MODE") != "offline":
        kwargs = {"settings": wandb.Settings(mode="shared", x_primary=False, x_label=label,
                                             x_update_finish_state=False)}
    try:
        return wandb.init(
            project=os.environ.get("WANDB_PROJECT", project),
            id=run_id,
            dir=str(run_dir),
            config=config,
            **kwargs,
        )
    except wandb.errors.UsageError as e:  # no login (a caller that skipped check_wandb_login)
        raise RuntimeError(f"wandb: {e}: run `wandb login`, or set WANDB_MODE=offline") from None
    except wandb.errors.CommError as e:  # the server refused the key or did not answer within init_timeout
        raise RuntimeError(f"wandb: {e}; or set WANDB_MODE=offline to log locally and `wandb sync` later") from None
