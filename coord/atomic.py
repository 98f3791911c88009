"""Atomic files on a shared filesystem.

Guarantee: a reader sees either no file or the complete file written by one writer — never a torn
one — because every file is written under a temporary name in the *same* directory, fsync'd,
renamed over the final name, and the directory is fsync'd so the rename survives a crash.

JSON: every encoder here refuses NaN and ±Infinity (``allow_nan=False``: a ValueError, never a bare ``NaN``
that strict parsers reject). Where a non-finite number is a legitimate value (a statistic over too few
samples), the writer states its form: :func:`tag_nonfinite` / :func:`untag_nonfinite` (``{"nonfinite":
"nan" | "inf" | "-inf"}``, an exact round trip) or a documented ``null``.

Limits: two writers racing for one name both succeed and the last rename wins (use
:func:`publish_exclusive` where the *first* writer must win). On NFS/Lustre the rename is atomic
per client, but another client may see the old name for its attribute-cache lifetime.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import uuid
from pathlib import Path
from typing import Any

TMP_PREFIX = ".tmp-"


def tmp_name(final: Path) -> Path:
    """A unique temporary sibling of ``final`` (readers ignore names starting with ``.tmp-``)."""
    return final.with_name(f"{TMP_PREFIX}{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")


def fsync_dir(path: Path, *, keep_open: bool = False) -> None:
    """Make a directory's entries (creates, renames, unlinks) durable.

    ``keep_open``: keep the directory's descriptor open in this process (at most :data:`DIR_FDS_KEPT`, the
    oldest closed first) and fsync through it next time: for the few directories a worker publishes into
    once per unit, it spares an open and a close per unit (each a metadata round trip on Lustre). Only for
    directories the protocol never replaces (``results/``): an fsync through the descriptor of a directory
    removed and re-created under the same name would sync the old one.
    """
    if keep_open:
        fd = _kept_dir_fd(str(path))
        os.fsync(fd)
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


DIR_FDS_KEPT = 32
_DIR_FDS: dict[str, int] = {}  # path -> open O_DIRECTORY descriptor, oldest first


def _kept_dir_fd(path: str) -> int:
    fd = _DIR_FDS.pop(path, None)
    if fd is None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        while len(_DIR_FDS) >= DIR_FDS_KEPT:
            os.close(_DIR_FDS.pop(next(iter(_DIR_FDS))))
    _DIR_FDS[path] = fd  # most recently used last
    return fd


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp name, fsync, rename, fsync dir)."""
    path = Path(path)
    tmp = tmp_name(path)
    try:
        _write_synced(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def dumps(obj: Any) -> bytes:
    """The one JSON encoding used for protocol files (sorted keys, UTF-8, trailing newline); ValueError on
    NaN or ±Infinity anywhere in ``obj``."""
    return (json.dumps(obj, sort_keys=True, indent=1, allow_nan=False) + "\n").encode()


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (ValueError naming ``path`` on a non-finite number)."""
    try:
        data = dumps(obj)
    except ValueError as e:
        raise ValueError(f"{path}: not written: {e} (NaN/Infinity are not JSON)") from None
    write_bytes_atomic(path, data)


NONFINITE = "nonfinite"
_NONFINITE_NAMES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def tag_nonfinite(obj: Any) -> Any:
    """``obj`` with every NaN/±inf float replaced by ``{"nonfinite": "nan" | "inf" | "-inf"}`` (tuples
    become lists, as JSON has them): what a strict encoder can write, undone by :func:`untag_nonfinite`."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return {NONFINITE: "nan" if math.isnan(obj) else "inf" if obj > 0 else "-inf"}
    if isinstance(obj, dict):
        return {k: tag_nonfinite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [tag_nonfinite(v) for v in obj]
    return obj


def untag_nonfinite(obj: Any) -> Any:
    """The inverse of :func:`tag_nonfinite` (a one-key ``{"nonfinite": name}`` object becomes the float)."""
    if isinstance(obj, dict):
        if len(obj) == 1 and obj.get(NONFINITE) in _NONFINITE_NAMES:
            return _NONFINITE_NAMES[obj[NONFINITE]]
        return {k: untag_nonfinite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [untag_nonfinite(v) for v in obj]
    return obj


def publish_exclusive(path: Path, data: bytes, *, sync_dir: bool = True, keep_dir_open: bool = False) -> bool:
    """Publish ``data`` at ``path`` only if nothing is there yet; True if this call won.

    The file is complete before it becomes visible (written and fsync'd under a temp name, then moved to
    the final name by ``renameat2(RENAME_NOREPLACE)`` — one metadata operation — or, where the filesystem
    or C library lacks it, hard-linked and the temp name unlinked; both fail if the name exists). The first
    writer wins; a later one gets False and leaves the first file untouched. ``sync_dir=False`` skips the
    directory fsync: for a cache, whose entry lost in a crash is only a miss (the name never points to a
    torn file). ``keep_dir_open``: the directory fsync goes through a kept descriptor (:func:`fsync_dir`).
    """
    path = Path(path)
    tmp = tmp_name(path)
    try:
        _write_synced(tmp, data)
        won = _rename_noreplace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if won is None:  # no renameat2 here: link, which also refuses an existing name
        try:
            os.link(tmp, path)
            won = True
        except FileExistsError:
            won = False
        finally:
            tmp.unlink(missing_ok=True)
    elif not won:
        tmp.unlink(missing_ok=True)
    if won and sync_dir:
        fsync_dir(path.parent, keep_open=keep_dir_open)
    return won


_RENAME_NOREPLACE = 1  # linux/fs.h
_AT_FDCWD = -100
_NO_RENAMEAT2: set[str] = set()  # directories whose filesystem refused the flag (asked once each)


def _rename_noreplace(src: Path, dst: Path) -> bool | None:
    """Rename ``src`` to ``dst`` unless ``dst`` exists: True renamed, False it exists, None unsupported (no
    ``renameat2`` in the C library, or the filesystem refuses the flag: EINVAL/ENOSYS/EOPNOTSUPP)."""
    parent = str(dst.parent)
    if _renameat2 is None or parent in _NO_RENAMEAT2:
        return None
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        return False
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        _NO_RENAMEAT2.add(parent)
        return None
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def _load_renameat2() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28 (or not Linux)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


def append_line(path: Path, line: bytes) -> None:
    """Append one whole line with a single ``write`` (O_APPEND) and fsync it.

    On a local filesystem concurrent appenders never interleave within a line; on NFS O_APPEND is
    not atomic across clients, so protocol files appended this way have one writer each.
    """
    if not line.endswith(b"\n"):
        raise ValueError(f"{path}: an appended line must end with a newline")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def append_and_count_lines(path: Path, line: bytes) -> int:
    """Append one whole line (a single O_APPEND ``write``) and return the file's line count, read through the
    same descriptor: one open in all (each open is a metadata round trip on Lustre).

    Not fsync'd: for counters whose line lost in a crash only lets one more attempt happen (a claim count);
    use :func:`append_line` for records that must survive. One writer at a time (see :func:`append_line`).
    """
    if not line.endswith(b"\n"):
        raise ValueError(f"{path}: an appended line must end with a newline")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, line)
        raw = b""
        while chunk := os.pread(fd, 1 << 16, len(raw)):
            raw += chunk
    finally:
        os.close(fd)
    return raw.count(b"\n")


def read_lines_file(path: Path, repair: bool) -> tuple[bytes, int]:
    """The complete lines of an append-only file and the length of a torn tail (a crash mid-append).

    With ``repair`` (the file's one writer, on open) the tail is truncated away and fsync'd; without
    it (a reader of a live file, which may see an append half-arrived) the tail is only ignored.
    A missing file reads as empty.
    """
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return b"", 0
    good_end = raw.rfind(b"\n") + 1
    torn = len(raw) - good_end
    if torn and repair:
        with open(path, "r+b") as f:
            f.truncate(good_end)
            os.fsync(f.fileno())
    return raw[:good_end], torn


UTF8_BOM = b"\xef\xbb\xbf"


def parse_jsonl(raw: bytes, path: Path, what: str = "JSON line") -> list[tuple[int, dict[str, Any]]]:
    """``[(lineno, record)]`` of JSONL bytes: blank lines skipped, a leading UTF-8 BOM (what some editors
    write) ignored, every other line a JSON object or ``ValueError`` naming ``path:line`` — a file that is
    one JSON array (``[{...}, {...}]``) is named as such, with the fix."""
    if raw.startswith(UTF8_BOM):
        raw = raw[len(UTF8_BOM):]
    records = []
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        if lineno == 1 and line.lstrip().startswith(b"["):
            raise ValueError(f"{path}: a JSON array, not JSONL: write one JSON object per line, no brackets")
        try:
            rec = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}:{lineno}: malformed {what} ({e})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
        records.append((lineno, rec))
    return records


def read_jsonl_numbered(
    path: Path, *, repair: bool = False, what: str = "JSON line"
) -> tuple[list[tuple[int, dict[str, Any]]], int]:
    """The one JSONL reader of the protocol files (ledgers, metrics): ``([(lineno, record)], torn_bytes)``.

    Policy, the same for every append-only JSONL file:

    - a missing file reads as empty; blank lines are skipped;
    - the bytes after the last newline are a *torn tail* (a crash mid-append, or an append still
      arriving on a shared filesystem): never parsed. With ``repair`` (only the file's one writer,
      on open) the tail is truncated away; a reader only ignores it (:func:`read_lines_file`);
    - every complete line must be a JSON object (:func:`parse_jsonl`): a malformed one, anywhere, is
      ``ValueError`` naming ``path:line`` and ``what`` it is — never silently skipped, because a
      complete line was written whole.
    """
    raw, torn = read_lines_file(path, repair=repair)
    return parse_jsonl(raw, path, what), torn


def read_jsonl_file(path: Path, what: str = "JSON line") -> list[tuple[int, dict[str, Any]]]:
    """A complete JSONL file a person wrote (an eval set): like :func:`read_jsonl_numbered` but the last
    line needs no newline (no writer is appending, so nothing is torn) and a missing file is
    ``FileNotFoundError`` naming it."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    return parse_jsonl(raw, path, what)


def read_jsonl(path: Path, *, repair: bool = False, what: str = "JSON line") -> list[dict[str, Any]]:
    """The records of a JSONL protocol file, under :func:`read_jsonl_numbered`'s torn-tail policy."""
    return [rec for _lineno, rec in read_jsonl_numbered(path, repair=repair, what=what)[0]]


def read_json(path: Path) -> Any:
    """Read a JSON protocol file; a missing file is FileNotFoundError, a malformed one ValueError.

    Both errors name the path. There is never a silent default.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: malformed JSON ({e})") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """Like :func:`read_json` but the top level must be a JSON object."""
    obj = read_json(path)
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj
