"""LoRA snapshots on sglang: each adapter snapshot loaded by name over ``/load_lora_adapter`` on a fixed base.

Owns the adapter names (:func:`adapter_name`, ``step-<step>-<crc32 of the path>``: one name per snapshot),
the launch flags a dynamic-LoRA server needs (:func:`lora_launch_flags`), the load/read-back/unload cycle
and the version stamp (the adapter's step while ``/v1/models`` lists its name with its path, else
``"<label>+<version>"``, which fails the pin check). Refused, one line (:class:`UnservableAdapter`, skip
``rejected``): target modules sglang cannot serve, ``dp_size > 1``. Limits: another client reusing our name
for other weights between our requests is not detected. See docs/USER_GUIDE.md "LoRA runs".
"""

from __future__ import annotations

import dataclasses
import json
import sys
import zlib
from pathlib import Path
from typing import Any

from ckpteval.coord.snapshots.snapshot import ADAPTER_CONFIG
from ckpteval.jobs.eval.engines.base import EngineError, Generation, RequestRejected
from ckpteval.jobs.eval.engines.http.engine import HTTPEngine
from ckpteval.jobs.eval.engines.http.limits import check_route, error_message, reply_object
from ckpteval.jobs.eval.engines.sglang.engine import SGLangEngine

BASE_LABEL = "base"  # the base model's weight_version on a LoRA server this engine launches
MAX_LOADED_LORAS = 8  # sglang's --max-loras-per-batch default: the least --max-loaded-loras may be
# sglang/srt/utils/common.py SUPPORTED_LORA_TARGET_MODULES (0.5.23): --lora-target-modules' choices, with "all"
SGLANG_LORA_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "wq_b",
    "wk", "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj", "embed_tokens",
    "lm_head", "qkvr", "wo_ud",
)  # fmt: skip
NO_LORA = ("it cannot serve LoRA adapters: attach an sglang server launched with --enable-lora (ckpteval serve has "
           "no LoRA routes), or use --engine sglang or hf")
PENDING_UNLOAD = "has an incomplete unload"  # tokenizer_control_mixin.py load_lora_adapter
DUPLICATE_LOAD = ("already loaded", "already exists")  # lora_manager.py / lora_registry.py, a name taken
NEVER_LOADED = "has never been loaded"  # tokenizer_manager.py _resolve_lora_path: a server that restarted


class UnservableAdapter(RequestRejected):
    """The adapter cannot be served by sglang's LoRA (a target module sglang does not support): refused
    before any launch; the unit is skipped ``rejected`` with the reason (no restart)."""


def adapter_name(step_version: str, path: str) -> str:
    """The adapter name for a snapshot: carries the step, unique per snapshot path."""
    return f"step-{step_version}-{zlib.crc32(str(Path(path)).encode()):08x}"


def target_modules(modules: object, where: str) -> list[str]:
    """sglang's ``--lora-target-modules`` values for a PEFT ``target_modules`` (module docstring);
    :class:`UnservableAdapter` naming ``where`` for what sglang would refuse."""
    if isinstance(modules, str):
        if modules in ("all-linear", "all"):
            return ["all"]
        raise UnservableAdapter(f"{where}: target_modules {modules!r} is not a module list; sglang takes a list "
                                "or 'all-linear' (a regex is not supported)")
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) for m in modules):
        raise UnservableAdapter(f"{where}: target_modules must be a non-empty list of module names, got {modules!r}")
    names = sorted({m.rsplit(".", 1)[-1] for m in modules})
    unknown = [m for m in names if m not in SGLANG_LORA_MODULES]
    if unknown:
        raise UnservableAdapter(f"{where}: sglang cannot serve LoRA on {unknown} (--lora-target-modules takes "
                                f"{', '.join(SGLANG_LORA_MODULES)} or all)")
    return names


def lora_launch_flags(adapter_dir: str, extra_args: tuple[str, ...] = ()) -> list[str]:
    """``--enable-lora --max-lora-rank R --lora-target-modules M... --max-loaded-loras K`` from an adapter's
    config (``K``: :data:`MAX_LOADED_LORAS`, or ``--max-loras-per-batch`` from ``extra_args`` if larger;
    none when ``extra_args`` set it)."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
        rank, modules = int(config["r"]), config["target_modules"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EngineError(f"cannot size sglang's LoRA pool from {path}: {e}") from e
    flags = ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *target_modules(modules, str(path))]
    if "--max-loaded-loras" not in extra_args:
        per_batch = _flag_value(extra_args, "--max-loras-per-batch")
        floor = int(per_batch) if per_batch is not None and per_batch.isdigit() else 0
        flags += ["--max-loaded-loras", str(max(MAX_LOADED_LORAS, floor))]
    return flags


def _flag_value(args: tuple[str, ...], flag: str) -> str | None:
    """The value following ``flag`` in a command line, if given."""
    return args[args.index(flag) + 1] if flag in args[:-1] else None


class _LoRAClient:
    """The LoRA half shared by the attached and the launching engine (mixed into an HTTPEngine)."""

    _adapter: tuple[str, str, str] | None = None  # (name, path, version) of the current adapter
    _base_label: str | None = None

    # -- requests: every /generate names the current adapter ----------------------------------------
    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        if path == "/generate" and self._adapter is not None and isinstance(kwargs.get("json"), dict):
            kwargs["json"] = {**kwargs["json"], "lora_path": self._adapter[0]}
        return super()._request(method, path, **kwargs)  # type: ignore[misc]

    def _lora_call(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self._request("POST", route, json=body)
        check_route("POST", route, response, self.base_url, NO_LORA)
        reply = reply_object(response)
        if response.status_code != 200 or reply is None or reply.get("success") is not True:
            message = None if reply is None else reply.get("error_message")
            raise EngineError(f"{route} {body.get('lora_name')}: {message or error_message(response)}")
        return reply

    def loaded_adapters(self) -> dict[str, str]:
        """Adapter name -> path, as ``GET /v1/models`` lists them."""
        _, reply = self._get_json(("/v1/models",), lacks=NO_LORA)
        cards = reply.get("data") if isinstance(reply, dict) else None
        if not isinstance(cards, list):
            raise EngineError(f"GET /v1/models: unexpected reply {str(reply)[:200]}")
        return {c["id"]: c.get("root") for c in cards if isinstance(c, dict) and c.get("parent") is not None}

    # -- Engine protocol ------------------------------------------------------------------------------
    def _load_adapter(self, snapshot_dir: str, weight_version: str) -> None:
        self._check_single_replica()
        if self._base_label is None:
            self._base_label = super().weight_version()  # type: ignore[misc]
        name, path = adapter_name(weight_version, snapshot_dir), str(snapshot_dir)
        previous, self._adapter = self._adapter, None  # unknown until the read-back below
        self._register(name, path)
        if self.loaded_adapters().get(name) != path:
            raise EngineError(f"/v1/models does not list adapter {name} at {path} after loading it")
        self._adapter = (name, path, weight_version)
        if previous is not None and previous[0] != name:
            try:
                self._lora_call("/unload_lora_adapter", {"lora_name": previous[0]})
            except EngineError as e:  # it only costs host memory: sglang evicts past --max-loaded-loras
                print(f"ckpteval: could not unload LoRA adapter {previous[0]} from {self.base_url}: {e}",
                      file=sys.stderr, flush=True)

    def _register(self, name: str, path: str) -> None:
        """Load ``name`` from ``path`` unless ``/v1/models`` lists it so; a lost race is no failure, an
        incomplete unload of the name is retried first (module docstring)."""
        if self.loaded_adapters().get(name) == path:
            return
        body = {"lora_name": name, "lora_path": path, "pinned": False}
        try:
            self._lora_call("/load_lora_adapter", body)
        except EngineError as e:
            if PENDING_UNLOAD in str(e):
                self._lora_call("/unload_lora_adapter", {"lora_name": name})
                self._lora_call("/load_lora_adapter", body)
            elif not any(d in str(e) for d in DUPLICATE_LOAD):
                raise  # else another client loaded this name first: the caller's read-back decides

    def _check_single_replica(self) -> None:
        """:class:`UnservableAdapter` when the server runs DP replicas (dynamic LoRA asserts ``dp_size == 1``)."""
        info = self.server_info()  # type: ignore[attr-defined]
        dp = info.get("dp_size") or 1
        if isinstance(dp, int) and dp > 1:
            raise UnservableAdapter(f"{self.base_url} runs --dp-size {dp}: sglang loads LoRA adapters dynamically "
                                    "only with one data-parallel replica (tokenizer_control_mixin.py asserts "
                                    "dp_size == 1); launch one server per replica or drop --dp-size")

    def lm_eval_model(self, snapshot_dir: str) -> tuple[str, str]:
        """``(model, tokenizer)`` for lm-eval's ``local-completions``: ``<served model>:<adapter name>`` and
        the base's tokenizer dir (module docstring); :class:`UnservableAdapter` when there is none here."""
        if self._adapter is None:
            raise EngineError("no adapter loaded: call load() first")
        info = self.model_info()  # type: ignore[attr-defined]
        served = info.get("served_model_name") or info.get("model_path")
        tokenizer = self._base_tokenizer_dir(info)
        if not isinstance(served, str) or tokenizer is None:
            raise UnservableAdapter(f"lm_eval on LoRA at {self.base_url}: the base model's tokenizer "
                                    f"({info.get('tokenizer_path')!r}) is not a directory on this worker")
        return f"{served}:{self._adapter[0]}", tokenizer

    def _base_tokenizer_dir(self, info: dict[str, Any]) -> str | None:
        path = info.get("tokenizer_path") or info.get("model_path")
        return path if isinstance(path, str) and Path(path).is_dir() else None

    def generate(self, *args: Any, **kwargs: Any) -> list[Generation]:
        """Generate under the current adapter; a server that lost it (restarted) gets it loaded again."""
        if self._adapter is None:
            raise EngineError("no adapter loaded: call load() first")
        try:
            return self._stamp(super().generate(*args, **kwargs))  # type: ignore[misc]
        except RequestRejected as e:
            if NEVER_LOADED not in str(e):
                raise
        name, path, version = self._adapter
        print(f"ckpteval: {self.base_url} no longer knows LoRA adapter {name} (restarted?): loading it again",
              file=sys.stderr, flush=True)
        self._load_adapter(path, version)
        return self._stamp(super().generate(*args, **kwargs))  # type: ignore[misc]

    def _adapter_version(self) -> str | None:
        """The current adapter's version while the server maps its name to its path; a name no longer
        listed (unloaded by another worker, evicted) is registered again first (module docstring)."""
        if self._adapter is None:
            return None
        name, path, version = self._adapter
        listed = self.loaded_adapters().get(name)
        if listed is None:
            self._register(name, path)
            listed = self.loaded_adapters().get(name)
        return version if listed == path else None

    def _stamp(self, generations: list[Generation]) -> list[Generation]:
        """Samples answered under the base's own label carry the adapter's version."""
        version = None if self._adapter is None else self._adapter[2]
        out = []
        for g in generations:
            stamped = version if g.weight_version == self._base_label else f"{g.weight_version}+{version}"
            out.append(dataclasses.replace(g, weight_version=stamped))
        return out


class HTTPLoRAEngine(_LoRAClient, HTTPEngine):
    """An attached sglang server started with ``--enable-lora`` (and a LoRA pool large enough)."""

    def load(self, snapshot_dir: str, weight_version: str) -> None:
        self._load_adapter(snapshot_dir, weight_version)

    def weight_version(self) -> str | None:
        return self._adapter_version()


class SGLangLoRAEngine(_LoRAClient, SGLangEngine):
    """Launches sglang on ``base_model`` with LoRA enabled (sized from the first adapter), labelled
    :data:`BASE_LABEL`, then serves every snapshot as an adapter; see the module docstring."""

    def __init__(self, base_model: str, *, extra_args: tuple[str, ...] | list[str] = (), **kwargs: Any) -> None:
        kwargs.pop("model_path", None)
        if kwargs.get("url") is not None:
            raise ValueError("SGLangLoRAEngine launches its own server; attach with http:URL instead")
        self._base_model, self._user_args = str(base_model), tuple(extra_args)
        super().__init__(None, extra_args=extra_args, **kwargs)

    def load(self, snapshot_dir: str, weight_version: str) -> None:
        if self._not_launched:  # first load: the server starts on the base, sized from this adapter
            flags = [] if "--enable-lora" in self._user_args else lora_launch_flags(snapshot_dir, self._user_args)
            ls = self._launch_settings
            self._launch_settings = dataclasses.replace(ls, extra_args=(*ls.extra_args, *flags))
            self._model_path, self._version = self._base_model, BASE_LABEL
            self._launch()
            self._base_label = BASE_LABEL
        self._load_adapter(snapshot_dir, weight_version)

    def weight_version(self) -> str | None:
        return None if self._not_launched else self._adapter_version()

    def _base_tokenizer_dir(self, info: dict[str, Any]) -> str | None:
        return self._base_model if Path(self._base_model).is_dir() else None

    def restart(self) -> None:
        """Relaunch on the base; the adapter must be loaded again (version ``None`` until then)."""
        self._adapter = None
        super().restart()
