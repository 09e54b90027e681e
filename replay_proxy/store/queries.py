"""Read-side queries over a recording: the library behind ``sessions`` and ``query``."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path
from typing import Any

import sqlite_utils

from replay_proxy.errors import ReplayProxyError
from replay_proxy.store.tables import ensure_schema


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


SESSION_COLUMNS = ("id", "name", "mode", "status", "started_at", "ended_at", "vllm_version",
                   "schema_release", "frames_seen", "frames_recorded", "frames_dropped", "frames_undecoded")


def open_existing(path: str | Path) -> sqlite_utils.Database:
    """An existing recording, brought up to this version's tables and views (adds what is missing)."""
    path = Path(path)
    require_recording(path)
    db = sqlite_utils.Database(path)
    if db["sessions"].exists():
        ensure_schema(db)
    return db


def require_recording(path: Path) -> None:
    """That ``path`` is a SQLite file, else the one-line reason it is no recording. Asked of SQLite itself: a
    file of this process's SQLite connections opened and closed by other means loses their locks."""
    if not path.exists():
        raise QueryError(f"no recording at {path}: record one with `replay-proxy record --db {path} ...`")
    if path.is_dir():
        raise QueryError(f"{path} is a folder, not a recording (a SQLite file that `replay-proxy record` wrote)")
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path.resolve()}?mode=ro", uri=True)) as connection:
            connection.execute("PRAGMA schema_version")
    except sqlite3.DatabaseError as exc:
        raise QueryError(f"{path} is not a recording: " + (
            "not a SQLite file" if "not a database" in str(exc) else str(exc))) from None


def list_sessions(path: str | Path) -> list[dict[str, Any]]:
    db = open_existing(path)
    if not db["sessions"].exists():
        raise QueryError(f"{path} is not a replay-proxy recording (it has no sessions table)")
    columns = ", ".join(SESSION_COLUMNS)
    return list(db.query(f"SELECT {columns} FROM sessions ORDER BY id"))


def run_query(path: str | Path, sql: str, params: dict | None = None, *, write: bool = False) -> list[dict[str, Any]]:
    """The rows ``sql`` gives, run on a read-only connection unless ``write``: a query never changes a
    recording by mistake (``UPDATE ... RETURNING`` returns rows too)."""
    db = open_existing(path)  # (an older file's layout brought up to this version's first)
    connection = db.conn if write else sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True)
    try:
        with connection if write else contextlib.nullcontext():
            cursor = connection.execute(sql, params or {})
            names = [d[0] for d in cursor.description or ()]
            return [dict(zip(names, row)) for row in cursor]
    except sqlite3.Error as exc:
        hint = "; queries are read-only: give --write to change the recording" if "readonly" in str(exc) else ""
        raise QueryError(f"{exc} (in: {' '.join(sql.split())[:120]}){hint}") from None
    finally:
        if not write:
            connection.close()


def find_session(db: sqlite_utils.Database, session: str) -> dict[str, Any]:
    """A session by id or name (the newest of that name)."""
    rows = list(db.query(
        "SELECT * FROM sessions WHERE CAST(id AS TEXT) = :s OR name = :s ORDER BY id DESC LIMIT 1",
        {"s": session}))
    if not rows:
        names = [r["name"] for r in db.query("SELECT name FROM sessions ORDER BY id")]
        raise QueryError(f"no session {session!r}; sessions here: {', '.join(names) or 'none'}")
    return rows[0]
