"""Read-side queries over a recording: the library behind ``sessions`` and ``query``, and every question
another package asks of a recording's file (a session found by id or name, the frames one side sent, the
requests a session added): SQL over a recording is written here and in ``tables``, ``session`` and the file
operations, nowhere else."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import sqlite_utils

from replay_proxy.errors import ReplayProxyError
from replay_proxy.store.raw import frame_bytes
from replay_proxy.store.tables import open_database, read_recording
from replay_proxy.wire.messages import Channel, Direction


class QueryError(ReplayProxyError):
    """A query over a recording could not run."""


# Named queries for the common questions; `replay-proxy query --preset NAME`.
PRESETS: dict[str, str] = {
    "slowest-requests": """
        SELECT session_id, request_id, engine_index, client_index, ttft_ms, e2e_ms, tokens, finish_reason
        FROM request_timeline ORDER BY e2e_ms DESC LIMIT 20""",
    "ttft-by-session": """
        SELECT s.id AS session_id, s.name, s.mode, COUNT(*) AS requests,
               ROUND(AVG(t.ttft_ms), 3) AS mean_ttft_ms, ROUND(MAX(t.ttft_ms), 3) AS max_ttft_ms
        FROM sessions s JOIN request_timeline t ON t.session_id = s.id
        GROUP BY s.id ORDER BY s.id""",
    "finish-reasons": """
        SELECT session_id, finish_reason, COUNT(*) AS requests
        FROM request_timeline GROUP BY session_id, finish_reason ORDER BY session_id, requests DESC""",
    "frames-by-kind": """
        SELECT session_id, channel, direction, kind, COUNT(*) AS frames, SUM(nbytes) AS bytes
        FROM frames GROUP BY session_id, channel, direction, kind ORDER BY session_id, frames DESC""",
    "decode-problems": """
        SELECT session_id, seq, channel, direction, kind, decode_error, flags
        FROM frames WHERE decode_error IS NOT NULL OR flags IS NOT NULL ORDER BY session_id, seq""",
    "drift": """
        SELECT d.session_id, s.name AS session, d.seq, d.kind, d.struct, d.issue, d.field, d.position,
               d.expected, d.got, d.schema_release, d.announced,
               (SELECT COUNT(*) FROM frames f WHERE f.session_id = d.session_id AND f.flags IS NOT NULL)
                   AS frames_flagged
        FROM drift_alarms d JOIN sessions s ON s.id = d.session_id ORDER BY d.session_id, d.rowid""",
    "findings": """
        SELECT f.session_id, s.name AS replay, f.severity, f.category, f.code, f.struct, f.field, f.position,
               f.request_id, f.message
        FROM findings f JOIN sessions s ON s.id = f.session_id ORDER BY f.session_id, f.rowid""",
    "engines": """
        SELECT session_id, engine_index, COUNT(DISTINCT client_index) AS api_servers,
               SUM(kind = 'ADD') AS requests, SUM(kind = 'OUTPUTS') AS output_messages
        FROM frames WHERE engine_index IS NOT NULL GROUP BY session_id, engine_index""",
}

def datasette_metadata(databases: list[Path]) -> dict[str, Any]:
    """Datasette metadata giving each recording database (keyed by file stem) the presets as canned queries."""
    queries = {name: {"sql": " ".join(sql.split()), "title": name.replace("-", " ")} for name, sql in PRESETS.items()}
    return {"title": "replay-proxy recordings",
            "description": "Frames, requests, outputs and findings recorded by replay-proxy.",
            "databases": {Path(db).stem: {"queries": queries} for db in databases}}


# (the frontend as record --frontend named it: NAME==VERSION, or NAME)
SESSION_COLUMNS = ("id", "name", "mode", "status", "started_at", "ended_at", "vllm_version",
                   "frontend_name || COALESCE('==' || frontend_version, '') AS frontend", "frontend_release",
                   "schema_release", "frames_seen", "frames_recorded", "frames_dropped", "frames_undecoded")


def open_recording(path: str | Path) -> sqlite_utils.Database:
    """The recording at ``path``, to read (``read_recording``)."""
    return sqlite_utils.Database(read_recording(Path(path)))


def list_sessions(path: str | Path) -> list[dict[str, Any]]:
    with contextlib.closing(read_recording(Path(path))) as connection:
        return list(sqlite_utils.Database(connection).query(f"SELECT {', '.join(SESSION_COLUMNS)} FROM sessions "
                                                            "ORDER BY id"))


def run_query(path: str | Path, sql: str, params: dict[str, Any] | None = None, *, write: bool = False
              ) -> list[dict[str, Any]]:
    """The rows ``sql`` gives, run on a read-only connection unless ``write``: a query never changes a
    recording by mistake (``UPDATE ... RETURNING`` returns rows too). ``write`` brings an older file's
    layout up to this version's first (``tables.ensure_schema``), as every command that writes does."""
    connection = read_recording(Path(path))
    if write:
        connection.close()
        connection = open_database(path).conn
    else:
        connection.set_authorizer(_reading)
    try:
        with connection if write else contextlib.nullcontext():
            cursor = connection.execute(sql, params or {})
            names = [d[0] for d in cursor.description or ()]
            return [dict(zip(names, row)) for row in cursor]
    except sqlite3.Error as exc:
        hint = ("; queries are read-only: give --write to change the recording"
                if "readonly" in str(exc) or "not authorized" in str(exc) else "")
        raise QueryError(f"{exc} (in: {' '.join(sql.split())[:120]}){hint}") from None
    finally:
        connection.close()


# PRAGMAs whose argument only names what to read; any other given a value sets something.
_READING_PRAGMAS = {"table_info", "table_xinfo", "table_list", "index_info", "index_xinfo", "index_list",
                    "foreign_key_list", "foreign_key_check", "integrity_check", "quick_check"}


# What a read-only query may not do even where the file would refuse it: an UPDATE ... RETURNING of an older
# file's table (a TEMP view of it, tables.view_as_current) gives its rows back with no error, and changes nothing.
_WRITING = {sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE}


def _reading(action: int, name: str | None, value: str | None, *_: object) -> int:
    """A read-only query's authorizer: no row written, no ATTACH (SQLite would create the file it names) and no
    PRAGMA that sets something (journal_mode would answer as if it had)."""
    if action in _WRITING or action == sqlite3.SQLITE_ATTACH or (
            action == sqlite3.SQLITE_PRAGMA and value is not None and name not in _READING_PRAGMAS):
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def find_session(db: sqlite_utils.Database, session: str) -> dict[str, Any]:
    """A session by id or name (the newest of that name)."""
    rows = list(db.query(
        "SELECT * FROM sessions WHERE CAST(id AS TEXT) = :s OR name = :s ORDER BY id DESC LIMIT 1",
        {"s": session}))
    if not rows:
        names = [r["name"] for r in db.query("SELECT name FROM sessions ORDER BY id")]
        raise QueryError(f"no session {session!r}; sessions here: {', '.join(names) or 'none'}")
    return rows[0]


def sent_frames(path: Path, session: str | None, direction: Direction) -> list[tuple[Channel, list[bytes]]]:
    """The frames one side sent (``direction``), in recorded order, as their parts: of ``session`` (as
    ``find_session`` finds it), or of every session in the file (None)."""
    with contextlib.closing(open_recording(path)) as db:
        sessions = [find_session(db, session)["id"]] if session is not None else [
            sid for (sid,) in db.execute("SELECT id FROM sessions ORDER BY id")]
        sent = []
        for session_id in sessions:
            channels = dict(db.execute("SELECT seq, channel FROM frames WHERE session_id = ? AND direction = ?",
                                       [session_id, str(direction)]).fetchall())
            sent += [(Channel(channels[f.seq]), f.parts) for f in frame_bytes(db.conn, session_id, channels.keys())]
    return sent


def added_requests(path: Path, session: str) -> tuple[int, list[dict[str, Any]]]:
    """Session ``session`` (as ``find_session`` finds it): its id, and its requests in the order they were added,
    each once (``request_id``, ``sampling_params`` and ``prompt_token_ids`` as recorded, JSON)."""
    with contextlib.closing(open_recording(path)) as db:
        session_id = find_session(db, session)["id"]
        first: dict[str, dict[str, Any]] = {}  # (an ADD sent again names a request already added)
        for row in db.query("SELECT request_id, sampling_params, prompt_token_ids FROM requests WHERE session_id = ? "
                            "ORDER BY seq", [session_id]):
            first.setdefault(row["request_id"], row)
    return session_id, list(first.values())
