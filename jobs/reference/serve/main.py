"""``ckpteval serve``: an HTTP engine speaking sglang 0.5.23's native API, on CPU or CUDA (and a judge stand-in).

Owns the routes and the status codes and bodies sglang answers with (``/generate``,
``/update_weights_from_disk``, ``/update_weight_version``, ``/weights_checker``, ``/abort_request``,
``/pause_generation``, ``/model_info``, ``/server_info``, ``/health*``), read from the sglang 0.5.23 wheel, so
every eval path that talks to sglang runs without a GPU. Limits (stand-in, not sglang): one engine lock
(:mod:`ckpteval.jobs.reference.serve.engine`); fields it cannot honour (streaming, output logprobs, ``n`` > 1,
stop strings, grammars) are refused with 400 naming them. See docs/USER_GUIDE.md "sglang: what the worker
relies on".
"""

from __future__ import annotations

import argparse
import signal
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

from ckpteval.jobs.eval.engines.base import EngineError
from ckpteval.jobs.eval.engines.sglang.deterministic import (
    ATTENTION_BACKENDS,
    DETERMINISTIC_ATTENTION_BACKENDS,
    FALLBACK_ATTENTION_BACKEND,
    resolve,
)
from ckpteval.jobs.eval.worker.options import DEVICE_RE
from ckpteval.jobs.flags import Parser, bounded, fail, positive_int
from ckpteval.jobs.pathchecks import check_file_readable
from ckpteval.jobs.reference.serve.engine import DEFAULT_WEIGHT_VERSION, EngineService
from ckpteval.jobs.reference.serve.http import EngineHTTPServer
from ckpteval.jobs.reference.serve.judge import JUDGE_MODES, JudgeHTTPServer

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
    parser.add_argument("--model", metavar="DIR", help="HF snapshot dir to load at start (required unless --judge)")
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
    parser.add_argument("--max-queued-requests", type=bounded(int, min=0), default=None, metavar="N",
                        help="shed a request (503 'The request queue is full.') whose prompts, added to those "
                        "already waiting, exceed N, as sglang's flag does (counted in prompts) (default: no limit)")
    parser.add_argument("--max-total-tokens", type=positive_int, default=None, metavar="N",
                        help="answer a batch whose prompt plus max_new_tokens tokens exceed N with sglang's "
                        "503 'Retracted under decode memory pressure without a KV backup' (default: no limit)")
    parser.add_argument("--logprob-offset", type=bounded(float, min=0), default=0.0, metavar="X",
                        help="stand-in only: add X to every return_logprob log-prob, so a canary sees a set "
                        "difference from the trainer's (default: 0)")
    parser.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="sglang's batch-invariant mode: a completion depends on its prompt, settings and seed only, never on "
        "its batch-mates (each distinct prompt runs alone), and each request's sampling_params.sampling_seed "
        "applies (unseeded: 42); refuses an --attention-backend sglang refuses in this mode",
    )
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, metavar="NAME",
                        help="reported on /server_info as sglang resolves it (with --enable-deterministic-inference: "
                        f"one of {', '.join(DETERMINISTIC_ATTENTION_BACKENDS)}; none given: "
                        f"{FALLBACK_ATTENTION_BACKEND}); the stand-in's kernels stay the same (default: none)")
    parser.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on every route but "
                        "/health* (and on admin routes unless --admin-api-key), as sglang's flag does")
    parser.add_argument("--admin-api-key", metavar="KEY", help="require this key on admin routes (weight loads, "
                        "/weights_checker, aborts, pause), as sglang's flag does")
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    j = parser.add_argument_group("judge stand-in (jobs/reference/serve/judge.py; no model is loaded)")
    j.add_argument("--judge", choices=JUDGE_MODES, metavar="MODE",
                   help="serve a judge stand-in instead: /v1/models, /v1/chat/completions, /classify; MODE "
                   f"{'|'.join(JUDGE_MODES)} (exact: VERDICT 1 when <response> equals <reference>)")
    j.add_argument("--served-model-name", default="ckpteval-judge", metavar="NAME",
                   help="the model id /v1/models reports (default: ckpteval-judge)")
    j.add_argument("--judge-delay", type=bounded(float, min=0), default=30.0, metavar="S",
                   help="--judge slow: seconds before each chat answer (default: 30)")
    return parser


def _check_start(args: argparse.Namespace) -> str | None:
    """What is wrong with the model dir or device, checked before anything loads (None if nothing)."""
    if args.model is None:
        return "--model DIR is required (unless --judge MODE)"
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
    if args.judge is not None:
        return _main_judge(args)
    if (problem := _check_start(args)) is not None:
        return fail("ckpteval serve", problem)
    try:  # sglang resolves (or refuses) its server args before it loads anything
        resolved = resolve(args.enable_deterministic_inference, args.attention_backend)
    except ValueError as e:
        return fail("ckpteval serve", f"--attention-backend {args.attention_backend} with "
                    f"--enable-deterministic-inference: {e}")
    try:  # bind first: a port in use is a usage error, found before a long model load
        server = EngineHTTPServer((args.host, args.port), None, args.verbose)  # type: ignore[arg-type]
    except OSError as e:
        return fail("ckpteval serve", f"--host {args.host} --port {args.port}: cannot listen ({e.strerror or e})")
    from ckpteval.jobs.eval.engines.hf.engine import HFEngine

    engine = HFEngine(device=args.device, dtype=args.dtype, max_batch_size=args.max_batch_size)
    try:
        engine.load(args.model, args.weight_version)
    except EngineError as e:
        server.server_close()
        return fail("ckpteval serve", f"cannot load {args.model}: {e}", 1)
    server.service = EngineService(engine, args.model, args.enable_deterministic_inference,
                                   max_queued=args.max_queued_requests, max_running=args.max_batch_size,
                                   max_total_tokens=args.max_total_tokens, logprob_offset=args.logprob_offset,
                                   resolved=resolved)
    server.api_keys = (args.api_key, args.admin_api_key)
    try:
        serve_until_signalled(server, "ckpteval-serve")
    finally:
        engine.close()
    return 0


def serve_until_signalled(server: ThreadingHTTPServer, name: str) -> None:
    """Serve on a thread until SIGTERM/SIGINT; prints ``serving on http://HOST:PORT`` once it listens."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
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


def _main_judge(args: argparse.Namespace) -> int:
    """``--judge MODE``: the judge stand-in (:mod:`ckpteval.jobs.reference.serve.judge`) until SIGTERM/SIGINT."""
    try:
        server = JudgeHTTPServer((args.host, args.port), args.judge, args.served_model_name, args.judge_delay,
                                 args.verbose)
    except OSError as e:
        return fail("ckpteval serve", f"--host {args.host} --port {args.port}: cannot listen ({e.strerror or e})")
    serve_until_signalled(server, "ckpteval-judge")
    return 0
