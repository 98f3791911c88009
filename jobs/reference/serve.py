"""``ckpteval serve``: an HTTP engine speaking a subset of sglang's native API, on CPU or CUDA.

It lets every eval path that talks to sglang (``HTTPEngine``, version pinning through
``update_weights_from_disk`` + ``model_info``) run on machines without a GPU or sglang.

Matched against sgl-project/sglang's ``python/sglang/srt/entrypoints/http_server.py``,
``managers/io_struct.py`` (``GenerateReqInput``, ``UpdateWeightFromDiskReqInput``) and
``managers/tokenizer_manager.py`` (``meta_info``), as of the 0.5.x line (index snapshot
0025436e of http_server.py, ``/get_model_info`` era, and the later main where ``/model_info`` is the
route and ``/get_model_info`` a deprecated alias — both are served here with the same body):

- ``POST|PUT /generate``: ``text`` (str or list) or ``input_ids`` (list[int] or list[list[int]]),
  ``sampling_params`` (dict, or a list of dicts for a batch) with ``max_new_tokens`` (default 128),
  ``temperature`` (default 1.0; 0 = greedy), ``top_p``, ``top_k`` (-1 = off), ``sampling_seed``.
  Reply ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "weight_version", "completion_tokens", "cached_tokens", "e2e_latency"}}``; a list for list input.
- ``POST /update_weights_from_disk``: ``model_path`` (required), ``weight_version`` (optional; when
  absent the version is left as it was, as in sglang), ``load_format`` (``auto``/``safetensors``).
  Reply ``{"success", "message", "num_paused_requests"}``, 200 on success, 400 on failure.
- ``GET /model_info`` and ``GET /get_model_info``: ``model_path``, ``tokenizer_path``,
  ``is_generation``, ``preferred_sampling_params``, ``weight_version``, ``model_type``, ...
- ``GET /weight_version`` and ``/get_weight_version``: ``{"weight_version"}``.
- ``GET /health``: 200 when a model is loaded (sglang's default), ``GET /health_generate``: 200 after
  a one-token generate, 503 otherwise; empty bodies.

Malformed requests get 400 with sglang's ``ErrorResponse`` body (``{"object": "error", "message",
"type", "param", "code"}``); engine-side generation errors get ``{"error": {"message"}}``.
Not supported (400 when requested): streaming, logprobs, LoRA, multimodal inputs, sampling keys
other than those above. Engine calls are serialized by one lock, so a weight update waits for
in-flight generations and a response never mixes versions.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.eval.engines.base import EngineError, SamplingParams
from jobs.eval.options import DEVICE_RE
from jobs.flags import Parser, bounded, check_file_readable, fail, positive_int

if TYPE_CHECKING:
    from jobs.eval.engines.hf import Completion, HFEngine

DEFAULT_WEIGHT_VERSION = "default"  # sglang's ServerArgs.weight_version default
MAX_BODY_BYTES = 64 * 1024 * 1024
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "sampling_seed")
UNSUPPORTED_REQUEST_KEYS = (
    "stream",
    "return_logprob",
    "lora_path",
    "image_data",
    "audio_data",
    "video_data",
    "input_embeds",
    "return_hidden_states",
)
LOAD_FORMATS = (None, "auto", "safetensors")


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400)."""


# --------------------------------------------------------------------------------------------------
# Request parsing (pure functions)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateRequest:
    """A parsed ``/generate`` body: one prompt per item, as text or ids, with its sampling."""

    batched: bool
    texts: list[str] | None
    input_ids: list[list[int]] | None
    params: list[SamplingParams]
    rid: str


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"sampling_params.{key} must be a number, got {value!r}")
    return float(value)


def _integer(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"sampling_params.{key} must be an integer, got {value!r}")
    return value


def parse_sampling(raw: Any) -> SamplingParams:
    """sglang ``sampling_params`` (subset) -> :class:`SamplingParams`, with sglang's defaults."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(SAMPLING_KEYS))
    if unknown:
        raise BadRequest(f"unsupported sampling_params {unknown}; supported: {list(SAMPLING_KEYS)}")
    seed = raw.get("sampling_seed")
    return SamplingParams(
        max_new_tokens=_integer(raw.get("max_new_tokens", 128), "max_new_tokens"),
        temperature=_number(raw.get("temperature", 1.0), "temperature"),
        top_p=_number(raw.get("top_p", 1.0), "top_p"),
        top_k=_integer(raw.get("top_k", -1), "top_k"),
        seed=None if seed is None else _integer(seed, "sampling_seed"),
    )


def _parse_prompts(body: dict[str, Any]) -> tuple[bool, list[str] | None, list[list[int]] | None]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("exactly one of 'text' or 'input_ids' must be provided")
    if text is not None:
        if isinstance(text, str):
            return False, [text], None
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return True, list(text), None
        raise BadRequest("'text' must be a string or a non-empty list of strings")
    if isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return False, None, [list(ids)]
    if isinstance(ids, list) and ids and all(isinstance(row, list) and row for row in ids):
        if all(isinstance(t, int) and not isinstance(t, bool) for row in ids for t in row):
            return True, None, [list(row) for row in ids]
    raise BadRequest("'input_ids' must be a non-empty list of ints or a non-empty list of such lists")


def parse_generate(body: Any) -> GenerateRequest:
    """Validate a ``/generate`` body; :class:`BadRequest` says what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    requested = [k for k in UNSUPPORTED_REQUEST_KEYS if body.get(k)]
    if requested:
        raise BadRequest(f"not supported by ckpteval serve: {requested}")
    batched, texts, input_ids = _parse_prompts(body)
    n = len(texts if texts is not None else input_ids)
    raw = body.get("sampling_params")
    if isinstance(raw, list):
        if not batched or len(raw) != n:
            raise BadRequest(f"a list of sampling_params needs a batch of the same length ({n})")
        params = [parse_sampling(p) for p in raw]
    else:
        params = [parse_sampling(raw)] * n
    rid = body.get("rid")
    return GenerateRequest(
        batched, texts, input_ids, params, rid if isinstance(rid, str) else uuid.uuid4().hex
    )


def parse_update(body: Any) -> tuple[str, str | None]:
    """``(model_path, weight_version)`` from an ``/update_weights_from_disk`` body."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    path, version = body.get("model_path"), body.get("weight_version")
    if not isinstance(path, str) or not path:
        raise BadRequest("'model_path' (a non-empty string) is required")
    if version is not None and not isinstance(version, str):
        raise BadRequest(f"'weight_version' must be a string, got {version!r}")
    if body.get("load_format") not in LOAD_FORMATS:
        raise BadRequest(
            f"load_format {body.get('load_format')!r} not supported; use 'auto' or 'safetensors'"
        )
    return path, version


def error_body(message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> dict[str, Any]:
    """sglang's ``ErrorResponse`` shape."""
    return {"object": "error", "message": message, "type": status.phrase, "param": None, "code": status.value}


# --------------------------------------------------------------------------------------------------
# The service: engine calls behind one lock
# --------------------------------------------------------------------------------------------------


class EngineService:
    """What the HTTP handlers call; owns the engine, the served model path and the engine lock."""

    def __init__(self, engine: HFEngine, model_path: str) -> None:
        self.engine = engine
        self.model_path = model_path
        self.lock = threading.Lock()

    def generate(self, req: GenerateRequest) -> list[dict[str, Any]]:
        start = time.perf_counter()
        with self.lock:
            completions = self._run(req)
        latency = time.perf_counter() - start
        return [self._item(req, i, c, latency) for i, c in enumerate(completions)]

    def _run(self, req: GenerateRequest) -> list[Completion]:
        """Generate each distinct sampling group in one batch; results back in request order."""
        items = req.texts if req.texts is not None else req.input_ids
        out: list[Completion | None] = [None] * len(items)
        for params in dict.fromkeys(req.params):
            idx = [i for i, p in enumerate(req.params) if p == params]
            if req.texts is not None:
                done = self.engine.complete([req.texts[i] for i in idx], params)
            else:
                done = self.engine.generate_ids([req.input_ids[i] for i in idx], params)
            for i, c in zip(idx, done, strict=True):
                out[i] = c
        return [c for c in out if c is not None]

    @staticmethod
    def _item(req: GenerateRequest, i: int, c: Completion, latency: float) -> dict[str, Any]:
        meta = {
            "id": req.rid if not req.batched else f"{req.rid}_{i}",
            "finish_reason": c.finish_reason,
            "prompt_tokens": c.prompt_tokens,
            "weight_version": c.weight_version,
            "completion_tokens": len(c.output_ids),
            "cached_tokens": 0,
            "e2e_latency": latency,
        }
        return {"text": c.text, "output_ids": c.output_ids, "meta_info": meta}

    def update(self, path: str, version: str | None) -> tuple[bool, str]:
        with self.lock:
            keep = self.engine.weight_version() or DEFAULT_WEIGHT_VERSION
            try:
                self.engine.load(path, version if version is not None else keep)
            except (EngineError, ValueError) as e:
                return False, f"Failed to update weights: {e}"
            self.model_path = path
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return True, message

    def model_info(self) -> dict[str, Any]:
        with self.lock:
            model = self.engine.model
            config = model.config if model is not None else None
            return {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.engine.weight_version(),
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None),
            }

    def healthy(self) -> bool:
        with self.lock:
            return self.engine.healthy()


# --------------------------------------------------------------------------------------------------
# HTTP layer
# --------------------------------------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    """Routes requests to the :class:`EngineService` of its server."""

    server: EngineHTTPServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        routes: dict[str, Callable[[], None]] = {
            "/health": self._health,
            "/health_generate": self._health_generate,
            "/model_info": self._model_info,
            "/get_model_info": self._model_info,
            "/weight_version": self._weight_version,
            "/get_weight_version": self._weight_version,
        }
        self._route(routes)

    def do_POST(self) -> None:
        self._route({"/generate": self._generate, "/update_weights_from_disk": self._update,
                     "/v1/completions": lambda: self._json(*openai_completions(self.server.service, self._body()))})

    def do_PUT(self) -> None:
        self._route({"/generate": self._generate})

    def _route(self, routes: dict[str, Callable[[], None]]) -> None:
        handler = routes.get(self.path.split("?", 1)[0])
        if handler is None:
            self._json(
                HTTPStatus.NOT_FOUND, error_body(f"no route {self.command} {self.path}", HTTPStatus.NOT_FOUND)
            )
            return
        try:
            handler()
        except BadRequest as e:
            self.close_connection = True  # the body may be unread: do not reuse this connection
            self._json(HTTPStatus.BAD_REQUEST, error_body(str(e)))

    # ---------------------------------------------------------------- endpoints
    def _generate(self) -> None:
        req = parse_generate(self._body())
        try:
            items = self.server.service.generate(req)
        except ValueError as e:
            self._json(HTTPStatus.BAD_REQUEST, {"error": {"message": str(e)}})
            return
        except EngineError as e:
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": str(e)}})
            return
        self._json(HTTPStatus.OK, items if req.batched else items[0])

    def _update(self) -> None:
        path, version = parse_update(self._body())
        success, message = self.server.service.update(path, version)
        status = HTTPStatus.OK if success else HTTPStatus.BAD_REQUEST
        self._json(status, {"success": success, "message": message, "num_paused_requests": 0})

    def _model_info(self) -> None:
        self._json(HTTPStatus.OK, self.server.service.model_info())

    def _weight_version(self) -> None:
        self._json(HTTPStatus.OK, {"weight_version": self.server.service.engine.weight_version()})

    def _health(self) -> None:
        loaded = self.server.service.engine.model is not None
        self._empty(HTTPStatus.OK if loaded else HTTPStatus.SERVICE_UNAVAILABLE)

    def _health_generate(self) -> None:
        ok = self.server.service.healthy()
        self._empty(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE)

    # ---------------------------------------------------------------- plumbing
    def _body(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise BadRequest("a Content-Length header is required")
        if int(length) > MAX_BODY_BYTES:
            raise BadRequest(f"request body over {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except ValueError as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from e

    def _json(self, status: HTTPStatus, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _empty(self, status: HTTPStatus) -> None:
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.verbose:
            super().log_message(format, *args)


class EngineHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server holding the :class:`EngineService`."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], service: EngineService, verbose: bool = False) -> None:
        self.service = service
        self.verbose = verbose
        super().__init__(address, Handler)


# --------------------------------------------------------------------------------------------------
# OpenAI-compatible POST /v1/completions, generation only (sglang serves it; lm-eval's local-completions
# backend speaks it). Self-contained: it reuses parse_generate and EngineService.generate.
# --------------------------------------------------------------------------------------------------

COMPLETIONS_KEYS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
                    "echo", "logprobs", "stream", "user")


def _stop_list(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        return [x for x in stop if x]
    raise BadRequest(f"'stop' must be a string or a list of strings, got {stop!r}")


def _cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    cut = min((i for i in (text.find(x) for x in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def openai_completions(service: EngineService, body: Any) -> tuple[HTTPStatus, dict[str, Any]]:
    """``POST /v1/completions``: ``prompt`` (str or list of str), ``max_tokens`` (default 16),
    ``temperature`` (1.0), ``top_p``, ``top_k``, ``seed``, ``stop`` (the text is cut before the first
    stop string). Log-likelihood requests (``echo`` / ``logprobs``), ``n > 1`` and streaming are refused
    (400); the reply is OpenAI's ``text_completion`` object, one choice per prompt, with ``index``."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    unknown = sorted(set(body) - set(COMPLETIONS_KEYS))
    if unknown:
        raise BadRequest(f"unsupported /v1/completions fields {unknown}; supported: {list(COMPLETIONS_KEYS)}")
    if body.get("echo") or body.get("logprobs") is not None or body.get("stream") or body.get("n", 1) != 1:
        raise BadRequest("ckpteval serve's /v1/completions generates only: no echo, logprobs, stream or n > 1")
    prompt = body.get("prompt")
    sampling = {"max_new_tokens": body.get("max_tokens", 16), "temperature": body.get("temperature", 1.0),
                **{k: body[k] for k in ("top_p", "top_k") if k in body},
                **({"sampling_seed": body["seed"]} if body.get("seed") is not None else {})}
    req = parse_generate({"text": prompt, "sampling_params": sampling})
    stops = _stop_list(body.get("stop"))
    try:
        items = service.generate(req)
    except ValueError as e:
        return HTTPStatus.BAD_REQUEST, {"error": {"message": str(e)}}
    except EngineError as e:
        return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": str(e)}}
    choices = []
    for i, item in enumerate(items):
        text, stopped = _cut_at_stop(item["text"], stops)
        finish = "stop" if stopped or item["meta_info"]["finish_reason"]["type"] == "stop" else "length"
        choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": finish})
    used = sum(it["meta_info"]["prompt_tokens"] for it in items), sum(it["meta_info"]["completion_tokens"] for it in items)
    return HTTPStatus.OK, {
        "id": f"cmpl-{req.rid}", "object": "text_completion", "created": int(time.time()),
        "model": service.model_path, "choices": choices,
        "usage": {"prompt_tokens": used[0], "completion_tokens": used[1], "total_tokens": sum(used)},
    }


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def _port(text: str) -> int:
    port = bounded(int, min=0)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"must be <= 65535, got {port}")
    return port


def _device(text: str) -> str:
    if not DEVICE_RE.match(text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ckpteval serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["hf"], default="hf", help="inference backend (default: hf)")
    parser.add_argument("--model", required=True, metavar="DIR", help="HF snapshot dir to load at start")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=30000,
                        help="port to listen on; 0 picks a free port (printed) (default: 30000)")
    parser.add_argument("--weight-version", default=DEFAULT_WEIGHT_VERSION, metavar="V",
                        help=f"version string the loaded model reports (default: {DEFAULT_WEIGHT_VERSION})")
    parser.add_argument("--device", type=_device, default="cpu", help="cpu, cuda, cuda:N (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights dtype (default: float32)")
    parser.add_argument("--max-batch-size", type=positive_int, default=256, metavar="N",
                        help="most prompts generated in one batch (default: 256)")
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    return parser


def _check_start(args: argparse.Namespace) -> str | None:
    """What is wrong with the model dir or device, checked before anything loads (None if nothing)."""
    try:
        check_file_readable("--model", Path(args.model) / "config.json")
    except (FileNotFoundError, ValueError) as e:
        return f"{e} (--model must be an HF snapshot dir)"
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return f"--device {args.device}: CUDA is not available on this machine"
    return None


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if (problem := _check_start(args)) is not None:
        return fail("ckpteval serve", problem)
    try:  # bind first: a port in use is a usage error, found before a long model load
        server = EngineHTTPServer((args.host, args.port), None, args.verbose)  # type: ignore[arg-type]
    except OSError as e:
        return fail("ckpteval serve", f"--host {args.host} --port {args.port}: cannot listen ({e.strerror or e})")
    from jobs.eval.engines.hf import HFEngine

    engine = HFEngine(device=args.device, dtype=args.dtype, max_batch_size=args.max_batch_size)
    try:
        engine.load(args.model, args.weight_version)
    except EngineError as e:
        server.server_close()
        return fail("ckpteval serve", f"cannot load {args.model}: {e}", 1)
    server.service = EngineService(engine, args.model)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, name="ckpteval-serve", daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    print(f"serving on http://{host}:{port}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
        engine.close()
    return 0
