"""What an sglang server says about itself, for :class:`~ckpteval.jobs.eval.engines.http.engine.HTTPEngine`: GPUs, identity, checksum layout.

Owns the readings of ``/server_info`` (0.5.19 .. 0.5.23; file names inside the sglang wheel) and of
``/weights_checker``'s per-rank ``parallelism_info``: :func:`server_gpus` (GPUs the server holds),
:func:`server_identity` (the :class:`~ckpteval.coord.results.engine_identity.EngineIdentity` its completions
depend on) and :func:`checksum_layout` (everything a weights checksum depends on besides the weights).
Each is a pure function of the JSON the engine fetched; a field a server omits reads as unknown
(``?``, 0 GPUs, size 1), never as an error.

Limits: the values are what the server reports; a server that lies about its flags is not detected here.
"""

from __future__ import annotations

from typing import Any

from ckpteval.coord.results.engine_identity import EngineIdentity
from ckpteval.jobs.eval.engines.http.limits import queue_chunk, running_at_once


def checksum_layout(ranks: list[Any], info: dict[str, Any] | None = None) -> str:
    """Everything a ``/weights_checker`` checksum depends on besides the weights, as one key:
    ``tp<T>-dp<D>-pp<P>-ranks<N>-roles<r1+r2>-<dtype>-q<quantization>-sglang<version>-on<device>``.

    Parallelism from the ranks' ``parallelism_info``: one object per rank in sglang 0.5.19
    (``srt/managers/io_struct.py`` ``ChecksumInfo.parallelism_info: ParallelismInfo``, no role: the
    target), a list of one object per role in 0.5.23 (``List[ParallelismInfo]`` with ``role``; draft
    checksums merged in under a role prefix, ``srt/managers/scheduler_components/weight_updater.py``
    ``_merge_checksum_payloads``). The rest from ``/server_info`` (``info``; ``?`` when absent): ``dtype``
    and ``quantization`` change the tensors held, the version changes what is hashed (0.5.23 skips
    non-persistent buffers such as ``cos_cache``, 0.5.19 does not: ``srt/utils/weight_checker.py``
    ``_compute_checksum``), and ``device`` where the hash runs (``srt/managers/mm_utils.py``
    ``tensor_hash``: a triton kernel for CUDA tensors, SHA-256 of the bytes on the CPU)."""
    infos = [i for r in ranks if isinstance(r, dict) for i in _rank_infos(r.get("parallelism_info"))]
    target = next((i for i in infos if i.get("role", "target") == "target"), infos[0] if infos else {})
    roles = "+".join(sorted({str(i.get("role", "target")) for i in infos}))
    info = info or {}
    return (f"tp{target.get('tp_size', '?')}-dp{target.get('dp_size', '?')}-pp{target.get('pp_size', '?')}"
            f"-ranks{len(ranks)}-roles{roles or '?'}-{info.get('dtype') or '?'}-q{info.get('quantization') or 'none'}"
            f"-sglang{info.get('version') or '?'}-on{info.get('device') or '?'}")


def _rank_infos(value: Any) -> list[dict[str, Any]]:
    """A rank's ``parallelism_info``: one object (0.5.19) or a list of them (0.5.23)."""
    items = value if isinstance(value, list) else [value]
    return [i for i in items if isinstance(i, dict)]


def server_gpus(info: dict[str, Any]) -> int:
    """GPUs a server holds from its server args: ``tp_size * pp_size * dp_size``, where DP attention's
    ``dp_size`` splits the TP group instead of replicating it (``srt/runtime_context.py``
    ``derive_attn_tp_size``: attention TP is ``tp_size // attn_dp_size``), so then ``tp_size * pp_size``. 0 when ``tp_size`` is missing."""
    tp, dp, pp = info.get("tp_size"), info.get("dp_size") or 1, info.get("pp_size") or 1
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (tp, dp, pp)):
        return 0
    return tp * pp * (1 if info.get("enable_dp_attention") else dp)


def resolved_args(info: dict[str, Any]) -> dict[str, Any]:
    """The server args in effect: ``/server_info``'s top level (0.5.23 ``srt/utils/common.py``
    ``build_server_info``: ``ServerArgs.resolved_dict()``, the startup resolution) overlaid with what every
    scheduler's ``internal_states`` entry agrees on (``scheduler_components/internal_state.py``
    ``get_internal_state``: ``RuntimeContext.resolved_server_args_dict()``, the same plus post-publish
    overrides, e.g. ``dtype: float16`` from ``load_model_utils.py`` ``maybe_downgrade_dtype_for_legacy_gpu``
    on a GPU below SM80). A key the states disagree on keeps the top-level value."""
    states = [s for s in info.get("internal_states") or [] if isinstance(s, dict)] \
        if isinstance(info.get("internal_states"), list) else []
    out = dict(info)
    for name in set().union(*states) if states else ():
        values = [s.get(name) for s in states]
        if all(v == values[0] for v in values) and values[0] is not None:
            out[name] = values[0]
    return out


def server_identity(info: dict[str, Any], max_batch_size: int) -> EngineIdentity:
    """The :class:`~ckpteval.coord.results.engine_identity.EngineIdentity` of an sglang server from its ``/server_info``
    read through :func:`resolved_args` (so ``attention_backend`` is what ``--enable-deterministic-inference``
    picked, ``srt/arg_groups/overrides.py`` ``_deterministic_attention_backend``, and ``dtype`` what the
    scheduler runs at); the prefill and decode backends are the split fields, else ``attention_backend``
    (``arg_groups/model_override_base.py`` ``attention_backends_of``). ``deterministic`` only when the mode
    is on and LoRA is not (the mode does not cover LoRA kernels). ``concurrency``: prompts per ``/generate``
    this client sends (:func:`~ckpteval.jobs.eval.engines.http.limits.queue_chunk`), at most what the server
    runs at once. Limits: sglang reports ``dtype: auto`` (the model's own, fp32 served as fp16) unless a
    resolution or override named one; it is recorded so."""
    args = resolved_args(info)

    def size(name: str) -> int:
        value = args.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1

    def text(*names: str) -> str | None:
        value = next((args[n] for n in names if args.get(n) is not None), None)
        return None if value is None else str(value)

    chunk = queue_chunk(max_batch_size, info)
    running = running_at_once(info)
    return EngineIdentity(
        "sglang", version=text("version"), dtype=text("dtype"), quantization=text("quantization"),
        tp=size("tp_size"), dp=size("dp_size"), pp=size("pp_size"),
        # LoRA kernels are outside the mode (srt/lora/backend/): a LoRA completion still depends on its batch
        deterministic=args.get("enable_deterministic_inference") is True and args.get("enable_lora") is not True,
        attention_backend=text("attention_backend"), device=text("device"),
        concurrency=chunk if running is None else min(chunk, running),
        kv_cache_dtype=text("kv_cache_dtype"),
        prefill_attention_backend=text("prefill_attention_backend", "attention_backend"),
        decode_attention_backend=text("decode_attention_backend", "attention_backend"),
    )
