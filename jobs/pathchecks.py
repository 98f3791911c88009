"""Paths a flag names, checked before a program writes anything: every failure one ValueError (or
FileNotFoundError) naming the flag, the path and what is wrong, so a bad path fails at start instead of
half-way. Limits: a check is a moment's view — the filesystem can change after it (a dir removed, a disk
filled); :func:`make_dir_writable` is the one that proves a write.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def check_watch_dir(path: Path | str) -> None:
    """``--watch DIR`` must be an existing directory: a missing one would be polled forever in silence
    (a typo, or a trainer that has not made its output dir yet). ValueError names the dir and the fix."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"--watch {path}: no such directory (a typo? if the trainer has not created it yet, "
                         f"mkdir -p {path} first)")
    if not path.is_dir():
        raise ValueError(f"--watch {path}: not a directory")


def check_dir_creatable(flag: str, path: Path | str) -> None:
    """``path`` is a directory this user can write, or can be created: ValueError naming ``flag`` if not.

    Checked before a program writes anything, so a bad path fails at start instead of half-way.
    """
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a directory")
    probe = target
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{flag} {path}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {probe} is not writable by this user")


def make_dir_writable(flag: str, path: Path | str) -> Path:
    """Create ``path`` (and its parents) and prove a file can be written in it: ValueError naming ``flag``
    if not. For a directory a program is about to fill: run once every check has passed and before the
    first file that names it is written, so a filesystem that refuses it (``/proc``, read-only, full)
    fails in one line with nothing else written. :func:`check_dir_creatable` cannot see this as root,
    whom ``access()`` lets write everywhere. Limit: a created dir stays, empty."""
    target = Path(path).expanduser()
    try:
        target.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".ckpteval-probe-", dir=target)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create or write it ({e.strerror or e})") from None
    return target


def check_file_readable(flag: str, path: Path | str) -> None:
    """``path`` is a regular file this user can read: FileNotFoundError/ValueError naming ``flag`` if not."""
    target = Path(path).expanduser()
    if not target.exists():
        raise FileNotFoundError(f"{flag} {path}: no such file")
    if not target.is_file():
        raise ValueError(f"{flag} {path}: not a regular file")
    if not os.access(target, os.R_OK):
        raise ValueError(f"{flag} {path}: not readable by this user")
