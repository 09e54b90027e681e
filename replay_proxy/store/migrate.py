"""``replay-proxy migrate``: a recording made by an older release brought to this one's layout, in place, and
compacted.

Every command that writes a recording migrates it as far as writing needs
(``tables.ensure_schema``: tables and columns added), and every command that
reads one reads an older file through this layout without writing a byte.
Neither rewrites what the file holds; this command, asked for, does: the
frames' bytes of a file of layout 3 or before move from ``frames.raw`` into
compressed batches (``raw.py``), ``MIGRATE_FRAMES`` at a time, each move one
transaction that writes the batch and blanks what it holds (so a migration
stopped half-way leaves a file read as a whole, and is taken up again), then
the old columns are dropped and the file is vacuumed.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from replay_proxy.errors import ReplayProxyError
from replay_proxy.store import raw
from replay_proxy.store.tables import LEGACY_BYTES, open_database, read_recording

MIGRATE_FRAMES = 4096  # frames a batch of a migrated file holds: a transaction of a few MB


class MigrateError(ReplayProxyError):
    """A recording that cannot be migrated now (a session is still being recorded into it)."""


def migrate(path: Path) -> tuple[int, int]:
    """Bring the recording at ``path`` to this release's layout and compact it; its size before and after, in
    bytes (its write-ahead log included)."""
    read_recording(path).close()  # a recording, or one line saying what the file is instead
    before = _size(path)
    with contextlib.closing(open_database(path)) as db:
        live = [name for (name,) in db.execute("SELECT name FROM sessions WHERE status = 'recording'")]
        if live:
            raise MigrateError(f"{path}: session {live[0]!r} is still being recorded (its status is 'recording'); "
                               "migrate it once its recorder has stopped")
        if set(LEGACY_BYTES) <= set(db["frames"].columns_dict):
            for (session_id,) in db.execute("SELECT id FROM sessions ORDER BY id").fetchall():
                while chunk := db.execute("SELECT seq, raw, forwarded_raw FROM frames WHERE session_id = ? AND raw "
                                          "IS NOT NULL ORDER BY seq LIMIT ?", [session_id, MIGRATE_FRAMES]).fetchall():
                    batch = raw.pack(session_id, [seq for seq, _, _ in chunk],
                                     [raw.item(seq, raw.parts(sent), forwarded and raw.parts(forwarded))
                                      for seq, sent, forwarded in chunk])
                    with db.conn:
                        db.execute("INSERT INTO frame_batches VALUES (?, ?, ?, ?, ?)", batch)
                        db.execute("UPDATE frames SET raw = NULL, forwarded_raw = NULL WHERE session_id = ? AND "
                                   "seq BETWEEN ? AND ?", [session_id, batch.first_seq, batch.last_seq])
            with db.conn:
                for column in LEGACY_BYTES:
                    db.execute(f"ALTER TABLE frames DROP COLUMN {column}")
        db.execute("VACUUM")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return before, _size(path)


def _size(path: Path) -> int:
    wal = path.with_name(path.name + "-wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)
