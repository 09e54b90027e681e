"""`replay --out`'s copy of the recorded session: as recorded, once, and the recording only read."""

import hashlib
import sqlite3
from pathlib import Path

import pytest

from replay_proxy.store.copy import CopyError, copy_session, redact_database
from replay_proxy.store.raw import frames_with_bytes

RECORDINGS = Path(__file__).parents[2] / "recordings"


def rows(db, sql):
    return sqlite3.connect(db).execute(sql).fetchall()


def test_the_copy_is_the_session_as_recorded_and_the_recording_is_only_read(tmp_path):
    source = RECORDINGS / "vllm-0.32.0-python.db"
    before = hashlib.sha256(source.read_bytes()).hexdigest()
    out = tmp_path / "replay.db"
    assert copy_session(source, "1", out) == "python-frontend"
    assert hashlib.sha256(source.read_bytes()).hexdigest() == before
    assert [(r["seq"], r["ts_ns"], r["kind"], r["parts"]) for r in frames_with_bytes(sqlite3.connect(out))] == [
        (r["seq"], r["ts_ns"], r["kind"], r["parts"]) for r in frames_with_bytes(sqlite3.connect(source))]
    for sql in ("SELECT request_id, seq, prompt_len, max_tokens FROM requests ORDER BY seq",
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


def test_a_copy_or_a_cut_of_a_redacted_session_says_it_is_redacted(tmp_path):
    """A replay judges a redacted session by scoring, not by its pseudonymous tokens: a copy (replay --out)
    or a cut that lost the redaction's marks would be judged token by token, and fail."""
    from replay_proxy.redact.settings import Redaction, RedactionSettings
    from replay_proxy.store.cut import Selection, cut_database

    key = tmp_path / "key"
    key.write_bytes(bytes(range(32)))
    redacted = tmp_path / "redacted.db"
    redact_database(RECORDINGS / "vllm-0.32.0-python.db", redacted, Redaction(RedactionSettings(str(key), 407)))
    marks = "SELECT redaction_policy, redaction_key, redaction_counts FROM sessions"
    [(policy, fingerprint, counts)] = rows(redacted, marks)
    assert policy and fingerprint and counts
    copy_session(redacted, "python-frontend", tmp_path / "replay.db")
    assert rows(tmp_path / "replay.db", marks) == [(policy, fingerprint, counts)]
    first = rows(redacted, "SELECT request_id FROM requests ORDER BY seq LIMIT 1")[0][0]
    cut_database(redacted, tmp_path / "cut.db", "python-frontend", Selection(requests=[first]))
    assert rows(tmp_path / "cut.db", "SELECT redaction_policy, redaction_key FROM sessions") == [(policy, fingerprint)]


def largest_token_id(db):
    return rows(db, """SELECT MAX(id) FROM (SELECT MAX(t.value) AS id FROM requests, json_each(prompt_token_ids) t
                       UNION ALL SELECT MAX(t.value) FROM outputs, json_each(new_token_ids) t)""")[0][0]


def test_a_vocabulary_smaller_than_the_recordings_token_ids_is_refused_before_anything_is_written(tmp_path):
    """A mistyped --vocab-size (3200 for 32000) blanks every frame holding a larger id: a copy that replays
    nothing, once reported as done."""
    from replay_proxy.redact.settings import Redaction, RedactionSettings

    source = RECORDINGS / "vllm-0.32.0-python.db"
    largest = largest_token_id(source)
    key = tmp_path / "key"
    key.write_bytes(bytes(range(32)))
    with pytest.raises(CopyError, match=f"--vocab-size {largest} is too small .* token id {largest}"):
        redact_database(source, tmp_path / "small.db", Redaction(RedactionSettings(str(key), largest)))
    assert not (tmp_path / "small.db").exists()
    redact_database(source, tmp_path / "fits.db", Redaction(RedactionSettings(str(key), largest + 1)))
    assert rows(tmp_path / "fits.db", "SELECT COUNT(*) FROM requests") == rows(source, "SELECT COUNT(*) FROM requests")


def test_a_redacted_copy_that_keeps_no_request_of_a_session_that_had_some_is_an_error(tmp_path, monkeypatch):
    """The backstop behind the vocabulary check: whatever blanked every ADD, nothing is reported done."""
    from replay_proxy.redact.settings import Redaction, RedactionSettings
    from replay_proxy.store import copy

    monkeypatch.setattr(copy, "_check_vocabulary", lambda *args: None)
    key = tmp_path / "key"
    key.write_bytes(bytes(range(32)))
    with pytest.raises(CopyError, match="keeps no request of session 'python-frontend' \\(6\\)"):
        redact_database(RECORDINGS / "vllm-0.32.0-python.db", tmp_path / "r.db",
                        Redaction(RedactionSettings(str(key), 5)))
