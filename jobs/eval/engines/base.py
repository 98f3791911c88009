"""The engine interface every eval backend speaks.

An engine holds one set of weights at a time, stamped with a ``weight_version`` string. The only way
weights change is :meth:`Engine.load`, which swaps weights *and* version together (a reader never sees
new weights under an old version or the reverse). Every generation carries the version that produced
it, so a worker can prove which weights a sample measured. Prompts arrive as final text (chat
templates are rendered before, by :mod:`ckpteval.jobs.eval.prompts`).

Limits: an engine shared with other clients (an sglang server someone else also reloads) can change
version between two calls; the worker detects that by re-reading the version after a unit and by the
per-sample versions, it cannot prevent it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class EngineError(RuntimeError):
    """An engine failed in a way the worker should treat as unhealthy (restart, then skip)."""

    reason = "unhealthy"  # the skip reason of a unit that ends on this error
    restart_helps = True  # whether restarting the engine is a sensible reaction


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
    """What an in-process engine reports about the weights it holds (:mod:`ckpteval.jobs.eval.attest`).

    ``digests``: name -> CRC-32 of the tensor's bytes cast to the snapshot's dtype
    (:mod:`ckpteval.coord.digests`); ``aliases``: a name -> the name it shares storage with (tied weights);
    ``lossy``: names held in a dtype narrower than the snapshot's, whose digest cannot match."""

    digests: dict[str, int]
    aliases: dict[str, str] = field(default_factory=dict)
    lossy: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineChecksum:
    """sglang's ``/weights_checker`` ``checksum`` answer, reduced: ``checksum`` (its
    ``per_engine_checksum``), ``layout`` (everything the checksum depends on besides the weights:
    parallelism, roles, dtype, quantization, sglang version, the device the hash runs on —
    :func:`ckpteval.jobs.eval.engines.http.checksum_layout`): equal only between engines of the same
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
# (each is runtime-checkable: the check is the attribute's presence); a pool answers through its members.
@runtime_checkable
class Pooled(Protocol):
    """Several interchangeable engines behind one (:class:`~ckpteval.jobs.eval.engines.factory.EnginePool`)."""

    engines: list[Engine]


@runtime_checkable
class OccupiesGPUs(Protocol):
    """GPUs the engine holds (cost accounting: GPU-seconds of a unit)."""

    @property
    def gpus(self) -> int: ...


@runtime_checkable
class LaunchesServer(Protocol):
    """An engine that launches its own server (sglang): how long a launch may take, and whether the next
    load launches."""

    @property
    def launch_timeout_s(self) -> float | None: ...

    @property
    def launch_pending(self) -> bool: ...


@runtime_checkable
class DigestsWeights(Protocol):
    """Per-tensor digests of the loaded weights, in each tensor's stored dtype (in-process attestation)."""

    def weight_digests(self, dtypes: dict[str, str], digest: str = "crc32") -> WeightDigests: ...


@runtime_checkable
class ChecksumsWeights(Protocol):
    """The server's own checksum of its loaded weights (sglang's consistency proof)."""

    def weights_checksum(self) -> EngineChecksum: ...


@runtime_checkable
class TeacherForced(Protocol):
    """Log-probs of given completions under the loaded weights (the canary's comparison)."""

    def teacher_forced(self, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]: ...


@runtime_checkable
class ReportsComputeDtype(Protocol):
    """The dtype the engine computes in (the canary's bound depends on it)."""

    @property
    def compute_dtype(self) -> str | None: ...


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
