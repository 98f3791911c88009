"""The sglang LoRA client against a small real HTTP server.

sglang needs a GPU, so the server here is a stub (a real ``ThreadingHTTPServer``) that implements the
LoRA routes as sglang 0.5.23's source describes them (see :mod:`ckpteval.jobs.eval.engines.sglang.lora`):
``/load_lora_adapter`` / ``/unload_lora_adapter`` (200/400 with ``success``, ``error_message``,
``loaded_adapters``; duplicate names refused), ``/v1/models`` adapter cards, ``/generate`` answering only
for a registered ``lora_path`` name (400 otherwise) with the base's ``weight_version``; past
``max_loaded`` (``--max-loaded-loras``) a load evicts the least recently used adapter
(``srt/managers/tokenizer_control_mixin.py`` ``load_lora_adapter``, ``lora_registry.py``
``lru_lora_name``); a name with a pending unload refuses a load until it is unloaded again (same file,
``pending_lora_unloads``); with ``dp_size > 1`` every adapter route is a 500 (the same file asserts
``dp_size == 1``, and an ``AssertionError`` is no ``ValueError``: FastAPI's plain 500)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from ckpteval.jobs.eval.engines.base import EngineError, SamplingParams
from ckpteval.jobs.eval.engines.factory import make_engine
from ckpteval.jobs.eval.engines.sglang.lora import (
    HTTPLoRAEngine,
    UnservableAdapter,
    adapter_name,
    lora_launch_flags,
)


class LoRAStub(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.label = "base"
        self.adapters: dict[str, str] = {}
        self.ever: dict[str, str] = {}  # every name loaded since start (sglang's lora_ref_cache, never emptied)
        self.generate_bodies: list[dict[str, Any]] = []
        self.lost_race = False  # the next load finds another client's load of the same name landed first
        self.unload_error: str | None = None  # the next unload fails with this message
        self.max_loaded: int | None = None  # --max-loaded-loras: LRU eviction past it
        self.pending: set[str] = set()  # names with an incomplete unload
        self.dp_size = 1
        self.base = "/base"  # the base model's path (served name and tokenizer path)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: LoRAStub

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        s = self.server
        if self.path in ("/model_info", "/get_model_info"):
            self._reply(200, {"model_path": s.base, "served_model_name": s.base, "tokenizer_path": s.base,
                              "weight_version": s.label})
        elif self.path == "/health_generate":
            self._reply(200, {})
        elif self.path in ("/server_info", "/get_server_info"):  # the client checks the pinned range
            self._reply(200, {"version": "0.5.23", "tp_size": 1, "dp_size": s.dp_size, "pp_size": 1})
        elif self.path == "/v1/models":
            cards = [{"id": "/base", "root": "/base", "parent": None}]
            cards += [{"id": n, "root": p, "parent": "/base"} for n, p in s.adapters.items()]
            self._reply(200, {"object": "list", "data": cards})
        else:
            self._reply(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        s = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path in ("/load_lora_adapter", "/unload_lora_adapter") and s.dp_size > 1:
            data = b"Internal Server Error"
            self.send_response(500)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            return self.wfile.write(data)
        if self.path == "/load_lora_adapter":
            name, path = body["lora_name"], body["lora_path"]
            if name in s.pending:
                return self._reply(400, {"success": False, "error_message": f"LoRA adapter '{name}' has an incomplete "
                                         "unload. Retry the unload before loading it again.", "loaded_adapters": s.adapters})
            if s.lost_race:
                s.lost_race, s.adapters[name] = False, path
            if name in s.adapters:
                error = f"Failed to load LoRA adapter {name} because it is already loaded"
            elif not Path(path, "adapter_config.json").is_file():
                error = f"Failed to load LoRA adapter {name}: no adapter_config.json in {path}"
            else:
                s.adapters[name] = s.ever[name] = path
                while s.max_loaded is not None and len(s.adapters) > s.max_loaded:  # LRU first (dict order)
                    s.adapters.pop(next(iter(s.adapters)))
                return self._reply(200, {"success": True, "error_message": None, "loaded_adapters": s.adapters})
            return self._reply(400, {"success": False, "error_message": error, "loaded_adapters": s.adapters})
        if self.path == "/unload_lora_adapter":
            if s.unload_error is not None:
                error, s.unload_error = s.unload_error, None
                return self._reply(400, {"success": False, "error_message": error, "loaded_adapters": s.adapters})
            if body["lora_name"] in s.pending:
                s.pending.discard(body["lora_name"])
                return self._reply(200, {"success": True, "error_message": None, "loaded_adapters": s.adapters})
            if s.adapters.pop(body["lora_name"], None) is None:
                return self._reply(400, {"success": False, "error_message": f"LoRA with name {body['lora_name']} "
                                         "does not exist.", "loaded_adapters": s.adapters})
            return self._reply(200, {"success": True, "error_message": None, "loaded_adapters": s.adapters})
        if self.path == "/generate":
            s.generate_bodies.append(body)
            name = body.get("lora_path")
            if name not in s.adapters and name in s.ever:  # evicted or unloaded: sglang reloads it on use
                s.adapters[name] = s.ever[name]
            if name not in s.adapters:
                return self._reply(400, {"error": {"message": f"Got LoRA adapter that has never been loaded: {name}"}})
            s.adapters[name] = s.adapters.pop(name)  # most recently used last
            texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
            out = [{"text": name, "output_ids": [5], "meta_info": {
                "id": str(i), "weight_version": s.label, "completion_tokens": 1, "prompt_tokens": 3,
                "finish_reason": {"type": "stop", "matched": 2},
                "weight_versions": [{"version": s.label, "start": 0, "end": 1}]}} for i, _ in enumerate(texts)]
            return self._reply(200, out if isinstance(body["text"], list) else out[0])
        self._reply(404, {"detail": "Not Found"})


@pytest.fixture
def stub() -> Iterator[LoRAStub]:
    server = LoRAStub()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _adapter(tmp: Path, step: int, modules: object = ("v_proj", "q_proj")) -> Path:
    d = tmp / f"step-{step:010d}"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8,
                                                       "target_modules": modules}))
    return d


def test_adapter_per_snapshot_named_by_step_and_pinned(stub: LoRAStub, tmp_path: Path) -> None:
    engine = make_engine(f"http:{stub.url}", "cpu", {}, base_model="/base")
    assert isinstance(engine, HTTPLoRAEngine)
    first, second = _adapter(tmp_path, 10), _adapter(tmp_path, 20)
    engine.load(str(first), "10")
    assert engine.weight_version() == "10"
    gens = engine.generate(["1+1=", "2+2="], SamplingParams(max_new_tokens=2))
    name = adapter_name("10", str(first))
    assert name.startswith("step-10-") and [g.weight_version for g in gens] == ["10", "10"]
    assert [g.text for g in gens] == [name, name] and stub.generate_bodies[-1]["lora_path"] == name

    engine.load(str(second), "20")
    assert list(stub.adapters) == [adapter_name("20", str(second))]  # the previous adapter was unloaded
    assert [g.weight_version for g in engine.generate(["3+3="], SamplingParams())] == ["20"]

    engine.load(str(second), "20")  # already registered under its name and path: no duplicate load
    assert engine.weight_version() == "20"

    stub.label = "update-7"  # someone replaced the base weights: samples can no longer be step 20
    assert [g.weight_version for g in engine.generate(["3+3="], SamplingParams())] == ["update-7+20"]
    stub.label = "base"

    stub.adapters.clear()  # unloaded or evicted behind our back: sglang reloads a name it loaded once, from
    assert [g.weight_version for g in engine.generate(["3+3="], SamplingParams())] == ["20"]  # its path, on use
    stub.adapters[adapter_name("20", str(second))] = "/elsewhere"  # the name now maps to other weights
    assert engine.weight_version() is None

    stub.adapters.clear()
    stub.ever.clear()  # a restarted server never loaded the name: its 400 makes the client load it again
    assert [g.text for g in engine.generate(["3+3="], SamplingParams())] == [adapter_name("20", str(second))]
    assert engine.weight_version() == "20"
    engine.close()


def test_a_failed_adapter_load_leaves_no_version(stub: LoRAStub, tmp_path: Path) -> None:
    engine = HTTPLoRAEngine(stub.url)
    engine.load(str(_adapter(tmp_path, 1)), "1")
    with pytest.raises(EngineError, match="no adapter_config.json"):
        engine.load(str(tmp_path / "missing"), "2")
    assert engine.weight_version() is None
    with pytest.raises(EngineError, match="no adapter loaded"):
        engine.generate(["x"], SamplingParams())
    engine.close()


def test_launch_flags_size_the_lora_pool_from_the_adapter(tmp_path: Path) -> None:
    flags = lora_launch_flags(str(_adapter(tmp_path, 1)))
    assert flags == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj",
                     "--max-loaded-loras", "8"]  # bounded host memory: sglang evicts LRU adapters past it
    assert lora_launch_flags(str(tmp_path / "step-0000000001"), ("--max-loras-per-batch", "16"))[-2:] == [
        "--max-loaded-loras", "16"]  # sglang refuses fewer loaded than per batch
    assert "--max-loaded-loras" not in lora_launch_flags(str(tmp_path / "step-0000000001"), ("--max-loaded-loras", "4"))
    with pytest.raises(EngineError, match="cannot size"):
        lora_launch_flags(str(tmp_path))


def test_target_modules_sglang_refuses_are_caught_before_launch(tmp_path: Path) -> None:
    """sglang's --lora-target-modules has argparse choices: anything else and it exits at parsing."""
    assert lora_launch_flags(str(_adapter(tmp_path, 1, "all-linear")))[3:5] == ["--lora-target-modules", "all"]
    dotted = lora_launch_flags(str(_adapter(tmp_path, 2, ["model.layers.0.mlp.gate_proj", "up_proj"])))
    assert dotted[3:6] == ["--lora-target-modules", "gate_proj", "up_proj"]
    for step, modules, says in [(3, ["q_proj", "fc1"], r"\['fc1'\]"), (4, ".*proj", "not a module list"),
                                (5, [], "non-empty list")]:
        with pytest.raises(UnservableAdapter, match=says) as caught:
            lora_launch_flags(str(_adapter(tmp_path, step, modules)))
        assert "adapter_config.json" in str(caught.value) and "\n" not in str(caught.value)
        assert caught.value.reason == "rejected" and not caught.value.restart_helps


def test_two_workers_loading_one_adapter_on_a_shared_server(stub: LoRAStub, tmp_path: Path) -> None:
    """The second worker's load loses the race ("already loaded", a 400): it reads /v1/models instead of
    failing, and serves the adapter the other worker registered under the same name and path."""
    first = _adapter(tmp_path, 10)
    engine = HTTPLoRAEngine(stub.url)
    stub.lost_race = True
    engine.load(str(first), "10")
    assert engine.weight_version() == "10" and list(stub.adapters) == [adapter_name("10", str(first))]
    engine.close()


def test_a_failed_unload_is_reported_not_swallowed(
    stub: LoRAStub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = HTTPLoRAEngine(stub.url)
    engine.load(str(_adapter(tmp_path, 1)), "1")
    stub.unload_error = "LoRA adapter 'x' has an incomplete unload."
    engine.load(str(_adapter(tmp_path, 2)), "2")  # the new adapter serves; the old one stays, reported
    assert engine.weight_version() == "2" and len(stub.adapters) == 2
    err = capsys.readouterr().err
    assert f"could not unload LoRA adapter {adapter_name('1', str(tmp_path / 'step-0000000001'))}" in err
    assert "incomplete unload" in err
    engine.close()


def test_sglang_lora_engine_launches_nothing_before_the_first_adapter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built by the factory for a LoRA run (no GPU needed until the first load launches sglang).
    sglang is not installed here: its installed-version check answers a version inside the pin."""
    from ckpteval.jobs.eval.engines.sglang import engine as sglang_engine
    from ckpteval.jobs.eval.engines.sglang.lora import SGLangLoRAEngine

    monkeypatch.setattr(sglang_engine, "installed_sglang_version", lambda *_a, **_k: "0.5.23")

    engine = make_engine("sglang", "cpu", {"tp_size": 1}, base_model=str(tmp_path / "base"))
    assert isinstance(engine, SGLangLoRAEngine) and engine.pid is None and engine.weight_version() is None
    with pytest.raises(EngineError, match="no adapter loaded"):
        engine.generate(["x"], SamplingParams())
    engine.close()


def test_the_pin_check_tolerates_eviction_and_another_workers_unload(stub: LoRAStub, tmp_path: Path) -> None:
    """Between a unit's last generate and its pin check, sglang evicts the adapter past --max-loaded-loras
    or another worker unloads the same name (its previous adapter too): not a pin violation."""
    stub.max_loaded = 1
    a, b = HTTPLoRAEngine(stub.url), HTTPLoRAEngine(stub.url)
    ten, twenty, thirty = _adapter(tmp_path, 10), _adapter(tmp_path, 20), _adapter(tmp_path, 30)
    a.load(str(ten), "10")
    assert [g.weight_version for g in a.generate(["1+1="], SamplingParams())] == ["10"]
    b.load(str(twenty), "20")  # evicts a's adapter (least recently used)
    assert adapter_name("10", str(ten)) not in stub.adapters
    assert a.weight_version() == "10"  # the pin check: registered again under its path
    b.load(str(ten), "10")  # b evaluates step 10 too ...
    b.load(str(thirty), "30")  # ... then moves on, unloading the name a still uses
    assert adapter_name("10", str(ten)) not in stub.adapters and a.weight_version() == "10"
    a.close()
    b.close()


def test_a_pending_unload_is_retried_before_the_load(stub: LoRAStub, tmp_path: Path) -> None:
    engine = HTTPLoRAEngine(stub.url)
    ten = _adapter(tmp_path, 10)
    stub.pending.add(adapter_name("10", str(ten)))
    engine.load(str(ten), "10")
    assert engine.weight_version() == "10" and not stub.pending
    engine.close()


def test_dynamic_lora_on_dp_replicas_is_refused_not_restarted(stub: LoRAStub, tmp_path: Path) -> None:
    """sglang asserts dp_size == 1 on every adapter route (a 500 a client would restart for)."""
    stub.dp_size = 2
    engine = HTTPLoRAEngine(stub.url)
    with pytest.raises(UnservableAdapter, match="--dp-size 2") as caught:
        engine.load(str(_adapter(tmp_path, 1)), "1")
    assert caught.value.reason == "rejected" and not caught.value.restart_helps and "\n" not in str(caught.value)
    engine.close()


def test_lm_eval_addresses_the_adapter_and_tokenizes_with_the_base(stub: LoRAStub, tmp_path: Path) -> None:
    """sglang's OpenAI layer selects an adapter only from model="<base>:<adapter>" (serving_base.py
    _parse_model_parameter); the adapter dir has no tokenizer, the base has."""
    pytest.importorskip("lm_eval", reason="the harness extra (lm-eval) is not installed")
    from ckpteval.coord.entries.lm_eval import LmEvalEntry
    from ckpteval.jobs.eval.kinds.lm_eval import completions_lm
    from tests.support.workers import base_dir

    stub.base = str(base_dir(tmp_path))
    engine = HTTPLoRAEngine(stub.url)
    step = _adapter(tmp_path, 10)
    engine.load(str(step), "10")
    model, tokenizer = engine.lm_eval_model(str(step))
    assert (model, tokenizer) == (f"{stub.base}:{adapter_name('10', str(step))}", stub.base)
    lm = completions_lm(engine, str(step), LmEvalEntry(name="h", tasks=("t",)))
    assert lm.model == model and lm.tokenizer is not None
    stub.base = "/not/here"  # an attached server whose base is not on this worker: one line, rejected
    with pytest.raises(UnservableAdapter, match="tokenizer") as caught:
        engine.lm_eval_model(str(step))
    assert caught.value.reason == "rejected"
    engine.close()
