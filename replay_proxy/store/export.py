"""``replay-proxy export``: recordings' tables as one Parquet dataset, for analytics engines beyond one SQLite file.

Each table a user queries (the ``outputs`` view included, not its storage
tables or the writer's scratch) becomes, per session,
``DIR/<table>/day=<day>/host=<host>/instance=<instance>/<recording>.parquet``:
Hive partitions by the session's start day and the proxy that recorded it
(``sessions.proxy_host`` and ``proxy_instance``; ``unknown`` in a file made
before they were kept), each value as it is, percent-encoded in the path as
Hive does and its readers decode. A fleet's proxies, their rotated files and
their days, exported into one folder (or object storage), are one dataset
that DuckDB, Spark or pandas read in place and filter by day and proxy.
``<recording>``, also a column of every row, is ``<file>-<id>-<digest>``:
the digest of the session's name, start, addresses and proxy, so no two
writers' files collide (two proxies' ``staging.db``, with sessions of one
name, land side by side) and tables join on it. The dataset grows by
appending: a file is written beside its place and renamed into it, so a
reader never sees half of one; the same session exported again (a live file,
then closed) replaces its own files and nothing else. The columns are typed
from the recording's layout (``tables.py``), so every file of a table has
the same schema whatever its session held; a column that holds anything but
integers in a session where the layout says integer (a u64 utility call id)
is text in that file.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from replay_proxy.store.queries import find_session, open_recording
from replay_proxy.store.raw import FrameBytes, frame_bytes, matched
from replay_proxy.store.tables import TABLES

BATCH_ROWS = 50_000  # rows read and written at once: memory stays bounded whatever the session's size
EXPORTED = ("sessions", "frames", "handshakes", "requests", "outputs", "scheduler_stats", "aborts", "utility_requests",
            "utility_results", "engine_events", "findings")
_ARROW = {int: pa.int64(), float: pa.float64(), str: pa.string(), bytes: pa.binary()}
# Every column's type by name (the outputs view's come from its three tables; a name means one thing). A stop
# reason is a token or a string: text here, as Parquet has no such union (the SQLite file keeps each one's type).
# A call id is an integer, text in a session that holds one past int64 (as SQLite keeps it).
LAYOUT = {name: kind for columns, _ in TABLES.values() for name, kind in columns.items()} | {
    "stop_reason": str, "call_id": int, "raw": bytes, "forwarded_raw": bytes}
# A frame's bytes in ``frames`` as exported: its parts (and the parts forwarded instead, where the proxy changed
# them), each a msgpack array of bins, as SQLite kept them before the bytes moved to ``frame_batches`` (``raw.py``).
RAW_COLUMNS = ("raw", "forwarded_raw")
UNKNOWN = "unknown"  # a partition's value where the session does not say (a file made before it was kept)
_msgpack = msgspec.msgpack.Encoder().encode


def export_parquet(db_path: Path, folder: Path, session: str | None = None) -> list[Path]:
    """Write every exported table of every session (or of ``session``) under ``folder``; return the files."""
    db = open_recording(db_path)
    sessions = [find_session(db, session)] if session is not None else list(db.query("SELECT * FROM sessions"))
    written = []
    for row in sessions:
        recording = recording_of(Path(db_path), row)
        partition = Path(*(f"{key}={quote(value, safe='')}" for key, value in partition_of(row).items()))
        for table in EXPORTED:
            key = "id" if table == "sessions" else "session_id"
            where = f"FROM [{table}] WHERE [{key}] = ?"
            cursor = db.execute(f"SELECT * {where}{' ORDER BY seq' if table == 'frames' else ''}", [row["id"]])
            names = [d[0] for d in cursor.description]
            # Integer columns that hold something else in this session (see the docstring: u64 ids).
            checks = ", ".join(f"MAX(typeof([{n}]) NOT IN ('integer', 'null'))" if LAYOUT.get(n) is int else "0"
                               for n in names)
            text = db.execute(f"SELECT {checks} {where}", [row["id"]]).fetchone()
            batches: Iterator[list[Any]] = iter(lambda: cursor.fetchmany(BATCH_ROWS), [])
            if table == "frames" and "raw" not in names:  # each frame's bytes beside it, as in a file of layout 3
                batches = _with_bytes(batches, names.index("seq"), frame_bytes(db.conn, row["id"]))
                names, text = [*names, *RAW_COLUMNS], (*text, *[0] * len(RAW_COLUMNS))
            schema = pa.schema([(n, pa.string() if is_text else _ARROW[LAYOUT.get(n, str)])
                                for n, is_text in zip(names, text)] + [("recording", pa.string())])
            path = folder / table / partition / f"{recording}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            # (a dot-file until whole: Hive's readers, DuckDB's and Spark's, skip names that begin with one)
            part = path.with_name(f".{path.name}.{os.getpid()}.part")
            try:
                with pq.ParquetWriter(part, schema, compression="zstd") as out:  # (0.83x snappy's, the default)
                    for batch in batches:
                        columns = [_array(values, field.type) for values, field in zip(zip(*batch), schema)]
                        out.write_table(pa.table([*columns, pa.array([recording] * len(batch), pa.string())],
                                                 schema=schema))
                part.replace(path)
            finally:
                part.unlink(missing_ok=True)
            written.append(path)
    db.close()
    return written


def recording_of(db_path: Path, row: dict[str, Any]) -> str:
    """``<file>-<id>-<digest>``: a session of one proxy's file among a fleet's (see the module's docstring)."""
    identity = "\0".join(str(row.get(k)) for k in ("name", "started_at", "listen", "upstream", "proxy_version",
                                                   "proxy_host", "proxy_instance"))
    return f"{db_path.stem}-{row['id']}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"


def partition_of(row: dict[str, Any]) -> dict[str, str]:
    """A session's partition of the dataset: the day it began, and the proxy that recorded it."""
    return {"day": (row["started_at"] or UNKNOWN)[:10], "host": row.get("proxy_host") or UNKNOWN,
            "instance": row.get("proxy_instance") or UNKNOWN}


def _array(values: Sequence[Any], arrow_type: pa.DataType) -> pa.Array:
    """One column of SQLite values: text where the file says text, a float where SQLite kept a whole one."""
    if arrow_type == pa.string():
        values = [v if v is None or isinstance(v, str) else str(v) for v in values]
    elif arrow_type == pa.float64():
        values = [float(v) if isinstance(v, int) else v for v in values]
    return pa.array(values, arrow_type)


def _with_bytes(batches: Iterable[list[Any]], seq_at: int, frames: Iterator[FrameBytes]) -> Iterator[list[Any]]:
    """Rows of ``frames`` (in seq order, the seq at ``seq_at``) with each frame's bytes (``RAW_COLUMNS``) after its
    columns."""
    for batch in batches:
        yield [(*row, _msgpack(sent.parts), None if sent.forwarded is None else _msgpack(sent.forwarded))
               for row, read in zip(batch, itertools.islice(frames, len(batch)), strict=True)
               for sent in [matched(row[seq_at], read)]]
