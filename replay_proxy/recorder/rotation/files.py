"""A rotating recording's files on disk: what the rotator is told about them."""

from __future__ import annotations

import time
from pathlib import Path

from replay_proxy.recorder.rotation.rotator import file_named

SIDE_FILES = ("-wal", "-shm")  # SQLite's beside a database in WAL mode


def first_file(pattern: str) -> Path:
    """The file a recording starts in: the pattern's strftime fields filled in now (it may exist: a session
    is added to it, as without rotation)."""
    return file_named(pattern, time.time())


def database_bytes(path: Path) -> int:
    """A recording's size on disk: the file and its write-ahead log."""
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists())


def holds_data(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 0


def remove(path: Path) -> None:
    """A database file and SQLite's files beside it."""
    for made in (path, *(path.with_name(path.name + end) for end in SIDE_FILES)):
        made.unlink(missing_ok=True)
