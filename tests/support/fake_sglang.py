"""A slow-starting stand-in for ``python -m sglang.launch_server``, for launch tests without a GPU.

sglang itself needs a GPU; what the launch tests need is a real process group that takes a while before
``/health_generate`` answers (sglang answers 503 while ``ServerStatus.Starting``:
``srt/entrypoints/http_server.py`` ``health_generate``) and then serves the routes the client reads first:
``/server_info`` ``version``, ``/model_info`` ``weight_version`` (``--weight-version``). :func:`install`
writes an ``sglang`` package (this launcher only) and its ``.dist-info`` (what the engine's
installed-version check reads) under a directory to put on the child's ``PYTHONPATH``.
"""

from __future__ import annotations

from pathlib import Path

DELAY_ENV = "FAKE_SGLANG_DELAY_FILE"  # a file holding the seconds before the fake server listens

LAUNCH_SERVER = '''
import argparse, json, os, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--model-path"); parser.add_argument("--host"); parser.add_argument("--port", type=int)
parser.add_argument("--weight-version", default="default")
args, _ = parser.parse_known_args()
with open(os.environ["DELAY_ENV"]) as f:
    time.sleep(float(f.read()))  # loading weights, capturing graphs, warming up

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        routes = {"/health_generate": None, "/server_info": {"version": "0.5.23"},
                  "/model_info": {"model_path": args.model_path, "weight_version": args.weight_version}}
        if self.path not in routes:
            return self._send(404, {"detail": "Not Found"})
        self._send(200, routes[self.path])

    def _send(self, status, body):
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass

ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
'''.replace("DELAY_ENV", DELAY_ENV)


def install(root: Path, delay_file: Path, version: str = "0.5.23") -> dict[str, str]:
    """Write the fake ``sglang`` (launcher + metadata) under ``root``; the env a launch needs to see it.
    Each launch sleeps the seconds written in ``delay_file`` (read at its start) before it listens."""
    info = root / f"sglang-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    package = root / "sglang"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(LAUNCH_SERVER)
    return {"PYTHONPATH": str(root), "CUDA_VISIBLE_DEVICES": "0", DELAY_ENV: str(delay_file)}
