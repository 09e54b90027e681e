"""The recorder: frames in from the proxy's hot path, rows out to SQLite.

Theory of operation: the forwarding loop calls ``Recorder.frame`` after it
has already sent a message on. That call only appends a reference to a
bounded queue and returns; a single writer thread decodes the frames and
writes them with ``executemany``, one transaction per batch, on its own
connection. When the queue is full the default policy drops the frame from
the *recording* (it was forwarded all the same) and counts it; the count is
shown live, in the summary and in the ``sessions`` row. ``on_full="block"``
makes the proxy wait for the writer instead: lossless, at the cost of latency.
"""

from __future__ import annotations

import datetime
import queue
import sqlite3
import threading
import time
from pathlib import Path
from typing import Literal

import msgspec

from replay_proxy import __version__
from replay_proxy.net.relay import FrameEvent
from replay_proxy.store.rows import Rows
from replay_proxy.store.tables import TABLES, open_database
from replay_proxy.wire.messages import Kind, WireDecoder

BATCH = 2000


class RecorderStats(msgspec.Struct, frozen=True):
    frames_seen: int
    frames_recorded: int
    frames_dropped: int
    bytes_seen: int
    requests: int
    queue_depth: int
    peak_queue: int
    engines_dead: int


class SessionInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str
    mode: Literal["record", "replay"] = "record"
    listen: str | None = None
    upstream: str | None = None
    baseline_session_id: int | None = None


class _EngineLost(msgspec.Struct, frozen=True):
    ts_ns: int
    engine_index: int
    reason: str


_STOP = object()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


class Recorder:
    """Records one session; an ``Observer`` for the relay."""

    def __init__(self, db_path: str | Path, session: SessionInfo, *,
                 on_full: Literal["drop", "block"] = "drop", queue_size: int = 100_000):
        self.db_path = Path(db_path)
        self.on_full = on_full
        self._queue: queue.Queue = queue.Queue(queue_size)
        self._seen = self._dropped = self._bytes = self._requests = self._peak = 0
        self._recorded = 0
        self._dead_engines: set[int] = set()
        self.write_error: str | None = None
        db = open_database(self.db_path)
        self.session_id = db["sessions"].insert({
            **msgspec.to_builtins(session), "started_at": _now(), "status": "recording",
            "proxy_version": __version__, "frames_seen": 0, "frames_recorded": 0, "frames_dropped": 0,
        }).last_pk
        db.close()
        self.decoder = WireDecoder()
        self._thread = threading.Thread(target=self._write_loop, name="replay-proxy-writer", daemon=True)
        self._thread.start()

    # --- the hot path: called by the relay's forwarding tasks --------------------------

    def frame(self, event: FrameEvent) -> None:
        self._seen += 1
        self._bytes += sum(len(f) for f in event.frames)
        if self.on_full == "block":
            self._queue.put(event)
        else:
            try:
                self._queue.put_nowait(event)
            except queue.Full:
                self._dropped += 1
                return
        depth = self._queue.qsize()
        if depth > self._peak:
            self._peak = depth

    def engine_lost(self, engine_index: int, reason: str) -> None:
        self._dead_engines.add(engine_index)
        self._queue.put(_EngineLost(time.time_ns(), engine_index, reason))

    def statistics(self) -> RecorderStats:
        return RecorderStats(self._seen, self._recorded, self._dropped, self._bytes, self._requests,
                             self._queue.qsize(), self._peak, len(self._dead_engines))

    # --- the writer thread ---------------------------------------------------------------

    def _write_loop(self) -> None:
        connection = sqlite3.connect(self.db_path)
        connection.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable at checkpoints
        statements = {
            table: f"INSERT INTO [{table}] ({', '.join(f'[{c}]' for c in columns)}) "
                   f"VALUES ({', '.join('?' for _ in columns)})"
            for table, (columns, _) in TABLES.items()
        }
        seq = 0
        stopping = False
        while not stopping:
            batch = [self._queue.get()]
            while len(batch) < BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            rows = Rows()
            recorded = 0
            for item in batch:
                if item is _STOP:
                    stopping = True
                    continue
                seq += 1
                if isinstance(item, _EngineLost):
                    rows.add_engine_event(self.session_id, seq, item.ts_ns, item.engine_index,
                                          "lost", item.reason)
                    continue
                message = self.decoder.decode(item.channel, item.direction, item.frames)
                rows.add_frame(self.session_id, seq, item, message, self.decoder.schema)
                recorded += 1
                if message.kind is Kind.ADD:
                    self._requests += 1
                elif message.kind is Kind.ENGINE_CORE_DEAD and item.engine_index is not None:
                    self._dead_engines.add(item.engine_index)
            try:
                with connection:
                    for table, values in rows.tables.items():
                        connection.executemany(statements[table], values)
            except Exception as exc:  # noqa: BLE001 - a full disk, a locked file: count it, keep going
                self._dropped += recorded
                self.write_error = f"{type(exc).__name__}: {exc}"
            else:
                self._recorded += recorded
        connection.close()

    def close(self, status: str = "complete", error: str | None = None) -> RecorderStats:
        """Flush everything queued, then finish the session row."""
        self._queue.put(_STOP)
        self._thread.join()
        stats = self.statistics()
        db = open_database(self.db_path)
        db["sessions"].update(self.session_id, {
            "ended_at": _now(), "status": status, "error": error or self.write_error,
            "vllm_version": self.decoder.vllm_version, "schema_release": self.decoder.schema.release,
            "schema_exact": int(self.decoder.schema_exact), "frames_seen": stats.frames_seen,
            "frames_recorded": stats.frames_recorded, "frames_dropped": stats.frames_dropped,
            "bytes_seen": stats.bytes_seen,
        })
        db.close()
        return stats
