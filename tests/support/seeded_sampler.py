"""A stand-in for sglang's ``/v1/completions`` in deterministic mode (``--enable-deterministic-inference``): a real
HTTP server that samples as sglang 0.5.23 does there, for tests without a GPU. It is not sglang.

What it follows: ``srt/entrypoints/openai/serving_completions.py`` passes the request's ``seed`` on as
``sampling_seed``; ``srt/sampling/sampling_batch_info.py`` gives a request without one the seed 42; and
``srt/layers/sampler.py`` ``multinomial_with_seed`` draws each token by Gumbel-max with noise from a hash of
(seed, the token's position, the vocabulary index) — so one prompt with one seed always gets one text. The
"model" here has uniform logits over :data:`VOCAB` words and the hash is BLAKE2b, not sglang's murmur3: only the
property under test (a function of seed and position, nothing else) is kept.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VOCAB = [f"w{i}" for i in range(50)]
DEFAULT_SEED = 42  # sampling_batch_info.py: a request without sampling_seed


def sample(seed: int, prompt: str, max_tokens: int) -> str:
    """The text a deterministic sglang would sample: Gumbel-max over uniform logits, noise from (seed, position)."""
    start = len(prompt.split())  # the position of the first generated token
    words = [VOCAB[max(range(len(VOCAB)), key=lambda i, pos=pos: gumbel(seed, pos, i))]
             for pos in range(start, start + max_tokens)]
    return " " + " ".join(words)


def gumbel(seed: int, position: int, index: int) -> float:
    """Gumbel noise from a uniform that is a hash of (seed, position, vocabulary index) only."""
    h = int.from_bytes(hashlib.blake2b(f"{seed}:{position}:{index}".encode(), digest_size=4).digest(), "little")
    x = min(max(h / 0xFFFFFFFF, 1e-12), 1 - 1e-12)
    return -math.log(-math.log(x))


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        seed = body.get("seed")
        seed = DEFAULT_SEED if seed is None else int(seed)
        greedy = float(body.get("temperature", 1.0)) == 0
        self.server.requests.append(body)  # type: ignore[attr-defined]
        choices = [{"index": i, "text": sample(0 if greedy else seed, p, int(body.get("max_tokens", 8))),
                    "finish_reason": "length"} for i, p in enumerate(prompts)]
        data = json.dumps({"object": "text_completion", "choices": choices}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def seeded_server() -> Iterator[tuple[str, list[dict]]]:
    """A running stand-in on 127.0.0.1: its base URL and the list of request bodies it received."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.requests = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", server.requests  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()
