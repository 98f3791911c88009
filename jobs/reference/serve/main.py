"""``ckpteval serve``: an HTTP engine speaking sglang 0.5.23's native API, on CPU or CUDA.

It lets every eval path that talks to sglang (``HTTPEngine``, version pinning through
``update_weights_from_disk`` + ``model_info``) run on machines without a GPU or sglang, against the
contract real sglang has. Each behaviour below was read from the sglang 0.5.23 wheel (paths inside
it); the server reports ``"version": "0.5.23"`` on ``/server_info``.

Routes (``srt/entrypoints/http_server.py``; nothing that release lacks, e.g. no
``/get_weight_version``, removed in 0.5.21):

- ``POST|PUT /generate``: ``text`` (str or list) or ``input_ids`` (list[int] or list[list[int]]),
  ``sampling_params`` (one dict, or one per prompt), ``rid``. Reply per prompt ``{"text",
  "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "weight_version",
  "weight_versions", "num_retractions", "completion_tokens", "cached_tokens", "e2e_latency"}}``, a
  list for list input. ``finish_reason`` is ``{"type": "stop", "matched": id}``, ``{"type":
  "length", "length": n}`` or ``{"type": "abort", "message", "status_code": null, "err_type": null}``
  (``srt/managers/schedule_batch.py`` FINISH_*). ``weight_versions`` spans the output tokens
  (``srt/utils/weight_versions.py``); ``weight_version`` is the label when the output is produced.
- ``POST /update_weights_from_disk`` ``{"model_path", "weight_version"?, "abort_all_requests"?:
  false, "load_format"?}``: 200/400 ``{"success", "message", "num_paused_requests"}``; the label and
  ``model_path`` change only on success (``srt/managers/tokenizer_manager.py``).
- ``POST /update_weight_version`` ``{"new_version", "abort_all_requests"?: true}``: relabels without
  touching weights, aborting in-flight requests by default (``srt/managers/io_struct.py``).
- ``GET|POST /weights_checker`` ``{"action": "checksum"}``: per-tensor checksums of the weights held
  (``srt/utils/weight_checker.py``), ``{"success", "message", "ranks": [{"checksums", "per_gpu_checksum",
  "parallelism_info"}], "per_engine_checksum"}``; other actions 400 ``{"success": false, "message"}``.
- ``POST /abort_request`` ``{"rid", "abort_all"?}``: only an rid a live request carries exactly is
  forwarded (``tokenizer_manager.py`` ``abort_request``), which then aborts every live rid starting with
  it (``scheduler.py`` ``abort_request``); a batch's prefix rid aborts nothing;
  ``POST /pause_generation`` ``{"mode": "abort"|"retract"|"in_place"}`` (abort: aborts everything in
  flight, waits for it to end; new requests wait until ``POST /continue_generation``).
- ``GET /model_info`` (and the deprecated ``/get_model_info``), ``GET /server_info`` (and
  ``/get_server_info``) with ``"version"`` and ``enable_deterministic_inference``.
- ``GET /health`` and ``/health_generate`` (the same handler in sglang): a one-token generate, 200
  with an empty body, 503 when it gets no answer within ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s),
  while paused, or before a model is loaded; 200 at once while a generation is running.

Status codes and bodies for bad requests, as sglang answers them:

- a body FastAPI cannot parse: 400 ``{"object": "error", "message", "type": "Bad Request", "param":
  null, "code": 400}`` (``validation_exception_handler``);
- ``sampling_params`` violating the schema (an unknown key, a float where an int belongs, a bool for a
  number): 400 ``{"error": "<text>"}`` (``srt/entrypoints/api_contract.py``, ``sglang/api/v1/api_types.py``);
- what the tokenizer manager refuses (``SamplingParams.verify`` ranges: ``top_k`` 0, ``top_p`` 0,
  negative temperature or ``max_new_tokens``; a prompt at or over the context length; an explicit
  ``max_new_tokens`` that overflows it; a LoRA request; no prompt): 400 ``{"error": {"message"}}``;
- ``max_new_tokens: 0`` is valid (empty output, ``{"type": "length", "length": 0}``); an absent one
  defaults to 128, capped at the context length as the scheduler does; temperature below 1e-6 is greedy;
- an unknown route: 404 ``{"detail": "Not Found"}``; an engine failure: 500;
- a request without the key its route needs, on a server started with ``--api-key``/``--admin-api-key``:
  401 ``{"error": "Unauthorized"}`` (``srt/utils/auth.py``: ``/health*`` always open, admin-optional
  routes such as weight loads and aborts want the admin key when set, the rest the api key);
- a request shed under load (``--max-queued-requests N``: its prompts plus those already waiting exceed
  N, counted in prompts as sglang's scheduler does), a batch over ``--max-total-tokens`` (retraction) or
  one running past ``SGLANG_REQ_RUNNING_TIMEOUT`` (see ``ckpteval.jobs.reference.serve.engine``): 503 ``{"object": "error", "message": "The request queue is full.", "type": "503",
  "param": null, "code": 503}`` (``scheduler.py`` ``_abort_on_queued_limit``; the ``HTTPException`` of
  ``tokenizer_manager.py`` ``_handle_abort_finish_reason`` rendered by ``http_server.py``
  ``validation_exception_handler``).

Deterministic mode (``--enable-deterministic-inference``; what sglang's covers:
:mod:`ckpteval.jobs.eval.engines.sglang.deterministic`): ``sampling_seed`` is validated always and applied
only in this mode (``srt/sampling/sampling_batch_info.py``; unseeded requests then use 42), and a
completion depends on its prompt, settings and seed only, never on its batch-mates — greedy included (each
distinct prompt runs alone: the stand-in's batch invariance, paid in throughput as sglang pays for its
kernels). An ``--attention-backend`` sglang refuses in this mode is refused at start with sglang's message
(exit 2); ``/server_info`` reports the backend, ``sampling_backend`` and ``disable_radix_cache`` as sglang
resolves them (``srt/arg_groups/overrides.py``, on a Hopper-or-older GPU).

Limits (stand-in, not sglang): the engine service's (one lock for generation and loads,
:mod:`ckpteval.jobs.reference.serve.engine`); sglang fields the stand-in cannot honour (streaming, output logprobs, ``n`` > 1, stop strings, grammars,
multimodal input, ...) are refused with 400 ``{"error": {"message"}}`` naming them; out-of-vocabulary
``input_ids`` are refused (sglang leaves them undefined).

Input logprobs (the canary's path, :mod:`ckpteval.jobs.eval.engines.sglang.logprobs`): ``return_logprob`` with
``logprob_start_len`` and ``top_logprobs_num`` on a prefill-only request (``max_new_tokens: 0``) adds
``input_token_logprobs`` / ``input_top_logprobs`` to ``meta_info`` as sglang does (``[logprob, id,
null]`` per prompt token from ``logprob_start_len``, the first one's logprob null). Like sglang, the
server keeps the tokenizer it was launched with across ``/update_weights_from_disk``
(``srt/managers/tokenizer_manager.py``: built once, in ``init_tokenizer_and_processor``).

The request side (schema, ranges, 400 bodies) lives in ``ckpteval.jobs.reference.serve.requests``; the engine
service (generation, aborts, pause, weight versions) in ``ckpteval.jobs.reference.serve.engine``; the
OpenAI-compatible ``/v1/completions`` in ``ckpteval.jobs.reference.serve.openai``; the HTTP routes in
``ckpteval.jobs.reference.serve.http``; this module holds the command line.
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
