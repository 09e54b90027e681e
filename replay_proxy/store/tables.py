"""The SQLite layout: the recorded traffic as people query it.

One database holds many sessions. ``frames`` has a row for every message
(where and when it crossed, its decoded, named form), ``frame_batches`` its
bytes exactly as they crossed, compressed across frames (``raw.py``); the other
tables are views of the same frames by protocol concept (handshakes,
requests, outputs, aborts, utility calls, engine events), with one column
per scalar field. Sampling-parameter columns come from the shipped release
schemas, so a new vLLM release adds columns without anyone typing them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import urllib.parse
from pathlib import Path
from typing import Any

import sqlite_utils

from replay_proxy.clock import utc_now
from replay_proxy.store import reserve
from replay_proxy.store.counts import FrameCounts, WriterCounts
from replay_proxy.store.files import NotReadable, open_read_only
from replay_proxy.wire.registry import load_schema, shipped_releases

SCALAR_KINDS = {"nil", "bool", "int", "float", "str"}
_SQL_TYPES = {"bool": int, "int": int, "float": float, "str": str}


def _scalar_columns(struct: str, prefix: str = "") -> dict[str, type]:
    """The scalar fields of ``struct`` in every shipped release, each a column (named ``prefix`` + its name), and
    their SQL type."""
    columns: dict[str, type] = {}
    for release in shipped_releases():
        for field in load_schema(release).structs[struct].fields:
            kinds = set(field.kinds) - {"nil"}
            if kinds and kinds <= SCALAR_KINDS and prefix + field.name not in columns:
                columns[prefix + field.name] = _SQL_TYPES[sorted(kinds)[0]] if len(kinds) == 1 else float
    return columns


@functools.cache
def sampling_columns() -> dict[str, type]:
    """Scalar SamplingParams fields of every shipped release, and their SQL type."""
    return _scalar_columns("SamplingParams")


# The SchedulerStats field whose own scalar fields are columns of ``scheduler_stats`` too, named with this prefix.
PREFIX_CACHE = "prefix_cache_"


@functools.cache
def scheduler_columns() -> dict[str, type]:
    """Scalar SchedulerStats fields of every shipped release, and its prefix cache stats' (``PREFIX_CACHE``), and
    their SQL type."""
    return {**_scalar_columns("SchedulerStats"), **_scalar_columns("PrefixCacheStats", PREFIX_CACHE)}


TABLES: dict[str, tuple[dict[str, type], list[str] | str | None]] = {
    "sessions": ({
        "id": int, "name": str, "mode": str, "baseline_session_id": int, "started_at": str,
        "ended_at": str, "status": str, "listen": str, "upstream": str, "vllm_version": str,
        "schema_release": str, "schema_exact": int, "proxy_version": str, "frames_seen": int,
        "frames_recorded": int, "frames_dropped": int, "frames_undecoded": int, "bytes_seen": int,
        "engines_dead": int, "error": str,
        # The release the frontend writes as (each side's frames are named with their writer's release), and
        # how it was found: given (record --frontend-release), the engines' (its first ADD reads as theirs),
        # newest (the newest shipped release that reads it without flags), unread (none does).
        "frontend_release": str, "frontend_source": str,
        # Which frontend it is, where the user says (record --frontend smg==1.13.0): no handshake or request names
        # its sender, and a third-party client writes as some vLLM release without being one.
        "frontend_name": str, "frontend_version": str,
        # A redacted session: its policy's digest and its key's fingerprint (never the key), and what
        # the redaction blanked (default deny) and dropped (the policy), as JSON counts.
        "redaction_policy": str, "redaction_key": str, "redaction_counts": str,
        # A cut (replay-proxy cut): the source file's digest and name, its session, the selection, as JSON.
        "cut_from": str,
        # Recorded with --sample-requests: the fraction and its seed, and what the sample left out.
        "sample_requests": float, "sample_seed": str, "frames_sampled_out": int, "outputs_sampled_out": int,
        # One file of a rotating recording (recorder/rotation/): the files before and after it, and the rows that
        # are copies counted in another file (the session's start; the other part of a split frame).
        "continues": str, "continued_in": str, "frames_copied": int,
        # Which proxy of a fleet recorded it: its machine's host name and the proxy there (record --instance).
        "proxy_host": str, "proxy_instance": str,
        # Every count the writer keeps (counts.WriterCounts), a column each: those above, and the requests it
        # decoded, the frames it could not write or decode, the drift alarms raised.
        **dict.fromkeys(WriterCounts.__struct_fields__, int),
    }, "id"),
    "frames": ({
        "session_id": int, "seq": int, "ts_ns": int, "channel": str, "direction": str,
        "engine_index": int, "client_index": int, "kind": str, "n_parts": int, "nbytes": int,
        "decoded": str, "decode_error": str, "flags": str, "engine_time_s": float,
        "copied": int,
    }, ["session_id", "seq"]),
    # The frames' bytes as they crossed (parts, and the parts forwarded where the proxy changed them), in batches
    # compressed with zstd: ``raw.py``. A file of layout 3 or before keeps them in ``frames.raw`` and
    # ``frames.forwarded_raw`` instead (read there; ``replay-proxy migrate`` moves them here).
    "frame_batches": ({
        "session_id": int, "first_seq": int, "last_seq": int, "frames": int, "data": bytes,
    }, ["session_id", "first_seq"]),
    "handshakes": ({
        "session_id": int, "seq": int, "ts_ns": int, "engine_index": int, "client_index": int,
        "kind": str, "payload": str, "rewritten": str, "vllm_version": str,
        "copied": int,
    }, ["session_id", "seq"]),
    "requests": ({
        "session_id": int, "seq": int, "ts_ns": int, "engine_index": int, "client_index": int,
        "request_id": str, "external_req_id": str, "prompt_len": int, "prompt_token_ids": str,
        "arrival_time": float, "data_parallel_rank": int, "priority": int,
        **sampling_columns(),
        "sampling_params": str,
        "copied": int,
    }, ["session_id", "seq"]),
    # One row per frame whose outputs are tabulated (an EngineCoreOutputs: a busy engine's step, the bulk of a
    # recording), its outputs packed into one JSON array: per position, [request, new_token_ids, num_nans_in_logits,
    # finish_reason, stop_reason, other] with its trailing nulls left out, or null for an output that is not
    # tabulated (the frame's ``decoded`` keeps it). request: the request's number in ``request_ids``;
    # num_nans_in_logits: null where 0, every release's default and nearly every output's; stop_reason: a
    # stop token (integer) or a stop string (text), as the wire has it, each keeping its JSON type (typeof() tells
    # token 852 from the string "852"); other: the set fields with no place of their own (logprobs, events, ...),
    # without the values at their release's default, as in ``frames.decoded``. The view ``outputs`` unpacks it. A
    # row a step rather than an output: the key, the seq and a row's header once a step (a busy engine's file a
    # third of the size). No key and no index: rows are appended in the order they crossed, the cheapest insert
    # there is (a key by request cost the writer a third of its rate).
    "frame_outputs": ({
        "session_id": int, "seq": int, "outputs": str,
        "copied": int,
    }, None),
    # What outputs were stored as up to layout 3, a row each (``frame_outputs``' values as columns; ``other`` a
    # JSON object): read in an older file, written no more.
    "output_rows": ({
        "session_id": int, "request": int, "seq": int, "position": int, "new_token_ids": str,
        "num_new_tokens": int, "finish_reason": str, "stop_reason": bytes, "num_nans_in_logits": int, "other": str,
        "copied": int,
    }, None),
    # An engine step's scheduler stats (EngineCoreOutputs.scheduler_stats, sent with each step when the engine logs
    # stats): a column each of its scalar fields and of its prefix cache stats' (``prefix_cache_hits``, ...) as
    # sent, the rest (maps, lists, other structs) as a JSON object in ``other`` without the values at their
    # default. A tenth of the same as JSON in ``frames.decoded``, where it was, and no key name to type.
    "scheduler_stats": ({
        "session_id": int, "seq": int, **scheduler_columns(), "other": str,
        "copied": int,
    }, None),
    # Each request id a session's outputs name, numbered in order of first sight.
    "request_ids": ({
        "session_id": int, "number": int, "request_id": str,
    }, ["session_id", "number"]),
    "aborts": ({
        "session_id": int, "seq": int, "position": int, "ts_ns": int, "engine_index": int,
        "client_index": int, "request_id": str,
        "copied": int,
    }, ["session_id", "seq", "position"]),
    # call_id: Python's frontend draws u64 ids, half of them past SQLite's integers: those are text. Declared
    # BLOB, as stop_reason is: an INTEGER column turned such text into a REAL, losing the id's last digits.
    "utility_requests": ({
        "session_id": int, "seq": int, "ts_ns": int, "engine_index": int, "client_index": int,
        "call_id": bytes, "method": str, "args": str,
        "copied": int,
    }, ["session_id", "seq"]),
    "utility_results": ({
        "session_id": int, "seq": int, "ts_ns": int, "engine_index": int, "client_index": int,
        "call_id": bytes, "failure_message": str, "result": str,
        "copied": int,
    }, ["session_id", "seq"]),
    "findings": ({
        "session_id": int, "baseline_session_id": int, "category": str, "severity": str, "code": str,
        "message": str, "message_kind": str, "struct": str, "field": str, "position": int, "baseline": str,
        "candidate": str, "request_id": str, "breaks": str, "change": str, "consequences": str, "tier": str,
    }, None),  # one row per finding of a replay, in report order; change: a performance estimate (JSON);
    # consequences: the failures a reader's rejection caused (JSON list), not rows of their own; tier: the
    # evidence that judged a request's behaviour (exact, first_divergence, scored, invariants, sampled)
    "engine_events": ({
        "session_id": int, "seq": int, "ts_ns": int, "engine_index": int, "event": str, "detail": str,
        "copied": int,
    }, ["session_id", "seq"]),
    # The first frame of each way a session's traffic disagreed with the schema of the release its
    # engine announced (struct, issue, field or position): the live drift alarm. message: as the
    # status line said it.
    "drift_alarms": ({
        "session_id": int, "seq": int, "ts_ns": int, "engine_index": int, "client_index": int, "kind": str,
        "struct": str, "issue": str, "field": str, "position": int, "path": str, "expected": str, "got": str,
        "schema_release": str, "announced": str, "message": str,
        "copied": int,
    }, None),
    # What the recorder has kept but not yet decoded: the tap's messages as they came, numbered
    # in arrival order. Emptied as the writer catches up; empty once a session is finished.
    "undecoded": ({
        "session_id": int, "number": int, "frames": int, "batch": bytes,
    }, ["session_id", "number"]),
}


# A row a rotating recording copied into a file from frames another of its files counts (recorder/rotation/: the
# session's start in each new file, the other part of a split frame): 1 there, else null; the last column of
# every table of frames' rows. A series' totals are its rows where it is null.
COPIED = "copied"


def written(table: str) -> list[str]:
    """The columns a writer gives a row of ``table`` (``copied`` is said by the statement)."""
    return [c for c in TABLES[table][0] if c != COPIED]


INDEXES = {
    "frames": [["session_id", "kind"]],
    "requests": [["session_id", "request_id"]],
    "request_ids": [["session_id", "request_id"]],
}

VIEWS = {
    # Every output with its frame's time, engine, API server and engine clock, and its request id: unpacked from
    # ``frame_outputs``, and from an older file's ``output_rows``.
    "outputs": """
        SELECT o.session_id, o.seq, e.key AS position, f.ts_ns, f.engine_index, f.client_index, f.engine_time_s,
               r.request_id, json_extract(e.value, '$[1]') AS new_token_ids,
               json_array_length(e.value, '$[1]') AS num_new_tokens, json_extract(e.value, '$[3]') AS finish_reason,
               json_extract(e.value, '$[4]') AS stop_reason,
               COALESCE(json_extract(e.value, '$[2]'), 0) AS num_nans_in_logits,
               json_extract(e.value, '$[5].new_logprobs') AS new_logprobs,
               json_extract(e.value, '$[5].events') AS events,
               NULLIF(json_remove(json_extract(e.value, '$[5]'), '$.new_logprobs', '$.events'), '{}') AS other, o.copied
        FROM frame_outputs o JOIN json_each(o.outputs) e
        JOIN frames f ON f.session_id = o.session_id AND f.seq = o.seq
        LEFT JOIN request_ids r ON r.session_id = o.session_id AND r.number = json_extract(e.value, '$[0]')
        WHERE e.type = 'array'
        UNION ALL
        SELECT o.session_id, o.seq, o.position, f.ts_ns, f.engine_index, f.client_index, f.engine_time_s,
               r.request_id, o.new_token_ids, o.num_new_tokens, o.finish_reason, o.stop_reason,
               o.num_nans_in_logits, json_extract(o.other, '$.new_logprobs') AS new_logprobs,
               json_extract(o.other, '$.events') AS events,
               NULLIF(json_remove(o.other, '$.new_logprobs', '$.events'), '{}') AS other, o.copied
        FROM output_rows o
        JOIN frames f ON f.session_id = o.session_id AND f.seq = o.seq
        LEFT JOIN request_ids r ON r.session_id = o.session_id AND r.number = o.request""",
    # One row per request: when it was added, its first token, how it ended.
    # frontend_aborted: the frontend sent ABORT (the engine never answers those).
    "request_timeline": """
        SELECT session_id, request_id, engine_index, client_index, added_ns, first_token_ns,
               (first_token_ns - added_ns) / 1e6 AS ttft_ms, tokens, finish_reason,
               (last_ns - added_ns) / 1e6 AS e2e_ms,
               EXISTS (SELECT 1 FROM aborts a WHERE a.session_id = t.session_id
                       AND a.request_id = t.request_id) AS frontend_aborted
        FROM (
            SELECT r.session_id, r.request_id, r.engine_index, r.client_index, r.ts_ns AS added_ns,
                   MIN(CASE WHEN o.num_new_tokens > 0 THEN o.ts_ns END) AS first_token_ns,
                   MAX(o.ts_ns) AS last_ns,
                   COALESCE(SUM(o.num_new_tokens), 0) AS tokens,
                   MAX(o.finish_reason) AS finish_reason
            FROM requests r
            LEFT JOIN outputs o ON o.session_id = r.session_id AND o.request_id = r.request_id
            GROUP BY r.session_id, r.seq
        ) AS t""",
    # Where each ABORT landed: per request it names, the tokens the request had produced (outputs
    # that crossed) before the ABORT crossed. The same for a recording and for its replay.
    "abort_progress": """
        SELECT a.session_id, a.seq, a.ts_ns, a.engine_index, a.client_index, a.request_id,
               COALESCE(SUM(o.num_new_tokens), 0) AS tokens_before_abort
        FROM aborts a
        LEFT JOIN outputs o ON o.session_id = a.session_id AND o.request_id = a.request_id AND o.seq < a.seq
        GROUP BY a.session_id, a.seq, a.position""",
    # The gap before each output that carried tokens, per request: as the proxy saw it (itl_ms)
    # and by the engine's own clock (engine_itl_ms, from the time it stamped on its outputs).
    "inter_token_latencies": """
        SELECT session_id, request_id, engine_index, client_index, seq, ts_ns, num_new_tokens,
               (ts_ns - LAG(ts_ns) OVER w) / 1e6 AS itl_ms,
               (engine_time_s - LAG(engine_time_s) OVER w) * 1e3 AS engine_itl_ms
        FROM outputs WHERE num_new_tokens > 0
        WINDOW w AS (PARTITION BY session_id, request_id ORDER BY seq)""",
    # A utility call beside its result (call ids are unique per engine and API server).
    "utility_calls": """
        SELECT q.session_id, q.engine_index, q.client_index, q.call_id, q.method, q.args,
               q.ts_ns AS called_ns, r.ts_ns AS answered_ns, (r.ts_ns - q.ts_ns) / 1e6 AS latency_ms,
               r.failure_message, r.result
        FROM utility_requests q
        LEFT JOIN utility_results r ON r.session_id = q.session_id AND r.call_id = q.call_id
             AND r.engine_index = q.engine_index AND r.client_index = q.client_index""",
}


# SQLite's default. A file of layout 3 or before had 16 KB pages, made for a busy engine's frames (a few KB each, which
# left a 4 KB page a quarter empty): their bytes are in compressed batches now, and every table and index takes a
# page at least, so a small recording was mostly slack (600 KB for 216 KB of wire, 150 KB with 4 KB pages). 1 KB
# pages would make a small file smaller still and a busy one larger: a step's packed outputs are most of such a page.
PAGE_BYTES = 4096


def open_database(path: str | Path) -> sqlite_utils.Database:
    """Open (creating with mode 0600 if new) a recording database to write, migrated to this version's layout
    (``ensure_schema``); a file that is neither new, nor empty, nor a recording is refused, not written."""
    path = Path(path)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        read_recording(path).close()
    if new:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    db = sqlite_utils.Database(path)
    if new:  # (only before the first table)
        db.execute(f"PRAGMA page_size={PAGE_BYTES}")
    db.enable_wal()
    ensure_schema(db)
    return db


def begin_session(path: str | Path, row: dict[str, object]) -> tuple[int, bool]:
    """A new session's row in the recording at ``path`` (made if need be), and room held beside it for the
    session's end (``reserve``): its id, and whether there was room."""
    with contextlib.closing(open_database(path)) as db:
        session_id = insert_session(db, row)
    return session_id, reserve.hold(path)


def insert_session(db: sqlite_utils.Database, row: dict[str, object]) -> int:
    """A session's row, begun: its id."""
    return int(db.table("sessions").insert(row).last_pk or 0)  # (an INTEGER PRIMARY KEY: never none)


def end_session(path: str | Path, session_id: int, *, status: str | None = None, error: str | None = None,
                counts: FrameCounts | None = None, **values: object) -> None:
    """Write a session's end into its row: how it ended, where each frame it saw is (``store/counts.py``),
    ``values``, and ``error`` unless it has one; the room held for it is given back first, so that it is
    written however full the disk is. The one place a session ends: the writer at the recorder's Stop or
    when the proxy is gone, each closed file of a rotating recording, and the recorder for a writer that
    died or never started. Without a status it ends nothing: ``decode`` writes the totals it changed."""
    if status is not None:
        reserve.release(path)
        values.update(status=status, ended_at=utc_now())
    if counts is not None:
        values.update(frames_seen=counts.seen, frames_recorded=counts.recorded, frames_dropped=counts.dropped)
    assignments = "".join(f"{column} = ?, " for column in values)
    if not Path(path).exists():
        return  # (a rotating recording's retention deleted it: there is no row to end)
    with contextlib.closing(_existing(path)) as connection, connection:
        connection.execute(f"UPDATE sessions SET {assignments}error = COALESCE(?, error) WHERE id = ?",
                           (*values.values(), error, session_id))


def _existing(path: str | Path) -> sqlite3.Connection:
    """A connection that writes into the file at ``path`` and never makes one there (``mode=rw``): a file deleted
    meanwhile is an error, not an empty database left behind for readers to trip on."""
    return sqlite3.connect(f"file:{urllib.parse.quote(str(Path(path).resolve()))}?mode=rw", uri=True, timeout=30)


def frames_kept(path: str | Path, session_id: int) -> int:
    """A session's frames in its file: decoded, or kept to decode later (none in a file deleted meanwhile)."""
    if not Path(path).exists():
        return 0
    with contextlib.closing(_existing(path)) as connection:
        return int(connection.execute("SELECT (SELECT COUNT(*) FROM frames WHERE session_id = :s) + (SELECT "
                                      "COALESCE(SUM(frames), 0) FROM undecoded WHERE session_id = :s)",
                                      {"s": session_id}).fetchone()[0])


def ended_session(path: str | Path, session_id: int) -> tuple[dict[str, Any], int, list[str]]:
    """A session's row as whoever ended it wrote it, its requests counted, and its drift alarms in order."""
    with contextlib.closing(read_recording(Path(path))) as connection:
        connection.row_factory = sqlite3.Row
        row = dict(connection.execute("SELECT * FROM sessions WHERE id = ?", [session_id]).fetchone())
        requests = connection.execute("SELECT COUNT(*) FROM requests WHERE session_id = ?", [session_id]).fetchone()[0]
        alarms = [m for (m,) in connection.execute(
            "SELECT message FROM drift_alarms WHERE session_id = ? ORDER BY rowid", [session_id])]
    return row, requests, alarms


def read_recording(path: Path) -> sqlite3.Connection:
    """The recording at ``path`` to read, never to write (``files.open_read_only``), an older file seen in this
    version's layout (``view_as_current``)."""
    connection = open_read_only(path, "recording", "sessions")
    try:
        view_as_current(connection)
    except sqlite3.DatabaseError as exc:
        connection.close()
        raise NotReadable(f"{path} is not a recording: {exc}") from None
    return connection


# PRAGMA user_version of a file laid out as TABLES and VIEWS say: 0, an older proxy's file; 2, rows marked copied;
# 3, every count of the writer's in the session's row; 4, the frames' bytes in compressed batches (a file of 3 or before
# migrated keeps its earlier frames' bytes in ``frames.raw``, where ``raw.frame_bytes`` reads them); 5, the proxy's
# host and instance in the session's row (and, in a file made since, the keyed tables WITHOUT ROWID); 6, the frontend's
# name and version there.
SCHEMA_VERSION = 6
LEGACY_BYTES = ("raw", "forwarded_raw")  # the ``frames`` columns that held each frame's bytes up to layout 3

# What each version of the layout changed, as SELECTs over the older file's tables: ``ensure_schema`` migrates a
# file it writes with them (INSERT ... SELECT), ``view_as_current`` reads a file it may not write through them.
# An older file's logprobs and events columns, folded into ``output_rows.other`` (a null patch value
# removes its key, so an output with neither keeps ``other`` as it was).
_OTHER_WITH_COLUMNS = """NULLIF(json_patch(COALESCE(other, '{}'), json_object('new_logprobs', json(new_logprobs),
                         'events', json(events))), '{}')"""
# A file recorded before ``output_rows``: one wide ``outputs`` table, its request ids numbered in order of first
# sight, and the engine's clock not yet a column of ``frames``.
_WIDE_REQUEST_IDS = """SELECT session_id, ROW_NUMBER() OVER (PARTITION BY session_id ORDER BY MIN(seq * 65536 +
                       position)) AS number, request_id FROM main.outputs GROUP BY session_id, request_id"""
_WIDE_OUTPUT_ROWS = f"""SELECT o.session_id, r.number AS request, o.seq, o.position, o.new_token_ids,
                       o.num_new_tokens, o.finish_reason, o.stop_reason, o.num_nans_in_logits,
                       {_OTHER_WITH_COLUMNS} AS other, NULL AS copied
                       FROM main.outputs o JOIN request_ids r ON r.session_id = o.session_id
                       AND r.request_id = o.request_id"""
_ENGINE_TIME = """CASE WHEN kind IN ('OUTPUTS', 'UTILITY_OUTPUT') AND json_extract(decoded, '$.timestamp') > 0
                  THEN json_extract(decoded, '$.timestamp') END"""


def _select_as_current(table: str, have: set[str]) -> str | None:
    """A SELECT of ``table``'s rows in this version's columns from a file where it has the columns ``have``
    (None: it has them all as they are). A missing column is null, or made from what the row holds; a file
    whose ``output_rows`` had logprobs and events columns of their own has them folded into ``other``; the
    frames' bytes of a file of layout 3 or before stay where they are (``LEGACY_BYTES``)."""
    columns = TABLES[table][0]
    folded = {"other": _OTHER_WITH_COLUMNS} if table == "output_rows" and "new_logprobs" in have else {}
    if have >= columns.keys() and not folded:
        return None
    made = {"engine_time_s": _ENGINE_TIME} if table == "frames" and "decoded" in have else {}
    picked = ", ".join([f"{folded[c]} AS [{c}]" if c in folded else f"[{c}]" if c in have
                        else f"{made.get(c, 'NULL')} AS [{c}]" for c in columns] +
                       [f"[{c}]" for c in LEGACY_BYTES if table == "frames" and c in have])
    return f"SELECT {picked} FROM main.[{table}]" if have else f"SELECT {picked} WHERE 0"


def _drop_views(db: sqlite_utils.Database) -> None:
    """Before a table they read is remade; ``ensure_schema`` makes them again."""
    for view in VIEWS:
        db.execute(f"DROP VIEW IF EXISTS [{view}]")


def _move_wide_outputs(db: sqlite_utils.Database) -> None:
    with db.conn:
        db.execute(f"INSERT INTO request_ids {_WIDE_REQUEST_IDS}")
        db.execute(f"INSERT INTO output_rows {_WIDE_OUTPUT_ROWS}")
        db.execute(f"UPDATE frames SET engine_time_s = {_ENGINE_TIME} WHERE kind IN ('OUTPUTS', 'UTILITY_OUTPUT')")
        db.execute("DROP TABLE outputs")
        _drop_views(db)


def _fold_output_columns(db: sqlite_utils.Database) -> None:
    with db.conn:
        _drop_views(db)
        db.table("output_rows_folded").create(TABLES["output_rows"][0])
        folded = _select_as_current("output_rows", set(db["output_rows"].columns_dict))
        db.execute(f"INSERT INTO output_rows_folded {folded}")
        db.execute("DROP TABLE output_rows")
        db.execute("ALTER TABLE output_rows_folded RENAME TO output_rows")


def view_as_current(connection: sqlite3.Connection) -> None:
    """An older file read as this version lays a recording out, without a byte written to it: each table that
    differs, and every view, is shadowed by a TEMP view of its name (the connection's own schema, which SQLite
    searches before the file's), made from the SELECTs that ``ensure_schema`` migrates with."""
    if connection.execute("PRAGMA main.user_version").fetchone()[0] >= SCHEMA_VERSION:
        return
    tables = {name for (name,) in connection.execute("SELECT name FROM main.sqlite_master WHERE type = 'table'")}
    wide = "outputs" in tables
    for name in TABLES:
        have = {row[1] for row in connection.execute(f"PRAGMA main.table_info([{name}])")}
        body: str | None
        if wide and name in ("request_ids", "output_rows"):
            body = _WIDE_REQUEST_IDS if name == "request_ids" else _WIDE_OUTPUT_ROWS
        else:
            body = _select_as_current(name, have)
        if body is not None:
            connection.execute(f"CREATE TEMP VIEW [{name}] AS {body}")
    for name, sql in VIEWS.items():
        connection.execute(f"CREATE TEMP VIEW [{name}] AS {sql}")


def ensure_schema(db: sqlite_utils.Database) -> None:
    """A file this proxy writes, migrated to this version's layout (the one place a recording changes shape)."""
    for name, (columns, pk) in TABLES.items():
        table = db.table(name)
        if name == "undecoded" and table.exists() and table.columns_dict != columns and not table.count:
            table.drop()  # scratch space, laid out by the release that wrote it: empty, so remade
        if table.exists():  # an older file: add what a newer proxy records
            existing = table.columns_dict
            for column, column_type in columns.items():
                if column not in existing:
                    table.add_column(column, column_type)
        elif isinstance(pk, list):  # the key is the row's place: one b-tree, no rowid and no index beside it
            db.execute(db.create_table_sql(name, columns, pk=pk).rstrip().rstrip(";") + " WITHOUT ROWID")
        else:
            table.create(columns, pk=pk)
    if "outputs" in db.table_names():  # a table, not the view
        _move_wide_outputs(db)
    if "new_logprobs" in db["output_rows"].columns_dict:
        _fold_output_columns(db)
    for name, indexes in INDEXES.items():
        for indexed in indexes:
            db.table(name).create_index(indexed, if_not_exists=True)
    existing = {row["name"]: row["sql"] for row in db.query("SELECT name, sql FROM sqlite_master WHERE type = 'view'")}
    for name, sql in VIEWS.items():
        stored = " ".join(existing.get(name, "").replace('"', "").split())
        if stored != " ".join(f"CREATE VIEW {name} AS {sql}".split()):
            db.create_view(name, sql, replace=True)  # only when missing or changed
    if db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
