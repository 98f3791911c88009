"""The engine registry (:data:`ENGINES`): building eval backends from the worker's ``--engine`` spec, and pooling
several engines as one.

Specs are ``KIND`` or ``KIND:ARG`` (``hf``, ``http:URL``, ``sglang``, ``fn:module:Class``; :func:`normalize_spec`
takes a URL as people type it) or ``auto`` (:func:`resolve_auto`). Settings come from run.json's
``eval.engine.<kind>`` object (constructor keywords; never from worker flags); ``eval.base_model`` builds each
kind's LoRA variant (:attr:`EngineKind.lora`). Adding an engine: a module and one line in :data:`ENGINES`
(docs/USER_GUIDE.md "Dataset kinds and engines"). Engine modules are imported lazily (an ``fn`` worker never
imports torch).

:class:`EnginePool` makes N engines look like one :class:`~ckpteval.jobs.eval.engines.base.Engine`: loads go to all (in turn),
prompts are split across all (one thread each), and its ``weight_version`` is the common version only
when *every* engine reports the same one — so the worker's pin checks cover all of them.

Limits: a pool's engines must be interchangeable (same model, same sampling); a pool does not balance
load beyond an even split of each call's prompts.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckpteval.coord.registry import Registry
from ckpteval.jobs.eval.engines.base import Engine, EngineError, Generation, SamplingParams, gpu_count
from ckpteval.jobs.eval.engines.fn import CheckpointEvalFn


@dataclass(frozen=True)
class EngineKind:
    """One engine kind of the registry: how ``--engine KIND[:ARG]`` is built."""

    target: str
    """``module:Class`` (or ``module:function``) called with ``ARG`` first (if any), ``device=`` (if
    :attr:`device`), ``base_model=`` (LoRA variants that take it) and run.json's settings as keywords."""
    arg: str | None = None
    """What follows ``KIND:`` (``"URL"``, ``"module:Class"``); None: the kind takes no argument."""
    arg_optional: bool = False
    """``KIND`` alone is also a spec (``vllm`` launches, ``vllm:URL`` attaches): built without the argument."""
    device: bool = False
    """Gets the worker's ``--device`` (``device=``)."""
    check_device: bool = False
    """Runs on that device in this process: the device must exist before building."""
    lora: str | None = None
    """``module:Class`` of the variant serving LoRA-adapter snapshots on ``eval.base_model``; None: none."""
    lora_takes_base: bool = True
    """The LoRA variant gets ``base_model=`` (a server attached by URL already has its base)."""
    unit_backend: bool = False
    """Scores whole units itself (a :class:`~ckpteval.jobs.eval.engines.fn.CheckpointEvalFn`), not an Engine."""
    deterministic_mode: bool = False
    """Has a batch-invariant mode, switched by ``deterministic=``: True unless every dataset of the run opts
    out (``"deterministic": false``; run.json ``eval.engine.<kind>.deterministic`` overrides). sglang's
    ``--enable-deterministic-inference`` (:mod:`ckpteval.jobs.eval.engines.sglang.deterministic`); it also
    honours per-sample seeds only then. vLLM's ``VLLM_BATCH_INVARIANT=1`` (GPU only:
    :mod:`ckpteval.jobs.eval.engines.vllm.server`)."""


AUTO = "auto"
URL_KINDS = ("http", "vllm")  # kinds whose argument is a server URL (:func:`normalize_spec`)
ENGINES: Registry[EngineKind] = Registry(
    "an engine kind",
    ("hf", EngineKind("ckpteval.jobs.eval.engines.hf.engine:HFEngine", device=True, check_device=True,
                      lora="ckpteval.jobs.eval.engines.hf.lora:HFLoRAEngine")),
    ("http", EngineKind("ckpteval.jobs.eval.engines.http.engine:HTTPEngine", arg="URL",
                        lora="ckpteval.jobs.eval.engines.sglang.lora:HTTPLoRAEngine", lora_takes_base=False)),
    ("sglang", EngineKind("ckpteval.jobs.eval.engines.sglang.engine:SGLangEngine", device=True,
                          lora="ckpteval.jobs.eval.engines.sglang.lora:SGLangLoRAEngine", deterministic_mode=True)),
    ("vllm", EngineKind("ckpteval.jobs.eval.engines.vllm.engine:VLLMEngine", arg="URL", arg_optional=True,
                        lora="ckpteval.jobs.eval.engines.vllm.lora:VLLMLoRAEngine", deterministic_mode=True)),
    ("fn", EngineKind("ckpteval.jobs.eval.engines.fn:make_fn_backend", arg="module:Class", unit_backend=True)),
    unknown="unknown kind {name!r} ({hint}known: {known} or " + AUTO + ")",
)


def resolve_auto(device: str, env: Mapping[str, str] | None = None) -> str:
    """What ``--engine auto`` means on this node: ``sglang`` when it is importable and this worker has
    GPUs allocated (``device`` is ``cuda``/``cuda:N`` and ``CUDA_VISIBLE_DEVICES``, else torch, shows at
    least one), otherwise ``hf``."""
    if not device.startswith("cuda") or importlib.util.find_spec("sglang") is None:
        return "hf"
    return "sglang" if gpu_count(os.environ if env is None else env) > 0 else "hf"


def resolve_specs(specs: tuple[str, ...] | list[str], device: str) -> list[str]:
    """``specs`` with every ``auto`` resolved by :func:`resolve_auto`."""
    return [resolve_auto(device) if s == AUTO else s for s in specs]


def _forms() -> str:
    def form(k: str, e: EngineKind) -> str:
        return (f"{k}[:{e.arg}]" if e.arg_optional else f"{k}:{e.arg}") if e.arg else k

    return ", ".join(form(k, e) for k, e in ENGINES.items()) + f" or {AUTO}"


def normalize_spec(spec: str) -> str:
    """The canonical form of an ``--engine`` spec: ``http://HOST:PORT`` and ``https://...`` (a URL as
    people type it) become ``http:http://HOST:PORT`` / ``http:https://...``, ``http:HOST:PORT`` becomes
    ``http:http://HOST:PORT`` (``vllm:HOST:PORT`` likewise: :data:`URL_KINDS`); a URL without a host is a
    ValueError with the right form."""
    typed = spec
    if spec.startswith(("http://", "https://")):
        spec = f"http:{spec}"
    kind, _, rest = spec.partition(":")
    if kind not in URL_KINDS or not rest:
        return spec
    url = rest if rest.startswith(("http://", "https://")) else f"http://{rest.lstrip('/')}"
    parsed = urllib.parse.urlsplit(url)
    try:
        parsed.port  # noqa: B018 — raises on a port that is not a number
    except ValueError:
        parsed = parsed._replace(netloc="")
    if not parsed.hostname:
        raise ValueError(f"--engine {typed!r}: not a server URL; write {kind}:http://HOST:PORT (or https://HOST:PORT)")
    return f"{kind}:{url}"


def spec_kind(spec: str) -> str:
    """The kind of an ``--engine`` spec (a name of :data:`ENGINES` or ``auto``); ValueError if unknown."""
    if spec == AUTO:
        return AUTO
    kind, _, rest = normalize_spec(spec).partition(":")
    if kind not in ENGINES:
        raise ValueError(f"--engine {spec!r}: {ENGINES.refusal(kind, also=(AUTO,))}; expected {_forms()}")
    arg = ENGINES[kind].arg
    if arg and not rest and not ENGINES[kind].arg_optional:
        raise ValueError(f"--engine {spec!r}: {kind} needs a {arg} after ':'")
    if not arg and rest:
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
    the kind's :attr:`EngineKind.lora` variant is built (an ``fn`` backend reads it from its input).
    """
    spec = normalize_spec(spec)
    kind = ENGINES[spec_kind(spec)]
    rest = spec.partition(":")[2]
    if kind.unit_backend:
        return ENGINES.load(spec, kind.target)(rest, extra)  # type: ignore[no-any-return]
    target, kwargs = kind.target, dict(extra)
    if base_model is not None:
        if kind.lora is None:
            raise ValueError(f"--engine {spec!r}: this kind cannot serve LoRA-adapter snapshots (eval.base_model)")
        target = kind.lora
        if kind.lora_takes_base:
            kwargs = {"base_model": base_model, **kwargs}
    if kind.check_device:
        check_device(str(kwargs.get("device", device)))
    if kind.device:
        kwargs = {"device": device, **kwargs}
    return _construct(spec, ENGINES.load(spec, target), *([rest] if kind.arg and rest else []), **kwargs)  # type: ignore[no-any-return]


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
    """Several engines behind the :class:`~ckpteval.jobs.eval.engines.base.Engine` interface (see module doc)."""

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
