"""Room kept on the database's filesystem for the end of a session.

A WAL-mode commit needs free space on the filesystem itself, which SQLite's own page cap
(``--max-db-mb``) does not keep: on a really full disk the last transaction, the one that says how the
session ended and what it counted, failed too, and the session stayed ``recording`` with no counts.
So ``RESERVE_BYTES`` are preallocated beside the database when a session begins, and given back just
before its end is written (``tables.begin_session`` and ``tables.end_session``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

RESERVE_BYTES = 8 * 2**20  # a session's last transactions need a few pages of WAL (and of its index)


def reserve_path(db_path: str | Path) -> Path:
    db_path = Path(db_path)
    return db_path.with_name(db_path.name + ".reserve")


def hold(db_path: str | Path) -> bool:
    """Preallocate the room (real blocks, not a sparse file); whether there was any. A filesystem that has
    none left already gets none: the session's end is then written if and when there is room (a rotation
    begins no file then, recorder/rotation/)."""
    path = reserve_path(db_path)
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        finally:
            os.close(fd)
    except OSError:
        release(db_path)
        return False
    return True


def release(db_path: str | Path) -> None:
    """Give the room back, for the session's end to be written (a no-op once it is)."""
    with contextlib.suppress(FileNotFoundError):
        reserve_path(db_path).unlink()
