"""API keys for sglang servers started with ``--api-key`` / ``--admin-api-key``, from the environment only.

sglang 0.5.23 checks ``Authorization: Bearer <key>`` per route level (``srt/utils/auth.py``
``decide_request_auth``; levels set by ``@auth_level`` in ``srt/entrypoints/http_server.py``):

- ``/health*`` is always open (so the health probe sends nothing);
- *normal* routes (``/generate``, ``/model_info``, ``/server_info``, ``/v1/models``, ...) need the
  ``--api-key`` when the server has one, and are open otherwise;
- *admin-optional* routes (:data:`ADMIN_ROUTES`: weight updates, ``/weights_checker``, LoRA loads,
  aborts, pause) need the ``--admin-api-key`` when the server has one, else its ``--api-key``.

Promises: the keys come from :data:`API_KEY_ENV` and :data:`ADMIN_API_KEY_ENV` (never from run.json or a
flag, so they are never written into the run dir, a result or a log line); :func:`auth_headers` picks the
key each route needs; a 401 is :class:`Unauthorized`, a message naming the variables and never the key.
Limits: an engine that launches sglang does not pass the keys to it (add ``--api-key`` to the server
yourself); a key changed in the environment after the engine was built is not seen.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ckpteval.jobs.eval.engines.base import EngineError

API_KEY_ENV = "CKPTEVAL_SGLANG_API_KEY"
ADMIN_API_KEY_ENV = "CKPTEVAL_SGLANG_ADMIN_API_KEY"
# http_server.py routes marked @auth_level(AuthLevel.ADMIN_OPTIONAL) that ckpteval calls
ADMIN_ROUTES = frozenset({
    "/update_weights_from_disk", "/update_weight_version", "/weights_checker", "/load_lora_adapter",
    "/unload_lora_adapter", "/abort_request", "/pause_generation", "/continue_generation",
})  # fmt: skip


class Unauthorized(EngineError):
    """The server answered 401: it wants a key this engine was not given (a configuration error: a
    restart does not help)."""

    restart_helps = False


@dataclass(frozen=True, repr=False)
class ApiKeys:
    """The keys to send (``None``: not set). ``repr`` hides them."""

    api_key: str | None = None
    admin_api_key: str | None = None

    def __repr__(self) -> str:
        return f"ApiKeys(api_key={'set' if self.api_key else None}, admin_api_key={'set' if self.admin_api_key else None})"


def keys_from_env(env: Mapping[str, str] | None = None) -> ApiKeys:
    """:data:`API_KEY_ENV` / :data:`ADMIN_API_KEY_ENV` (empty counts as unset)."""
    env = os.environ if env is None else env
    return ApiKeys(env.get(API_KEY_ENV) or None, env.get(ADMIN_API_KEY_ENV) or None)


def auth_headers(path: str, keys: ApiKeys) -> dict[str, str]:
    """The ``Authorization`` header a request to ``path`` needs (module docstring), or none."""
    if path.startswith("/health"):
        return {}
    key = (keys.admin_api_key or keys.api_key) if path in ADMIN_ROUTES else keys.api_key
    return {"Authorization": f"Bearer {key}"} if key else {}


def unauthorized(method: str, url: str, keys: ApiKeys) -> Unauthorized:
    """The error for a 401 (names the variables and which are set, never a key)."""
    return Unauthorized(
        f"{method} {url}: HTTP 401 Unauthorized: the server was started with --api-key/--admin-api-key; set "
        f"{API_KEY_ENV} (normal routes) and {ADMIN_API_KEY_ENV} (weight loads, LoRA, aborts) in the worker's "
        f"environment ({keys!r})"
    )
