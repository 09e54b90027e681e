"""`replay --out`'s copy of the recorded session: as recorded, once, and the recording only read."""

import hashlib
import sqlite3
from pathlib import Path

import pytest

from replay_proxy.store.copy import CopyError, copy_session

RECORDINGS = Path(__file__).parents[2] / "recordings"


def rows(db, sql):
    return sqlite3.connect(db).execute(sql).fetchall()


def test_the_copy_is_the_session_as_recorded_and_the_recording_is_only_read(tmp_path):
    source = RECORDINGS / "vllm-0.32.0-python.db"
    before = hashlib.sha256(source.read_bytes()).hexdigest()
    out = tmp_path / "replay.db"
    assert copy_session(source, "1", out) == "python-frontend"
    assert hashlib.sha256(source.read_bytes()).hexdigest() == before
    for sql in ("SELECT seq, ts_ns, kind, raw FROM frames ORDER BY seq",
                "SELECT request_id, seq, prompt_len, max_tokens FROM requests ORDER BY seq",
                "SELECT request_id, position, new_token_ids, finish_reason FROM outputs ORDER BY seq, position",
                "SELECT name, mode, vllm_version, status, frames_recorded FROM sessions"):
        assert rows(out, sql) == rows(source, sql), sql
    # A second replay into the same file finds its session there: nothing is copied again.
    size = out.stat().st_size
    assert copy_session(source, "python-frontend", out) == "python-frontend"
    assert rows(out, "SELECT COUNT(*) FROM sessions") == [(1,)] and out.stat().st_size == size


def test_a_file_holding_another_session_of_that_name_is_refused(tmp_path):
    out = tmp_path / "replay.db"
    copy_session(RECORDINGS / "vllm-0.32.0-python.db", "python-frontend", out)
    other = tmp_path / "other.db"
    other.write_bytes((RECORDINGS / "vllm-0.32.0-python.db").read_bytes())
    sqlite3.connect(other).execute("UPDATE sessions SET started_at = '2030-01-01T00:00:00'").connection.commit()
    with pytest.raises(CopyError, match="holds another session named 'python-frontend'"):
        copy_session(other, "python-frontend", out)
    with pytest.raises(CopyError, match="no session 'nope'"):
        copy_session(other, "nope", tmp_path / "new.db")
    assert not (tmp_path / "new.db").exists()
