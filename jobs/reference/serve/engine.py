"""The engine service behind ``ckpteval serve``: generation, aborts, pause, weight versions and spans.

Owns what the HTTP handlers of ``ckpteval.jobs.reference.serve.main`` call: the :class:`~ckpteval.jobs.eval.engines.hf.engine.HFEngine`,
the served label and model path, the requests in flight, and the pause gate. Promises, as sglang 0.5.23
behaves: length checks against the model's context (``tokenizer_manager.py``), the scheduler's
``max_new_tokens`` cap, seeds applied only in deterministic mode (unseeded: 42), aborts by exact rid
(then by prefix in the scheduler),
``weight_versions`` spans, the label and model path changing only on a successful load, and
``--max-queued-requests`` counted in *prompts*: sglang queues a batch's items one by one and sheds
each item past the limit (``scheduler.py`` ``_abort_on_queued_limit``), and one shed item fails the whole
request (``tokenizer_manager.py`` ``_collect_batch_responses`` gathers every item), so a request whose
prompts, added to those already waiting, exceed the limit is shed with :class:`Overloaded` (HTTP 503
"The request queue is full.") — even on an idle engine, as sglang's items all enter the waiting queue
before the scheduler picks a batch. The stand-in's queue is the prompts waiting for its engine lock.
Two more 503s of 0.5.23: ``SGLANG_REQ_RUNNING_TIMEOUT`` (read from the environment as sglang does,
``srt/environ.py``; ``scheduler.py`` ``_poll_timeout_aborts``): a batch whose engine call ran longer
answers "Request running timeout reached."; ``--max-total-tokens``: a batch whose prompts plus
``max_new_tokens`` exceed it answers "Retracted under decode memory pressure without a KV backup. Retry
later." (``schedule_batch.py`` ``retract_decode``; the stand-in has no KV pool, so it decides up front).
``return_logprob`` reports input ids ``>= vocab_size - 1`` as 0 (``srt/managers/scheduler_components/
logprob_result_processor.py`` ``_process_input_token_logprobs``) and, with ``logprob_offset`` (a
stand-in knob, no sglang flag), adds that much to every log-prob, so a canary sees a set difference
from the trainer's instead of 0 by construction.

Limits (stand-in, not sglang): one engine lock serializes generation and loads, so weights never change
under a running generation and a relabel during one is attributed to its last token; an abort of a
running request takes effect when its batch finishes (the output is kept, marked aborted).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ckpteval.jobs.eval.engines.base import EngineError, SamplingParams, context_problem
from ckpteval.jobs.eval.engines.sglang.deterministic import Resolved, resolve
from ckpteval.jobs.eval.proof.logprobs import token_logprobs  # torch-free at import time
from ckpteval.jobs.reference.serve.info import weights_checker
from ckpteval.jobs.reference.serve.requests import GenerateRequest, Refused

if TYPE_CHECKING:
    from ckpteval.jobs.eval.engines.hf.decode import Completion
    from ckpteval.jobs.eval.engines.hf.engine import HFEngine

DEFAULT_WEIGHT_VERSION = "default"  # sglang's ServerArgs.weight_version default
DETERMINISTIC_DEFAULT_SEED = 42  # sampling_batch_info.py: the seed of unseeded requests in deterministic mode


def health_check_timeout() -> float:
    """sglang's ``HEALTH_CHECK_TIMEOUT`` (``SGLANG_HEALTH_CHECK_TIMEOUT``, default 20 s)."""
    return float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))


RUNNING_TIMEOUT_ENV = "SGLANG_REQ_RUNNING_TIMEOUT"  # srt/environ.py (seconds; <= 0: off)
QUEUE_FULL = "The request queue is full."  # scheduler.py _abort_on_queued_limit
RUNNING_TIMEOUT = "Request running timeout reached."  # scheduler.py _poll_timeout_aborts
RETRACTED = "Retracted under decode memory pressure without a KV backup. Retry later."  # schedule_batch.py


def running_timeout() -> float:
    """sglang's ``SGLANG_REQ_RUNNING_TIMEOUT`` (0: no bound)."""
    return float(os.environ.get(RUNNING_TIMEOUT_ENV, "0") or 0)


class Overloaded(RuntimeError):
    """The server sheds the request (sglang: an abort with status 503 and this message)."""


@dataclass
class Live:
    """A request the server holds (registered after the pause gate, as sglang's ``rid_to_state``)."""

    aborted: bool = False


@dataclass
class Row:
    """One prompt of a request on its way through the engine."""

    index: int
    rid: str
    ids: list[int]
    params: SamplingParams
    completion: Completion | None = None
    label_before: str = ""
    aborted: str | None = None  # the abort message
    logprob_start: int | None = None  # return_logprob: logprob_start_len resolved (None: not asked)
    logprobs: dict[str, Any] | None = None  # the meta_info fields return_logprob adds


class EngineService:
    """What the HTTP handlers call; owns the engine, the served label and path, live requests, pause."""

    def __init__(
        self, engine: HFEngine, model_path: str, deterministic: bool = False, label: str | None = None,
        max_queued: int | None = None, *, max_running: int = 256, max_total_tokens: int | None = None,
        logprob_offset: float = 0.0, resolved: Resolved | None = None,
    ) -> None:
        self.engine = engine
        self.resolved = resolved or resolve(deterministic, None)  # server args the deterministic mode decides
        self.model_path = self.launch_model_path = model_path
        self.deterministic = deterministic
        self.label = label if label is not None else engine.weight_version() or DEFAULT_WEIGHT_VERSION
        # sglang tokenizes with the tokenizer it was launched with, whatever update_weights_from_disk loads
        # later (tokenizer_manager.py: built once in init_tokenizer_and_processor)
        self.launch_tokenizer = engine.tokenizer
        self.launch_label = self.label
        self.launch_dtype = engine.compute_dtype  # server args, as sglang reports them on /server_info
        self.startup_time = time.time()  # /server_info "startup_time": tells one launch from the next
        self.lock = threading.Lock()  # the engine: generation and loads
        self.tokenizer_lock = threading.Lock()  # HF fast tokenizers refuse concurrent use ("Already borrowed")
        self.state = threading.Condition()  # live requests, pause, generation count
        self.live: dict[str, Live] = {}
        self.paused = False
        self.generating = 0
        self.max_queued, self.waiting, self.shed = max_queued, 0, 0  # --max-queued-requests; queued prompts; 503s
        self.max_running, self.max_total_tokens = max_running, max_total_tokens
        self.logprob_offset = logprob_offset

    # ---------------------------------------------------------------- generation
    def context_length(self) -> int:
        model = self.engine.model
        return int(getattr(model.config, "max_position_embeddings", 1 << 30)) if model is not None else 1 << 30

    def tokenize(self, req: GenerateRequest) -> list[list[int]]:
        if req.input_ids is not None:
            return req.input_ids
        tokenizer = self.launch_tokenizer or self.engine.tokenizer
        if tokenizer is None:
            raise EngineError("no model loaded")
        with self.tokenizer_lock:
            return tokenizer(req.texts)["input_ids"]

    def check_lengths(self, rows: list[list[int]], req: GenerateRequest) -> None:
        """tokenizer_manager.py ``_validate_one_request`` (no auto-truncation)."""
        context = self.context_length()
        for ids, sampling in zip(rows, req.sampling, strict=True):
            if (problem := context_problem(len(ids), sampling.max_new_tokens, context)) is not None:
                raise Refused(problem)
        vocab = getattr(getattr(self.engine.model, "config", None), "vocab_size", None)
        if vocab is not None and any(not 0 <= t < vocab for ids in rows for t in ids):
            raise Refused(f"ckpteval serve: input_ids must be in [0, {vocab})")

    def generate(self, req: GenerateRequest) -> list[dict[str, Any]]:
        start = time.perf_counter()
        ids = self.tokenize(req)
        self.check_lengths(ids, req)
        context = self.context_length()
        rows = [
            Row(i, rid, row, self._effective(s.params, len(row), context), logprob_start=_logprob_start(req, i, row))
            for i, (rid, row, s) in enumerate(zip(req.rids, ids, req.sampling, strict=True))
        ]
        top_k = req.logprobs.top_k if req.logprobs is not None else 0
        with self.state:
            while self.paused:  # tokenizer_manager.py: new requests wait on is_pause before registering
                self.state.wait()
            self._enqueue(len(rows))
            for row in rows:
                self.live[row.rid] = Live()
        try:
            with self._dequeued(len(rows)):
                with self.state:
                    self.generating += 1
                try:
                    for group in self._groups(rows):
                        self._run(group, top_k)
                finally:
                    with self.state:
                        self.generating -= 1
        finally:
            with self.state:
                for row in rows:
                    self.live.pop(row.rid, None)
                self.state.notify_all()
        latency = time.perf_counter() - start
        return [self._item(row, latency) for row in rows]

    def _enqueue(self, prompts: int) -> None:
        """Queue ``prompts`` for the engine, or shed the request when they do not all fit (the caller holds
        ``state``)."""
        if self.max_queued is not None and self.waiting + prompts > self.max_queued:
            self.shed += 1
            raise Overloaded(QUEUE_FULL)
        self.waiting += prompts

    @contextlib.contextmanager
    def _dequeued(self, prompts: int) -> Iterator[None]:
        """Hold the engine, having left the queue."""
        try:
            self.lock.acquire()
        finally:
            with self.state:
                self.waiting -= prompts
        try:
            yield
        finally:
            self.lock.release()

    def _effective(self, params: SamplingParams, prompt_len: int, context: int) -> SamplingParams:
        """scheduler.py ``init_req_max_new_tokens``: at most context - 1 - prompt - 1 new tokens; seeds
        apply in deterministic mode only (sampling_batch_info.py), unseeded ones then use 42."""
        budget = max(0, min(params.max_new_tokens, context - prompt_len - 2))
        seed = None
        if self.deterministic and params.temperature > 0:
            seed = params.seed if params.seed is not None else DETERMINISTIC_DEFAULT_SEED
        return replace(params, max_new_tokens=budget, seed=seed)

    def _groups(self, rows: list[Row]) -> list[list[Row]]:
        """Rows that can share one engine call. In deterministic mode every row runs alone, once per
        distinct prompt and settings (seed included), so its completion depends on those only, never on its
        batch-mates (sglang's batch-invariant kernels; greedy too)."""
        groups: dict[Any, list[Row]] = {}
        for row in rows:
            key = (row.params, tuple(row.ids)) if self.deterministic else (row.params,)
            groups.setdefault(key, []).append(row)
        return list(groups.values())

    def _run(self, group: list[Row], top_k: int = 0) -> None:
        with self.state:
            for row in group:
                if self.live[row.rid].aborted:  # aborted before it ran: tokenizer_manager _handle_abort_req
                    row.aborted = "Abort in waiting queue"
            todo = [r for r in group if r.aborted is None]
            label = self.label
        if not todo:
            return
        params = todo[0].params
        if self.max_total_tokens is not None and sum(len(r.ids) + r.params.max_new_tokens for r in todo) > \
                self.max_total_tokens:
            raise Overloaded(RETRACTED)
        started = time.monotonic()
        if params.max_new_tokens == 0:  # prefill only: nothing generated (schedule_batch.py FINISH_LENGTH)
            from ckpteval.jobs.eval.engines.hf.decode import (
                Completion,  # at run time: importing this module stays torch-free
            )

            done = [Completion("", [], {"type": "length", "length": 0}, len(r.ids), label) for r in todo]
            self._score([r for r in todo if r.logprob_start is not None], top_k)
        elif self.deterministic:  # one distinct prompt (_groups): generated once, alone
            once = self.engine.generate_ids([todo[0].ids], params)[0]
            done = [once] * len(todo)
        else:
            done = self.engine.generate_ids([r.ids for r in todo], params)
        if 0 < running_timeout() < time.monotonic() - started:
            raise Overloaded(RUNNING_TIMEOUT)
        with self.state:
            for row, completion in zip(todo, done, strict=True):
                row.completion, row.label_before = completion, label
                if self.live[row.rid].aborted:  # aborted while running: FINISH_ABORT with the output so far
                    row.aborted = "Aborted"

    def _item(self, row: Row, latency: float) -> dict[str, Any]:
        c = row.completion
        output_ids = [] if c is None else c.output_ids
        label = self.label
        spans = self._spans(row.label_before or label, label, len(output_ids))
        meta: dict[str, Any] = {"id": row.rid}
        if row.aborted is not None:
            meta |= {
                "finish_reason": {"type": "abort", "message": row.aborted, "status_code": None, "err_type": None},
                "weight_version": spans[-1]["version"],
                "e2e_latency": latency,
                "completion_tokens": len(output_ids),
                "weight_versions": spans,
            }
        else:
            meta |= {
                "finish_reason": c.finish_reason,
                "prompt_tokens": c.prompt_tokens,
                "weight_version": spans[-1]["version"],
                "num_retractions": 0,
                "completion_tokens": len(output_ids),
                "cached_tokens": 0,
                "e2e_latency": latency,
                "weight_versions": spans,
            }
        return {"text": "" if c is None else c.text, "output_ids": output_ids, "meta_info": meta | (row.logprobs or {})}

    def _score(self, rows: list[Row], top_k: int) -> None:
        """``return_logprob`` of prefill-only rows, as sglang fills ``meta_info``: ``input_token_logprobs``
        one ``[logprob, id, null]`` per prompt token from ``logprob_start_len``, the first one's logprob
        null (logprob_result_processor.py ``_process_input_token_logprobs``: ``[None] + logprobs[:-1]``);
        with ``top_logprobs_num`` the ``input_top_logprobs`` alike (entry 0 null); empty output lists
        (tokenizer_manager.py ``add_logprob_to_meta_info``). Log-softmax of the raw logits, plus
        ``logprob_offset``; ids ``>= vocab_size - 1`` reported as 0 (``_process_input_token_logprobs``'s clip,
        meant for image-token hashes: the log-prob is still the real token's)."""
        if not rows:
            return
        vocab = int(getattr(getattr(self.engine.model, "config", None), "vocab_size", 1 << 62))
        off = self.logprob_offset
        with self.engine.held() as (model, _):
            scored = token_logprobs(model, [r.ids for r in rows], top_k)
        for row, (lps, tops) in zip(rows, scored, strict=True):
            at = range(row.logprob_start, len(row.ids))
            meta: dict[str, Any] = {
                "input_token_logprobs": [[None if i == row.logprob_start else lps[i] + off,
                                          row.ids[i] if row.ids[i] < vocab - 1 else 0, None] for i in at],
                "output_token_logprobs": [], "output_token_logprobs_length": 0,
            }
            if top_k > 0:
                meta["input_top_logprobs"] = [
                    None if i == row.logprob_start else [[v + off, t, None] for v, t in tops[i]] for i in at]
                meta["output_top_logprobs"] = []
            row.logprobs = meta

    @staticmethod
    def _spans(before: str, after: str, n: int) -> list[dict[str, Any]]:
        """weight_versions.py spans; a relabel during the run is attributed to the last token."""
        if before == after or n < 2:
            return [{"version": after, "start": 0, "end": n}]
        return [{"version": before, "start": 0, "end": n - 1}, {"version": after, "start": n - 1, "end": n}]

    def check_weights(self, action: str) -> dict[str, Any]:
        """``/weights_checker`` (:func:`~ckpteval.jobs.reference.serve.info.weights_checker`), under the engine lock."""
        with self.lock:
            return weights_checker(self.engine.model, action)

    # ---------------------------------------------------------------- control
    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """sglang's two steps: ``tokenizer_manager.py`` ``abort_request`` drops an empty rid, and an rid no
        live request carries *exactly* (one tokenizer worker, the default); a forwarded rid aborts, in
        ``scheduler.py`` ``abort_request``, every live request whose rid *starts with* it (``job_1`` also
        aborts ``job_10``). A batch's prefix rid (``job`` for ``job_0``..) is no live rid: nothing."""
        if not abort_all and not rid:
            return
        with self.state:
            if not abort_all and rid not in self.live:
                return
            for live_rid, live in self.live.items():
                if abort_all or live_rid.startswith(rid):
                    live.aborted = True

    def pause(self, mode: str) -> None:
        """tokenizer_manager.py ``pause_generation``: abort mode aborts everything in flight until none is."""
        with self.state:
            self.paused = True
            if mode != "abort":
                return
            while self.live:
                for live in self.live.values():
                    live.aborted = True
                self.state.wait(1.0)

    def resume(self) -> None:
        with self.state:
            self.paused = False
            self.state.notify_all()

    def relabel(self, version: str, abort_all: bool) -> None:
        if abort_all:
            self.abort(abort_all=True)
        with self.state:
            self.label = version

    def update(self, path: str, version: str | None, abort_all: bool) -> tuple[bool, str]:
        if abort_all:
            self.abort(abort_all=True)
        with self.lock:
            try:
                self.engine.load(path, version if version is not None else self.label)
            except (EngineError, ValueError, OSError) as e:
                return False, f"Failed to update weights: {e}."  # label and model_path stay (sglang)
            with self.state:
                self.model_path = path
                if version is not None:
                    self.label = version
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return True, message

    # ---------------------------------------------------------------- health
    def healthy(self) -> bool:
        """http_server.py ``health_generate``: 200 once any output arrives within the health budget."""
        deadline = time.monotonic() + health_check_timeout()
        with self.state:
            if self.generating:  # busy: its output is the answer
                return True
            while self.paused:
                if not self.state.wait(max(0.0, deadline - time.monotonic())):
                    return False
        if not self.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        try:
            return self.engine.healthy()
        finally:
            self.lock.release()


def _logprob_start(req: GenerateRequest, index: int, ids: list[int]) -> int | None:
    """scheduler.py: ``logprob_start_len`` -1 means the end of the prompt; past it is refused."""
    if req.logprobs is None:
        return None
    start = req.logprobs.start[index]
    if start > len(ids):
        raise Refused(f"req.logprob_start_len={start} is higher than the number of input tokens "
                      f"len(req.origin_input_ids)={len(ids)}. Please use a smaller logprob_start_len.")
    return len(ids) if start == -1 else start
