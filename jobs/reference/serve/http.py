"""The HTTP routes of ``ckpteval serve`` (:mod:`ckpteval.jobs.reference.serve.main` lists each route, its body
and its answers as sglang 0.5.23 gives them): request parsing is
:mod:`~ckpteval.jobs.reference.serve.requests`', the work :class:`~ckpteval.jobs.reference.serve.engine.EngineService`'s,
the reports :mod:`~ckpteval.jobs.reference.serve.info`'s; this module maps one onto the other and writes
the status and body sglang would.

Limits: HTTP/1.1 with ``Content-Length`` bodies only (no chunked uploads, no streaming replies); a body
over :data:`MAX_BODY_BYTES` is refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ckpteval.jobs.eval.engines.base import EngineError
from ckpteval.jobs.reference.serve.engine import EngineService, Overloaded
from ckpteval.jobs.reference.serve.info import model_info, models, server_info
from ckpteval.jobs.reference.serve.openai import openai_completions
from ckpteval.jobs.reference.serve.requests import (
    BadRequest,
    ContractError,
    Refused,
    auth_status,
    error_body,
    parse_generate,
    parse_update,
)

MAX_BODY_BYTES = 64 * 1024 * 1024
PAUSE_MODES = ("abort", "retract", "in_place")


class Handler(BaseHTTPRequestHandler):
    """Routes requests to the :class:`EngineService` of its server."""

    server: EngineHTTPServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._route(
            {
                "/health": self._health,
                "/health_generate": self._health,
                "/model_info": self._model_info,
                "/get_model_info": self._model_info,
                "/server_info": self._server_info,
                "/get_server_info": self._server_info,
                "/weights_checker": self._weights_checker,
                "/v1/models": lambda: self._json(HTTPStatus.OK, models(self.server.service)),
            }
        )

    def do_POST(self) -> None:
        self._route(
            {
                "/generate": self._generate,
                "/update_weights_from_disk": self._update,
                "/update_weight_version": self._relabel,
                "/weights_checker": self._weights_checker,
                "/abort_request": self._abort,
                "/pause_generation": self._pause,
                "/continue_generation": self._continue,
                "/v1/completions": lambda: self._json(*openai_completions(self.server.service, self._body())),
            }
        )

    def do_PUT(self) -> None:
        self._route({"/generate": self._generate})

    def _route(self, routes: dict[str, Callable[[], None]]) -> None:
        path = self.path.split("?", 1)[0]
        keys = getattr(self.server, "api_keys", (None, None))
        if auth_status(path, self.headers.get("Authorization"), *keys) is not None:  # sglang's middleware: first
            self.close_connection = True
            self._json(HTTPStatus.UNAUTHORIZED, {"error": "Unauthorized"})
            return
        handler = routes.get(path)
        if handler is None:
            self.close_connection = True
            self._json(HTTPStatus.NOT_FOUND, {"detail": "Not Found"})  # FastAPI's 404
            return
        try:
            handler()
        except BadRequest as e:
            self.close_connection = True  # the body may be unread: do not reuse this connection
            self._json(HTTPStatus.BAD_REQUEST, error_body(str(e)))
        except ContractError as e:
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(e)})
        except Refused as e:
            self._json(HTTPStatus.BAD_REQUEST, {"error": {"message": str(e)}})

    # ---------------------------------------------------------------- endpoints
    def _generate(self) -> None:
        req = parse_generate(self._body())
        try:
            items = self.server.service.generate(req)
        except EngineError:
            self._text(HTTPStatus.INTERNAL_SERVER_ERROR, "Internal Server Error")  # Starlette's 500
            return
        except Overloaded as e:  # an abort with status 503, as an HTTPException (ErrorResponse, type "503")
            self._json(HTTPStatus.SERVICE_UNAVAILABLE,
                       {"object": "error", "message": str(e), "type": "503", "param": None, "code": 503})
            return
        self._json(HTTPStatus.OK, items if req.batched else items[0])

    def _update(self) -> None:
        path, version, abort_all = parse_update(self._body())
        success, message = self.server.service.update(path, version, abort_all)
        status = HTTPStatus.OK if success else HTTPStatus.BAD_REQUEST
        self._json(status, {"success": success, "message": message, "num_paused_requests": 0})

    def _relabel(self) -> None:
        body = self._body()
        version = body.get("new_version") if isinstance(body, dict) else None
        abort_all = body.get("abort_all_requests", True) if isinstance(body, dict) else True
        if not isinstance(version, str) or not isinstance(abort_all, bool):
            raise BadRequest("'new_version' (a string) is required; 'abort_all_requests' is a boolean")
        self.server.service.relabel(version, abort_all)
        self._json(
            HTTPStatus.OK, {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
        )

    def _weights_checker(self) -> None:
        body = self._body(default={"action": "checksum"})
        action = body.get("action", "checksum") if isinstance(body, dict) else None
        if not isinstance(action, str):
            raise BadRequest("'action' must be a string")
        try:
            self._json(HTTPStatus.OK, self.server.service.check_weights(action))
        except Refused as e:  # sglang: success false, HTTP 400
            self._json(HTTPStatus.BAD_REQUEST, {"success": False, "message": str(e)})

    def _abort(self) -> None:
        body = self._body()
        if not isinstance(body, dict) or not isinstance(body.get("rid", ""), str | None):
            raise BadRequest("'rid' must be a string")
        self.server.service.abort(body.get("rid") or "", bool(body.get("abort_all", False)))
        self._empty(HTTPStatus.OK)

    def _pause(self) -> None:
        body = self._body(default={})
        mode = body.get("mode", "abort") if isinstance(body, dict) else None
        if mode not in PAUSE_MODES:
            raise BadRequest(f"'mode' must be one of {list(PAUSE_MODES)}")
        self.server.service.pause(mode)
        self._json(HTTPStatus.OK, {"message": "Generation paused successfully.", "status": "ok"})

    def _continue(self) -> None:
        self._body(default={})
        self.server.service.resume()
        self._json(HTTPStatus.OK, {"message": "Generation continued successfully.", "status": "ok"})

    def _model_info(self) -> None:
        self._json(HTTPStatus.OK, model_info(self.server.service))

    def _server_info(self) -> None:
        self._json(HTTPStatus.OK, server_info(self.server.service))

    def _health(self) -> None:
        service = self.server.service
        ok = service.engine.model is not None and service.healthy()
        self._empty(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE)

    # ---------------------------------------------------------------- plumbing
    def _body(self, default: Any = None) -> Any:
        length = self.headers.get("Content-Length")
        if (length is None or length == "0") and default is not None:
            return default
        if length is None or not length.isdigit():
            raise BadRequest("a Content-Length header is required")
        if int(length) > MAX_BODY_BYTES:
            raise BadRequest(f"request body over {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except ValueError as e:
            raise BadRequest(f"JSON decode error: {e}") from e

    def _json(self, status: HTTPStatus, payload: Any) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _text(self, status: HTTPStatus, text: str) -> None:
        self._send(status, text.encode(), "text/plain; charset=utf-8")

    def _send(self, status: HTTPStatus, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
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
    api_keys: tuple[str | None, str | None] = (None, None)  # --api-key, --admin-api-key

    def __init__(self, address: tuple[str, int], service: EngineService, verbose: bool = False) -> None:
        self.service = service
        self.verbose = verbose
        super().__init__(address, Handler)
