"""Engine identity: which engine, configured how, produced a result's completions.

The same weights do not give the same completions under every engine: a greedy sglang run at 64-way
concurrency without its deterministic mode changes about half its generations from one run to the next
(sgl-eval ``benchmarks.md``), two engines scored one checkpoint 10 points apart on AIME25 (sglang #39311).
So each result records an :class:`EngineIdentity` (``engine`` in the result file, docs/PROTOCOL.md), a
point pools only units of one identity (:func:`ckpteval.coord.results.points.derive_point`, like scorer
identities), and ``compare``/``best`` refuse to put points of two identities side by side unless told to
(:func:`differing_fields`).

:meth:`EngineIdentity.key` is the stable string of the fields that change a completion — what a
content-keyed completion store keys on. Every field does, except ``concurrency`` on an engine running
its batch-invariant mode (``deterministic``: sglang ``--enable-deterministic-inference`` swaps matmul,
log-softmax, mean and RMS-norm for batch-invariant kernels, ``srt/batch_invariant_ops/``, and pins the
attention split sizes and the all-reduce, ``srt/arg_groups/attention_hook.py``
``handle_deterministic_inference``): there a completion does not depend on its batch-mates by design.

Guarantee: equal keys for equal recorded fields, on every node and Python version (a sorted JSON
encoding, then BLAKE2b). Limits: an identity is only as exact as what the engine reports: an sglang
server reports ``"device": "cuda"``, not the GPU model, so two GPU generations under one server
configuration share a key; a field the engine does not report is ``None`` (and compares equal to
``None`` only).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

FIELDS_ORDER = ("kind", "version", "dtype", "quantization", "tp", "dp", "pp", "deterministic",
                "attention_backend", "device", "concurrency", "kv_cache_dtype", "prefill_attention_backend",
                "decode_attention_backend")
# fields added after results were recorded: left out of the key while None, so an identity that does not
# report them (hf, fn, a result written before them) keeps the key it had
LATER_FIELDS = frozenset({"kv_cache_dtype", "prefill_attention_backend", "decode_attention_backend"})
UNRECORDED = "engine"  # the field name differing_fields reports when one side recorded no identity


@dataclass(frozen=True)
class EngineIdentity:
    """What an engine was when it produced a unit's completions (the module docstring says why)."""

    kind: str
    """The engine family: ``sglang`` (a launched server, ``http:URL`` to sglang or ``ckpteval serve``),
    ``hf`` (in-process transformers), ``fn`` (a unit backend: ``fn:<module:Class>``)."""
    version: str | None = None
    """The engine's software version: sglang's ``/server_info`` ``version``; ``transformers X, torch Y``."""
    dtype: str | None = None
    """The dtype it computes in (sglang's ``--dtype`` as resolved, ``auto`` when left to the model)."""
    quantization: str | None = None
    """sglang's ``--quantization`` (None: none)."""
    tp: int = 1
    """Tensor-parallel size."""
    dp: int = 1
    """Data-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    deterministic: bool = False
    """Whether it ran its batch-invariant mode (sglang ``--enable-deterministic-inference``)."""
    attention_backend: str | None = None
    """The attention kernels (sglang ``--attention-backend`` as resolved; None: not reported)."""
    device: str | None = None
    """Where it ran, as it reports it (``cpu``, ``cuda``, ``cuda:NVIDIA H100 80GB HBM3``)."""
    concurrency: int | None = None
    """The most prompts one engine call had in flight together (the batch it ran at; None: unknown)."""
    kv_cache_dtype: str | None = None
    """The KV cache's storage dtype (sglang ``--kv-cache-dtype`` as resolved; ``auto``: the model's)."""
    prefill_attention_backend: str | None = None
    """The prefill attention kernels (sglang's split field, else ``attention_backend``)."""
    decode_attention_backend: str | None = None
    """The decode attention kernels (sglang's split field, else ``attention_backend``)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> EngineIdentity:
        """From a result's ``engine`` object; ValueError when it is not one (an unknown key is kept out)."""
        known = {f.name for f in fields(cls)}
        if not isinstance(obj, Mapping) or not isinstance(obj.get("kind"), str):
            raise ValueError(f"an engine identity needs a string 'kind', got {str(obj)[:200]}")
        return cls(**{k: v for k, v in obj.items() if k in known})

    def completion_fields(self) -> dict[str, Any]:
        """The fields that change a completion: all, less ``concurrency`` in deterministic mode (and
        :data:`LATER_FIELDS` not reported)."""
        out = {name: getattr(self, name) for name in FIELDS_ORDER
               if name not in LATER_FIELDS or getattr(self, name) is not None}
        if self.deterministic:
            out.pop("concurrency")
        return out

    def key(self) -> str:
        """A stable string of :meth:`completion_fields`: ``<kind>-<16 hex of BLAKE2b>``."""
        text = json.dumps(self.completion_fields(), sort_keys=True, separators=(",", ":"))
        return f"{self.kind}-{hashlib.blake2b(text.encode(), digest_size=8).hexdigest()}"


def parse_identity(obj: Any) -> EngineIdentity | None:
    """A result's ``engine`` object as an identity; None when it recorded none (``{}``/absent)."""
    return EngineIdentity.from_json(obj) if obj else None


def differing_fields(a: EngineIdentity | None, b: EngineIdentity | None) -> list[str]:
    """The completion-changing fields in which two identities differ ([] when their keys are equal). One
    side unrecorded (None), the other recorded: ``["engine"]``; both unrecorded: [] (nothing to tell apart)."""
    if a is None or b is None:
        return [] if a is b else [UNRECORDED]
    if a.key() == b.key():
        return []
    fa, fb = a.completion_fields(), b.completion_fields()
    both = [name for name in FIELDS_ORDER if (name in fa and name in fb) or name in LATER_FIELDS]
    return [name for name in both if fa.get(name) != fb.get(name)]


def explain(fields_: list[str], a: EngineIdentity | None, b: EngineIdentity | None) -> str:
    """``tp 1 vs 2, deterministic False vs True`` for the fields :func:`differing_fields` named."""
    if fields_ == [UNRECORDED]:
        return "engine identity recorded on one side only"
    return ", ".join(f"{f} {getattr(a, f)} vs {getattr(b, f)}" for f in fields_)


__all__ = ["EngineIdentity", "differing_fields", "explain", "parse_identity"]
