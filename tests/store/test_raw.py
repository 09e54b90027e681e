"""The frames' bytes in compressed batches (store/raw.py): every frame read back byte for byte, in seq order, from
small batches merged, from batches that overlap, from an older file's ``frames.raw``, after a migration stopped
half-way, and after the writer is SIGKILLed mid-write."""

import contextlib
import hashlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_proxy.store import migrate as migrating
from replay_proxy.store import raw
from replay_proxy.store.raw import frame_bytes, frames_with_bytes
from replay_proxy.store.tables import SCHEMA_VERSION, begin_session, open_database
from replay_proxy.store.writer import WAL_BYTES, Writer
from replay_proxy.wire.capture import CapturedFrame
from replay_proxy.wire.messages import Channel, Direction
from tests.helpers import ROOT, cli, frame

LEGACY = ROOT / "recordings" / "demo.db"  # a recording of layout 3, its frames' bytes in frames.raw


def parts_of(seq):
    """A frame's parts, made from its seq (so that any frame read back can be checked against it): mostly what the
    frames of one stream share, as on the wire, and a little of their own."""
    return [bytes([1]), b"num_running_reqs kv_cache_usage " * (1 + seq % 5) + hashlib.sha256(bytes(seq)).digest()[:8]]


def written(db, seqs_by_transaction, forwarded=frozenset()):
    """A session whose frames ``seqs_by_transaction`` are written by a writer, a transaction each; its id."""
    session_id, _ = begin_session(db, {"name": "quiet", "mode": "record", "status": "recording"})
    writer = Writer(str(db), session_id)
    for seqs in seqs_by_transaction:
        writer.write_frames([CapturedFrame(seq, seq, Channel.INPUT, Direction.TO_ENGINE, 0, 0, parts_of(seq),
                                           [b"sent on"] if seq in forwarded else None) for seq in seqs])
    writer.connection.close()
    return session_id


def test_a_quiet_sessions_small_batches_are_merged_and_every_frame_reads_back_as_it_crossed(tmp_path):
    db = tmp_path / "r.db"
    session_id = written(db, [range(start, start + 7) for start in range(1, 301, 7)], forwarded={5, 280})
    connection = sqlite3.connect(db)
    batches = connection.execute("SELECT frames FROM frame_batches ORDER BY first_seq").fetchall()
    # 43 transactions of 7 frames: the first 37 merged once they held 256 together, the 6 after them not yet
    assert [frames for (frames,) in batches] == [259] + [7] * 6
    read = list(frame_bytes(connection, session_id))
    assert [f.seq for f in read] == list(range(1, 302)) and all(f.parts == parts_of(f.seq) for f in read)
    assert [f.seq for f in read if f.forwarded is not None] == [5, 280]
    assert [f.seq for f in frame_bytes(connection, session_id, {3, 260, 301})] == [3, 260, 301]
    # Compressed across frames: the 301 frames take a fraction of their bytes.
    stored = connection.execute("SELECT SUM(LENGTH(data)) FROM frame_batches").fetchone()[0]
    assert stored < 0.2 * sum(len(b"".join(parts_of(seq))) for seq in range(1, 302))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 400), min_size=1, max_size=60, unique=True).flatmap(
    lambda seqs: st.tuples(st.just(seqs), st.lists(st.integers(0, 4), min_size=len(seqs), max_size=len(seqs)),
                           st.sets(st.sampled_from(seqs)))))
def test_batches_that_overlap_are_read_in_seq_order(case):
    seqs, batch_of, wanted = case
    connection = sqlite3.connect(":memory:")
    connection.execute("CREATE TABLE frame_batches (session_id, first_seq, last_seq, frames, data)")
    connection.execute("CREATE TABLE frames (session_id, seq)")
    for number in set(batch_of):
        mine = [seq for seq, b in zip(seqs, batch_of) if b == number]
        connection.execute("INSERT INTO frame_batches VALUES (?, ?, ?, ?, ?)",
                           raw.pack(1, mine, [raw.item(seq, parts_of(seq), None) for seq in mine]))
    assert [f.seq for f in frame_bytes(connection, 1)] == sorted(seqs)
    assert [f.seq for f in frame_bytes(connection, 1, wanted)] == sorted(wanted)


def test_an_older_file_written_on_is_read_from_both_places(tmp_path):
    """A file of layout 3 that a writer takes up (``decode``, a replay's --out): its earlier frames' bytes stay in
    frames.raw, the new ones go into batches, and a read gives both, in order."""
    db = shutil.copy(LEGACY, tmp_path / "older.db")
    before = [(r["seq"], r["parts"]) for r in frames_with_bytes(sqlite3.connect(db))]
    open_database(db).close()
    connection = sqlite3.connect(db)
    after = max(seq for seq, _ in before) + 1
    connection.execute("INSERT INTO frame_batches VALUES (?, ?, ?, ?, ?)",
                       raw.pack(1, [after], [raw.item(after, parts_of(after), None)]))
    connection.commit()
    assert [(f.seq, f.parts) for f in frame_bytes(connection, 1)] == [*before, (after, parts_of(after))]


def test_migrate_moves_the_bytes_and_a_migration_stopped_half_way_loses_nothing(tmp_path, monkeypatch):
    db = shutil.copy(LEGACY, tmp_path / "older.db")
    before = [(r["session_id"], r["seq"], r["parts"], r["forwarded"]) for r in frames_with_bytes(sqlite3.connect(db))]
    assert any(forwarded for *_, forwarded in before)  # (the INIT the proxy rewrote)
    packed = raw.pack
    calls = []

    def stopped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return packed(*args, **kwargs)

    monkeypatch.setattr(migrating, "MIGRATE_FRAMES", 10)
    monkeypatch.setattr(raw, "pack", stopped)
    with pytest.raises(KeyboardInterrupt):
        migrating.migrate(db)
    with contextlib.closing(sqlite3.connect(db)) as half:
        assert half.execute("SELECT COUNT(*) FROM frame_batches").fetchone()[0] == 2
        assert [(r["session_id"], r["seq"], r["parts"], r["forwarded"]) for r in frames_with_bytes(half)] == before
    monkeypatch.setattr(raw, "pack", packed)
    size, migrated = migrating.migrate(db)
    with contextlib.closing(sqlite3.connect(db)) as done:
        assert [(r["session_id"], r["seq"], r["parts"], r["forwarded"]) for r in frames_with_bytes(done)] == before
        assert "raw" not in {row[1] for row in done.execute("PRAGMA table_info(frames)")}
        assert done.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert migrated < size


def test_migrate_refuses_a_file_still_being_recorded_into(tmp_path):
    db = tmp_path / "live.db"
    begin_session(db, {"name": "live", "mode": "record", "status": "recording"})
    before = db.read_bytes()
    done = cli("migrate", "--db", str(db))
    assert (done.returncode, done.stderr.count("\n")) == (1, 1) and "'live' is still being recorded" in done.stderr
    assert db.read_bytes() == before


KILLED_WRITER = """
import sys
from tests.store.test_raw import written
written(sys.argv[1], ([seq] for seq in range(1, 10**9)))
"""


def test_a_writer_killed_mid_write_leaves_every_frame_it_committed_with_its_bytes(tmp_path):
    db = tmp_path / "killed.db"
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(db)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _merged(db) < 3:  # past a few merges, a frame a transaction
            time.sleep(0.05)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    with contextlib.closing(sqlite3.connect(db)) as connection:
        rows = [seq for (seq,) in connection.execute("SELECT seq FROM frames ORDER BY seq")]
        read = list(frame_bytes(connection, 1))
    assert _merged(db) >= 3 and rows == list(range(1, len(rows) + 1))
    assert [f.seq for f in read] == rows and all(f.parts == parts_of(f.seq) for f in read)


def _merged(db):
    if not db.exists():
        return 0
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as connection:
        with contextlib.suppress(sqlite3.OperationalError):  # (not made yet)
            return connection.execute("SELECT COUNT(*) FROM frame_batches WHERE frames >= ?",
                                      [raw.BATCH_FRAMES]).fetchone()[0]
    return 0


def test_the_write_ahead_log_stays_near_its_megabyte_however_much_is_written(tmp_path):
    """SQLite's own checkpoint, at 4 MB of log, was most of what a busy recording took on disk early on."""
    db = tmp_path / "r.db"
    session_id, _ = begin_session(db, {"name": "busy", "mode": "record", "status": "recording"})
    writer = Writer(str(db), session_id)
    seq = 0
    for _ in range(40):  # 12 MB of frames that do not compress, 300 KB a transaction
        frames = []
        for _ in range(75):
            seq += 1
            frames.append(CapturedFrame(seq, seq, Channel.INPUT, Direction.TO_ENGINE, 0, 0, [os.urandom(4096)]))
        writer.write_frames(frames)
    wal = db.with_name(db.name + "-wal").stat().st_size
    assert db.stat().st_size > 12 * 2**20 and wal <= 2 * WAL_BYTES, wal
    writer.connection.close()


def test_a_frame_helper_frame_is_stored_like_any_other(tmp_path):
    db = tmp_path / "r.db"
    session_id, _ = begin_session(db, {"name": "one", "mode": "record", "status": "recording"})
    writer = Writer(str(db), session_id)
    writer.write_frames([frame(1)])
    writer.connection.close()
    [row] = frames_with_bytes(sqlite3.connect(db))
    assert (row["kind"], row["parts"], row["forwarded"]) == ("ABORT", frame(1).parts, None)
