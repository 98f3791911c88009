"""The judge's files in a run dir: the verdict cache (``RUN/judge_cache/``) and the published judge
endpoint (``RUN/judge.json``).

**Verdict cache.** One small JSON file per key, ``judge_cache/<k[:2]>/<k>.json``, where ``k`` is the
SHA-256 of the canonical JSON of the key parts (the judge's identity — model id read from the judge,
template hash, sampling settings — and the question, response and reference). It holds what the judge
*answered* (its raw reply text, or a reward model's number), not the verdict read from it, so changing
the verdict rule re-reads cached replies instead of paying the judge again.

Why one file per key, published first-writer-wins (:func:`ckpteval.coord.atomic.publish_exclusive`): many
workers on many nodes write concurrently on a shared filesystem; an appended JSONL would need one
writer per file (``O_APPEND`` is not atomic across NFS clients), a lock would be a hint at best, and a
per-unit file would not let a *different* unit (a backfill, two identical completions in different
shards) find a verdict. With a file per key, a writer never modifies anything another wrote: it links a
complete, fsync'd file under the final name or finds one already there (the same question judged twice
at once pays twice, once, and the first reply stays). The 256 two-hex-digit subdirectories keep
directories small (a 100k-verdict run has ~400 files per dir). Each entry costs one fsync (of the file,
before it is linked; the directory is not fsync'd: a name lost in a crash is only a cache miss).

Guarantee: a reader sees no entry or a complete one written by one writer; an entry never changes once
written, except one its reader found unreadable, which :meth:`VerdictCache.replace` writes over whole
(temp, fsync, rename). Limits: nothing is ever evicted (a verdict is a few hundred bytes; delete the dir
to drop the cache, never while workers run); a corrupt entry (a hand edit, a torn disk) is a
``ValueError`` naming the file, never a silent miss — the scorer reports it, asks the judge and replaces
it; a cache that cannot be written (read-only, full) is an ``OSError`` the scorer reports and bypasses;
on NFS a second client may miss an entry for its attribute-cache lifetime (it then pays the judge once
more and its copy is dropped).

**Published endpoint.** ``RUN/judge.json`` ``{"url", "model", "written_at", ...}``: where a judge
server launched for this run (``ckpteval submit train-eval --judge-model``) answers. Written whole
(temp + rename), last writer wins (a requeued job republishes its new address).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from pathlib import Path
from typing import Any

from ckpteval.coord.atomic import (
    dumps,
    fsync_dir,
    publish_exclusive,
    read_json_object,
    write_bytes_atomic,
    write_json_atomic,
)


def cache_key(parts: dict[str, Any]) -> str:
    """The hex SHA-256 of the canonical JSON (sorted keys, no spaces) of ``parts``."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()


JUDGE_SECRET = "judge_secret"  # RUN/judge_secret: 256 random bits, hex; the run's key for judge boundaries


def judge_secret(run_dir: Path) -> bytes:
    """The run's judge secret (``RUN/judge_secret``, created by the first caller, first writer wins): what a
    sample's quoting boundary is derived from, so a re-judge sends the same prompt and the policy, which never
    reads the run dir, cannot predict it. OSError when the run dir cannot hold it; ValueError when malformed."""
    path = Path(run_dir) / JUDGE_SECRET
    if not path.exists():
        publish_exclusive(path, secrets.token_hex(32).encode())
    text = path.read_text().strip()
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"{path}: not a judge secret (64 lowercase hex digits)")
    return bytes.fromhex(text)


def derive_boundary(secret: bytes, key: str) -> str:
    """A sample's quoting boundary (32 hex digits): HMAC-SHA256 of its verdict cache ``key`` under ``secret``."""
    return hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()[:32]


class VerdictCache:
    """The run's verdict cache: :meth:`get` a cached answer, :meth:`put` one first-writer-wins."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, key: str) -> Path:
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"verdict cache key {key!r} must be 64 lowercase hex digits")
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        """The cached entry of ``key`` (None: none yet); ValueError names a corrupt entry."""
        try:
            entry = read_json_object(self.path(key))
        except FileNotFoundError:
            return None
        if entry.get("key") != key or not isinstance(entry.get("answer"), dict):
            raise ValueError(f"{self.path(key)}: not a verdict cache entry for its name (fields key, answer)")
        return entry["answer"]

    def put(self, key: str, answer: dict[str, Any], parts: dict[str, Any]) -> bool:
        """Publish ``answer`` for ``key`` unless an entry exists; True if this call wrote it.

        ``parts`` (what was hashed) is stored beside it for audit (``key`` can be recomputed from it).
        """
        path, entry = self._prepare(key, answer, parts)
        return publish_exclusive(path, entry, sync_dir=False)  # a name lost in a crash is only a miss

    def replace(self, key: str, answer: dict[str, Any], parts: dict[str, Any]) -> None:
        """Write ``answer`` for ``key`` over an entry that could not be read (whole: temp, fsync, rename)."""
        path, entry = self._prepare(key, answer, parts)
        write_bytes_atomic(path, entry)

    def _prepare(self, key: str, answer: dict[str, Any], parts: dict[str, Any]) -> tuple[Path, bytes]:
        """The entry's path (its directory made) and bytes; OSError when the cache cannot be written."""
        path = self.path(key)
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
            fsync_dir(path.parent.parent)
        return path, dumps({"key": key, "answer": answer, "parts": parts, "written_at": time.time()})


def publish_judge(path: Path, url: str, model: str | None, **extra: Any) -> None:
    """Write ``RUN/judge.json``: the judge server's base URL (``.../v1``) and the model it serves."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{path}: judge url {url!r} must start with http:// or https://")
    write_json_atomic(path, {"url": url, "model": model, "written_at": time.time(), **extra})


def read_judge(path: Path) -> dict[str, Any] | None:
    """``RUN/judge.json`` (None while nothing is published); ValueError names a malformed file."""
    try:
        obj = read_json_object(path)
    except FileNotFoundError:
        return None
    if not isinstance(obj.get("url"), str) or not obj["url"].startswith(("http://", "https://")):
        raise ValueError(f"{path}: field url must be an http(s) URL string")
    return obj
