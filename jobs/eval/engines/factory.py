"""Building eval backends from the worker's ``--engine`` spec, and pooling several engines as one.

Specs (what ``--engine`` accepts):

========================  =====================================================================
``hf``                    :class:`jobs.eval.engines.hf.HFEngine` in this process on ``--device``
``http:URL``              :class:`jobs.eval.engines.http.HTTPEngine` talking to a server at ``URL``
                          (sglang's native API: ``ckpteval serve`` or a real sglang server)
``sglang``                :class:`jobs.eval.engines.sglang.SGLangEngine`: launches its own sglang server
``fn:module:Class``       a :class:`jobs.eval.engines.fn.CheckpointEvalFn` (scores whole units; not an Engine)
``auto``                  resolved on the node when the worker starts (:func:`resolve_auto`): ``sglang`` when
                          sglang is importable and the worker has GPUs (``--device cuda*`` and at least one
                          GPU in ``CUDA_VISIBLE_DEVICES``), else ``hf``. The sbatch scripts' default.
========================  =====================================================================

Settings come from ``run.json`` (never from worker flags, so every consumer of a run evaluates the same
way): ``eval.engine`` may hold one object per kind, passed as keyword arguments to that kind's
constructor, e.g. ``{"hf": {"dtype": "bfloat16", "max_batch_size": 64}, "fn": {"k": 1}}``. Keys of other
kinds are ignored; a key the constructor rejects is a ``ValueError`` naming the spec.

A run whose ``run.json`` names ``eval.base_model`` has LoRA adapter snapshots: each kind then builds
its LoRA variant (see :func:`make_engine`).

Engine modules are imported lazily, so a worker running an ``fn`` backend never imports torch.

:class:`EnginePool` makes N engines look like one :class:`~jobs.eval.engines.base.Engine`: loads go to all (in turn),
prompts are split across all (one thread each), and its ``weight_version`` is the common version only
when *every* engine reports the same one — so the worker's pin checks cover all of them.

Limits: a pool's engines must be interchangeable (same model, same sampling); a pool does not balance
load beyond an even split of each call's prompts.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from jobs.eval.engines.base import Engine, EngineError, Generation, SamplingParams
from jobs.eval.engines.fn import CheckpointEvalFn, make_fn_backend

KINDS = ("hf", "http", "sglang", "fn")


AUTO = "auto"


def resolve_auto(device: str, env: Mapping[str, str] | None = None) -> str:
    """What ``--engine auto`` means on this node: ``sglang`` when it is importable and this worker has
    GPUs allocated (``device`` is ``cuda``/``cuda:N`` and ``CUDA_VISIBLE_DEVICES``, else torch, shows at
    least one), otherwise ``hf``."""
    if not device.startswith("cuda") or importlib.util.find_spec("sglang") is None:
        return "hf"
    from jobs.eval.engines.sglang import gpu_count

    return "sglang" if gpu_count(os.environ if env is None else env) > 0 else "hf"


def resolve_specs(specs: tuple[str, ...] | list[str], device: str) -> list[str]:
    """``specs`` with every ``auto`` resolved by :func:`resolve_auto`."""
    return [resolve_auto(device) if s == AUTO else s for s in specs]


def spec_kind(spec: str) -> str:
    """The kind of an ``--engine`` spec (``hf``, ``http``, ``sglang``, ``fn`` or ``auto``); ValueError if
    unknown."""
    if spec == AUTO:
        return AUTO
    kind, _, rest = spec.partition(":")
    if kind not in KINDS:
        raise ValueError(
            f"--engine {spec!r}: unknown kind {kind!r}; expected hf, http:URL, sglang, fn:module:Class or auto"
        )
    if kind in {"http", "fn"} and not rest:
        raise ValueError(
            f"--engine {spec!r}: {kind} needs a {'URL' if kind == 'http' else 'module:Class'} after ':'"
        )
    if kind in {"hf", "sglang"} and rest:
        raise ValueError(f"--engine {spec!r}: {kind} takes no argument")
    return kind


def engine_settings(engine_section: dict[str, Any], kind: str) -> dict[str, Any]:
    """The constructor kwargs for ``kind`` from run.json's ``eval.engine`` section."""
    settings = engine_section.get(kind, {})
    if not isinstance(settings, dict):
        raise ValueError(f"run.json: field eval.engine.{kind} must be an object of constructor settings")
    return dict(settings)


def _construct(spec: str, factory: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return factory(*args, **kwargs)
    except TypeError as e:
        raise ValueError(f"--engine {spec!r}: settings {sorted(kwargs)} rejected ({e})") from None


def check_device(device: str) -> None:
    """EngineError unless ``device`` exists on this machine (``--device cuda`` on a node without CUDA
    is a broken worker: it must stop at start, not fail unit after unit); ValueError if unparsable."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"--device {device!r}: not a torch device ({e})") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (parsed.index or 0) >= count:
            raise EngineError(f"--device {device}: this machine has {count} usable CUDA device(s)")


def make_engine(
    spec: str, device: str, extra: dict[str, Any], base_model: str | None = None
) -> Engine | CheckpointEvalFn:
    """Build the backend named by ``spec``; ``extra`` are its constructor settings (see module doc).

    ``base_model`` (run.json ``eval.base_model``) makes the run's snapshots LoRA adapters on that base:
    ``hf`` becomes :class:`~jobs.eval.engines.hf_lora.HFLoRAEngine`, ``http:URL``/``sglang`` their
    LoRA-serving variants in :mod:`jobs.eval.engines.sglang_lora`; an ``fn`` backend reads it from its input.
    """
    kind = spec_kind(spec)
    rest = spec.partition(":")[2]
    if kind == "fn":
        return make_fn_backend(rest, extra)
    if base_model is not None:
        return _make_lora_engine(spec, kind, rest, device, extra, base_model)
    if kind == "hf":
        from jobs.eval.engines.hf import HFEngine

        check_device(str(extra.get("device", device)))
        return _construct(spec, HFEngine, **{"device": device, **extra})
    if kind == "http":
        from jobs.eval.engines.http import HTTPEngine

        return _construct(spec, HTTPEngine, rest, **extra)
    from jobs.eval.engines.sglang import SGLangEngine

    return _construct(spec, SGLangEngine, **{"device": device, **extra})


def _make_lora_engine(
    spec: str, kind: str, rest: str, device: str, extra: dict[str, Any], base_model: str
) -> Engine:
    if kind == "hf":
        from jobs.eval.engines.hf_lora import HFLoRAEngine

        return _construct(spec, HFLoRAEngine, **{"base_model": base_model, "device": device, **extra})
    if kind == "http":
        from jobs.eval.engines.sglang_lora import HTTPLoRAEngine

        return _construct(spec, HTTPLoRAEngine, rest, **extra)
    from jobs.eval.engines.sglang_lora import SGLangLoRAEngine

    return _construct(spec, SGLangLoRAEngine, **{"base_model": base_model, "device": device, **extra})


def _parallel(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` in threads (inline when there is one); the first engine error is re-raised."""
    if len(calls) <= 1:
        return [c() for c in calls]
    out: list[Any] = [None] * len(calls)
    errors: list[Exception] = []

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except (EngineError, RuntimeError, ValueError, OSError) as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


class EnginePool:
    """Several engines behind the :class:`~jobs.eval.engines.base.Engine` interface (see module doc)."""

    def __init__(self, engines: list[Engine]) -> None:
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = list(engines)

    def load(self, snapshot_dir: str, weight_version: str) -> None:
        """Load every engine, one after the other: transformers' model construction is not thread-safe
        (concurrent ``from_pretrained`` calls share its meta-device init state)."""
        for e in self.engines:
            e.load(snapshot_dir, weight_version)

    def weight_version(self) -> str | None:
        versions = [e.weight_version() for e in self.engines]
        if len(set(versions)) == 1:
            return versions[0]
        return "|".join(str(v) for v in versions)  # never equal to a step: the worker reloads or skips

    def generate(
        self, prompts: list[str], params: SamplingParams, seeds: list[int] | None = None
    ) -> list[Generation]:
        """Split ``prompts`` evenly and in order across the engines; outputs keep the prompts' order.

        Each prompt's seed travels with it, so a sample does not depend on which engine drew it.
        """
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        size = max(1, -(-len(prompts) // len(self.engines)))

        def call(e: Engine, lo: int, hi: int) -> Callable[[], list[Generation]]:
            if seeds is None:
                return lambda: e.generate(prompts[lo:hi], params)
            return lambda: e.generate(prompts[lo:hi], params, seeds=seeds[lo:hi])

        calls = [
            call(e, i * size, (i + 1) * size) for i, e in enumerate(self.engines) if prompts[i * size : (i + 1) * size]
        ]
        return [g for part in _parallel(calls) for g in part]

    def healthy(self) -> bool:
        return all(e.healthy() for e in self.engines)

    def restart(self) -> None:
        """Restart the engines that fail their probe (sequentially, like :meth:`load`)."""
        for e in self.engines:
            if not e.healthy():
                e.restart()

    def close(self) -> None:
        for e in self.engines:
            e.close()
