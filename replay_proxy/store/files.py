"""The SQLite files the project reads (recordings, matrix databases), opened so that reading never writes.

A file is checked before SQLite opens it (missing, a folder, empty, not SQLite,
cut short, or without the table its kind always has), each in one line that
names it. It is then opened read-only and, unless a writer may be live (a
``-wal`` beside it), immutable: SQLite reads the main file alone and makes no
``-wal`` or ``-shm`` file, which a read-only connection to a WAL file would
otherwise leave behind, so a read-only mount works.
"""

from __future__ import annotations

import sqlite3
import urllib.parse
from pathlib import Path

from replay_proxy.errors import ReplayProxyError


class NotReadable(ReplayProxyError):
    """A file given as a recording (or a matrix database) that is none: missing, a folder, empty, cut short,
    not SQLite, or another application's SQLite file."""


def open_read_only(path: Path, kind: str, table: str) -> sqlite3.Connection:
    """The SQLite file at ``path``, a ``kind`` (recording, matrix database) and so holding ``table``, on a
    connection that cannot write to it; else ``NotReadable`` with the one-line reason."""
    if not path.exists():
        raise NotReadable(f"no {kind} at {path}")
    if path.is_dir():
        raise NotReadable(f"{path} is a folder, not a {kind}")
    _check_header(path, kind)
    live = Path(f"{path}-wal").exists()  # (a WAL file's -wal is gone once its last writer has closed it)
    uri = f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro{'' if live else '&immutable=1'}"
    connection = sqlite3.connect(uri, uri=True, timeout=30)
    try:
        if not connection.execute("SELECT 1 FROM sqlite_master WHERE name = ?", [table]).fetchone():
            raise NotReadable(f"{path} is not a {kind}: a SQLite file without a {table} table")
    except sqlite3.DatabaseError as exc:
        connection.close()
        raise NotReadable(f"{path} is not a {kind}: {exc}") from None
    except NotReadable:
        connection.close()
        raise
    return connection


def _check_header(path: Path, kind: str) -> None:
    """A SQLite file's first 100 bytes: its magic, and its length as the header counts it (a copy cut short
    reads well until a query reaches a missing page, then fails as "malformed")."""
    size = path.stat().st_size
    with path.open("rb") as file:
        header = file.read(100)
    if size == 0:
        raise NotReadable(f"{path} is empty, not a {kind}")
    if len(header) < 100 or not header.startswith(b"SQLite format 3\0"):
        raise NotReadable(f"{path} is not a {kind}: not a SQLite file")
    page_bytes = int.from_bytes(header[16:18], "big")
    page_bytes = 65536 if page_bytes == 1 else page_bytes
    pages, counter, valid_for = (int.from_bytes(header[i:i + 4], "big") for i in (28, 24, 92))
    if pages and counter == valid_for and size < pages * page_bytes:
        raise NotReadable(f"{path} is truncated: {size:,} of its {pages * page_bytes:,} bytes (a copy cut short?)")
