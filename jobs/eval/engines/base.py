"""The engine interface every eval backend speaks.

An engine holds one set of weights at a time, stamped with a ``weight_version`` string. The only way
weights change is :meth:`Engine.load`, which swaps weights *and* version together (a reader never sees
new weights under an old version or the reverse). Every generation carries the version that produced
it, so a worker can prove which weights a sample measured. Prompts arrive as final text (chat
templates are rendered before, by :mod:`ckpteval.jobs.eval.kinds.generate.prompts`).

Limits: an engine shared with other clients (an sglang server someone else also reloads) can change
version between two calls; the worker detects that by re-reading the version after a unit and by the
per-sample versions, it cannot prevent it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ckpteval.coord.results.engine_identity import EngineIdentity


class EngineError(RuntimeError):
    """An engine failed in a way the worker should treat as unhealthy (restart, then skip)."""

    reason = "unhealthy"  # the skip reason of a unit that ends on this error
    restart_helps = True  # whether restarting the engine is a sensible reaction


class WeightVersionMismatch(EngineError):
    """A load that succeeded but after which the engine reports another ``weight_version`` than the one
    loaded: not a dead engine (pinning's read-back decides, :func:`ckpteval.jobs.eval.proof.pinning.pin`)."""


class UnsupportedSnapshot(EngineError):
    """A snapshot in a form this engine cannot load on any node (pickled ``*.bin`` weights, a DoRA or
    non-LoRA adapter): no restart; the unit is skipped ``unsupported`` with the file and what to change."""

    reason = "unsupported"
    restart_helps = False


class ServerMisconfigured(EngineError):
    """The server, as started, cannot serve this engine (a route, flag or variable it lacks; a device it cannot
    reload on): neither a restart nor a fresh node cures it; the worker refuses the run's configuration
    (one line, exit 2, ``RUN/CONFIG_REFUSED``), never exit 4 (requeue)."""

    reason = "unsupported"
    restart_helps = False


class MissingRoute(ServerMisconfigured):
    """The server answers HTTP 404 on a route this engine needs (a server of another kind, or one without
    the feature: ``ckpteval serve`` has no LoRA routes)."""


class RequestRejected(EngineError):
    """The engine refused a request as invalid (an HTTP 4xx from sglang: a prompt longer than the
    context, a bad sampling setting): the request's fault, not a dead engine. No restart; the unit is
    skipped ``rejected`` with the engine's message."""

    reason = "rejected"
    restart_helps = False


class SamplesAborted(EngineError):
    """Samples came back aborted (sglang's ``finish_reason.type == "abort"``) and stayed aborted after
    the bounded retries. Aborted samples are never scored; the unit is skipped ``aborted``."""

    reason = "aborted"
    restart_helps = False


def context_problem(prompt_tokens: int, max_new_tokens: int | None, context: int | None) -> str | None:
    """Why a prompt of ``prompt_tokens`` asking ``max_new_tokens`` does not fit a model of ``context``
    positions, in sglang's words (``tokenizer_manager.py`` ``_validate_one_request``: no auto-truncation),
    or None when it fits. The one length rule of every engine here: ``ckpteval serve`` answers it with
    HTTP 400, the hf engine with :class:`RequestRejected` — either way the unit is skipped ``rejected``."""
    if context is None:
        return None
    if prompt_tokens >= context:
        return f"The input ({prompt_tokens} tokens) is longer than the model's context length ({context} tokens)."
    if max_new_tokens is not None and max_new_tokens + prompt_tokens > context:
        total = max_new_tokens + prompt_tokens
        return (
            f"Requested token count exceeds the model's maximum context length of {context} tokens. "
            f"You requested a total of {total} tokens: {prompt_tokens} tokens from the input messages and "
            f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens "
            "in the input messages or the completion to fit within the limit."
        )
    return None


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; ``temperature == 0`` means greedy."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k filter (sglang's convention is -1)
    seed: int | None = None
    # seconds one request to a server may take (a dataset's generate_timeout_s); None: the engine derives
    # it (http_limits.generate_timeout). Not a sampling setting: never sent; in-process engines ignore it.
    timeout_s: float | None = None


@dataclass(frozen=True)
class Generation:
    """One completion and the weight version of the engine that produced it."""

    text: str
    weight_version: str | None
    n_tokens: int
    prompt_tokens: int | None = None  # the prompt's length in tokens, when the engine reports it
    finish_reason: str | None = None  # "stop" | "length"; None when the engine does not say


@dataclass(frozen=True)
class WeightDigests:
    """What an in-process engine reports about the weights it holds (:mod:`ckpteval.jobs.eval.proof.attest`).

    ``digests``: name -> CRC-32 of the tensor's bytes cast to the snapshot's dtype
    (:mod:`ckpteval.coord.snapshots.digests`); ``aliases``: a name -> the name it shares storage with (tied weights);
    ``lossy``: names held in a dtype narrower than the snapshot's, whose digest cannot match."""

    digests: dict[str, int]
    aliases: dict[str, str] = field(default_factory=dict)
    lossy: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineChecksum:
    """sglang's ``/weights_checker`` ``checksum`` answer, reduced: ``checksum`` (its
    ``per_engine_checksum``), ``layout`` (everything the checksum depends on besides the weights:
    parallelism, roles, dtype, quantization, sglang version, the device the hash runs on —
    :func:`ckpteval.jobs.eval.engines.http.server_info.checksum_layout`): equal only between engines of the same
    layout holding the same weights; ``instance``: which server launch answered (``<url>@<startup
    time>``), so an in-place reload is never taken for an independent load."""

    checksum: str
    layout: str
    tensors: int
    instance: str = "?"


@runtime_checkable
class Engine(Protocol):
    """What the worker needs from an inference backend."""

    def load(self, snapshot_dir: str, weight_version: str) -> None:
        """Load weights from a snapshot dir and stamp ``weight_version`` atomically with the load."""

    def weight_version(self) -> str | None:
        """The version of the weights currently loaded (``None`` before the first load)."""

    def generate(
        self, prompts: list[str], params: SamplingParams, seeds: list[int] | None = None
    ) -> list[Generation]:
        """Complete every prompt; one :class:`Generation` per prompt, in order.

        ``seeds[i]`` (when given, one per prompt) is the sampling seed of ``prompts[i]`` and overrides
        ``params.seed``: identical prompts with distinct seeds draw independent samples, and the same
        prompt with the same seed draws the same sample again, whatever else is in the batch (where
        the engine honours seeds). ``None`` keeps ``params.seed`` for the whole call. Greedy decoding
        ignores seeds.
        """

    def healthy(self) -> bool:
        """A cheap probe (a one-token generate). Never raises for a dead engine: returns False."""

    def restart(self) -> None:
        """Bring a dead engine back (re-launch a server, rebuild a model); weights must be reloaded after."""

    def close(self) -> None:
        """Release every resource (processes, memory). Idempotent."""


# -- optional capabilities: what only some engines have. Code that needs one asks ``isinstance(engine, Cap)``
# (each is runtime-checkable: the check is the attribute's presence, never a call); a pool answers through
# its members (:func:`members`). Each docstring states what an engine promises by having it.
@runtime_checkable
class Pooled(Protocol):
    """Several interchangeable engines behind one (:class:`~ckpteval.jobs.eval.engines.factory.EnginePool`).
    Promises: ``engines`` are the members, each an :class:`Engine` holding the pool's weights after a load;
    a capability of the pool is asked of each member."""

    engines: list[Engine]


@runtime_checkable
class OccupiesGPUs(Protocol):
    """Promises: ``gpus`` is how many GPUs the engine holds while it lives (0: none), the count a unit's
    GPU-seconds are charged for."""

    @property
    def gpus(self) -> int: ...


@runtime_checkable
class LaunchesServer(Protocol):
    """An engine that launches its own server (sglang). Promises: a launch ends within ``launch_timeout_s``
    (None: unbounded) and ``launch_pending`` is true exactly when the next load launches first — the
    caller widens its load bound by it (:func:`launch_timeout`)."""

    @property
    def launch_timeout_s(self) -> float | None: ...

    @property
    def launch_pending(self) -> bool: ...


@runtime_checkable
class DigestsWeights(Protocol):
    """In-process attestation. Promises: ``weight_digests`` digests the tensors the engine computes with
    (not a copy of the files), each cast to the snapshot's dtype, and names the ones held narrower
    (``lossy``); a digest it cannot compute raises, it never reports a match it did not see."""

    def weight_digests(self, dtypes: dict[str, str], digest: str = "crc32") -> WeightDigests: ...


@runtime_checkable
class ChecksumsWeights(Protocol):
    """A server's consistency proof (sglang's ``/weights_checker``). Promises: ``weights_checksum`` is the
    server's own hash of the weights it holds now, with the layout it depends on and the launch that
    answered (:class:`EngineChecksum`); an engine that cannot ask raises :class:`EngineError`."""

    def weights_checksum(self) -> EngineChecksum: ...


@runtime_checkable
class TeacherForced(Protocol):
    """The canary's recomputation (:mod:`ckpteval.jobs.eval.proof.canary`). Promises: ``teacher_forced(pairs)``
    scores each ``(prompt, continuation)`` with the loaded weights and the tokenizer the engine generates
    with, one record per pair in :func:`ckpteval.jobs.eval.proof.logprobs.probe_result`'s shape; a server that
    refuses to score prompts raises :class:`RequestRejected` (the canary is then absent, not failed)."""

    def teacher_forced(self, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]: ...


@runtime_checkable
class PausesRequests(Protocol):
    """A server shared with a trainer's rollout clients (the shared posture, :func:`ckpteval.jobs.trainer.gate.shared_eval`).
    Promises: ``pause_requests()`` freezes every request the server holds or receives, aborting none, while
    loads, version stamps and checksums still run; ``resume_requests()`` lets them go on."""

    def pause_requests(self) -> None: ...

    def resume_requests(self) -> None: ...


@runtime_checkable
class ReportsComputeDtype(Protocol):
    """Promises: ``compute_dtype`` is the dtype the engine computes in (``"bfloat16"``...; None: unknown),
    which picks the canary's default bound against the trainer's dtype."""

    @property
    def compute_dtype(self) -> str | None: ...


@runtime_checkable
class NamesCanaryKind(Protocol):
    """An engine whose kernels are not in-process transformers' (every engine of sglang's HTTP API).
    Promises: ``canary_kind`` keys the canary's bound table (:func:`ckpteval.jobs.eval.proof.canary.measured_bounds`);
    an engine without it is bounded as ``hf``."""

    canary_kind: str


@runtime_checkable
class ServesHTTP(Protocol):
    """An engine that is a client of one server. Promises: ``base_url`` is where every request of the
    engine goes, fixed for its life (attestation records it as who held the weights)."""

    @property
    def base_url(self) -> str: ...


@runtime_checkable
class ServesLmEval(Protocol):
    """An engine lm-eval's ``local-completions`` adapter can address (``lm_eval`` entries). Promises:
    ``lm_eval_model(snapshot_dir)`` names the ``(model, tokenizer)`` under which the server's
    ``/v1/completions`` serves the snapshot just loaded, or raises :class:`EngineError` before any task
    runs (a LoRA adapter whose base tokenizer is not on this worker)."""

    def lm_eval_model(self, snapshot_dir: str) -> tuple[str, str]: ...


@runtime_checkable
class ReadsRunTokenizer(Protocol):
    """An in-process engine that loads the snapshot's tokenizer itself. Promises: a snapshot saved without
    tokenizer files is tokenized with the files in ``tokenizer_fallback`` (the run's, set by the worker),
    never with whatever tokenizer the engine held before."""

    tokenizer_fallback: Path | None


def members(engine: object) -> list[Any]:
    """The engines behind ``engine``: a pool's members, else ``engine`` itself."""
    return list(engine.engines) if isinstance(engine, Pooled) and engine.engines else [engine]


def gpu_count(env: Mapping[str, str] | None = None) -> int:
    """GPUs visible to a child: entries of ``CUDA_VISIBLE_DEVICES``, else what torch sees."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    import torch  # only when nothing says otherwise: keeps this module light

    return torch.cuda.device_count()


@runtime_checkable
class ReportsIdentity(Protocol):
    """What the engine is and how it runs (:class:`~ckpteval.coord.results.engine_identity.EngineIdentity`), recorded
    with every result it produced."""

    def engine_identity(self) -> EngineIdentity: ...


def engine_identity(engine: object) -> EngineIdentity | None:
    """The identity of ``engine`` (None: it does not report one). A pool of members of one identity has
    that identity; of several, kind ``pool`` with the members' keys as its version (a unit split over
    them is one identity of no single engine, never pooled with one)."""
    if isinstance(engine, Pooled) and engine.engines:
        ids = [engine_identity(e) for e in engine.engines]
        keys = sorted({"none" if m is None else m.key() for m in ids})
        return ids[0] if len(keys) == 1 else EngineIdentity("pool", version="|".join(keys))
    return engine.engine_identity() if isinstance(engine, ReportsIdentity) else None


def engine_gpus(engine: object) -> int:
    """How many GPUs an engine occupies (its ``gpus`` attribute; a pool: the sum; unknown: 0), for
    GPU-seconds in the cost of a unit."""
    if isinstance(engine, Pooled) and engine.engines:
        return sum(engine_gpus(e) for e in engine.engines)
    return int(engine.gpus or 0) if isinstance(engine, OccupiesGPUs) else 0


def launch_timeout(engine: object, pending_only: bool = False) -> float:
    """Seconds a launch of ``engine``'s server may take (its ``launch_timeout_s``: an sglang start-up takes
    minutes on a big model, far past a weight load); a pool: the sum (it loads and restarts its engines in
    turn); 0: nothing to launch. ``pending_only``: count only engines whose next load launches
    (``launch_pending``), i.e. what a first load adds to the load's own bound."""
    if isinstance(engine, Pooled) and engine.engines:
        return sum(launch_timeout(e, pending_only) for e in engine.engines)
    if not isinstance(engine, LaunchesServer) or (pending_only and not engine.launch_pending):
        return 0.0
    return float(engine.launch_timeout_s or 0.0)
