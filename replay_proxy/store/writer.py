"""The recorder: frames in from the proxy, rows out to SQLite.

Theory of operation: decoding and SQLite writing happen in a separate
*process*, so they never hold the proxy's GIL (measured: a writer thread
in the proxy process made its p99 round trip several milliseconds, one GIL
switch interval). The relay's forwarder threads copy every message to the
recorder's capture socket (in C, without waiting); the recorder's tap
thread stamps each copy, counts it, and passes what has queued up, up to
``TAP_BATCH`` frames, to the writer process as one ZMQ message (a ZMQ
message costs about 10 us in pyzmq and libzmq, so a burst pays it once per
batch, not per frame). The queue is bounded in frames: the writer reports
how many it has written, and a batch that would put more than
``queue_size`` frames between the tap and SQLite is dropped from the
*recording* (it was forwarded all the same) and counted; the count is shown
live, in the summary and in the ``sessions`` row. ``on_full="block"`` makes
the tap wait for the writer instead, and the forwarders wait once their
copies back up: lossless, at the cost of latency. The writer keeps each
batch as it came, as one row, and decodes it into the frame and concept
tables when the peers are idle (see ``_write_session``).
"""

from __future__ import annotations

import datetime
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Literal

import msgspec
import zmq

from replay_proxy import __version__
from replay_proxy.errors import ReplayProxyError
from replay_proxy.net.relay import CHANNEL_CODE, CHANNELS, FrameEvent, captured
from replay_proxy.store.rows import Rows
from replay_proxy.store.tables import TABLES, open_database
from replay_proxy.wire.messages import Direction, Kind, WireDecoder

TAP_BATCH = 256  # frames per message from the tap to the writer, at most
KEEP_BATCHES = 64  # tap messages kept per transaction, at most
DECODE_ENTRIES = 500  # frames decoded per transaction, about: the tap is checked again after each
PROGRESS_WAIT_MS = 100  # how stale the tap's view of the writer's progress may get while no frames come
QUIET_MS = 20  # decoding waits until the tap has been empty this long ...
MAX_UNDECODED = 100_000  # ... unless this many frames wait for it
STOP_TIMEOUT_S = 120.0
START_TIMEOUT_S = 60.0
# ts_ns, channel, direction, engine index, client index (-1: none), parts that were forwarded changed
_HEADER = struct.Struct("<qBBiiH")
_DIRECTIONS = list(Direction)
_DIRECTION_CODE = {d: i for i, d in enumerate(_DIRECTIONS)}  # dict lookups: this runs for every frame
_RELAY = b"R"  # the identity of the relay thread's frames at the tap
_ENGINE_LOST = 255  # channel code of an engine event rather than a frame
# Counters the writer reports after every batch: frames written, requests, engines dead, frames failed.
_PROGRESS = struct.Struct("<qqqq")
# A message from the tap: its counts (entries, of which frames), then a msgpack list of entries,
# each [header, *parts, *forwarded parts]; an entry is a frame or an engine event. [b""]: STOP.
_COUNTS = struct.Struct("<ii")
_encode_batch = msgspec.msgpack.Encoder().encode
_decode_batch = msgspec.msgpack.Decoder(list[list[bytes]]).decode


class RecorderError(ReplayProxyError):
    """The writer process failed or did not finish in time."""


class RecorderStats(msgspec.Struct, frozen=True):
    frames_seen: int
    frames_recorded: int
    frames_dropped: int
    bytes_seen: int
    requests: int
    queue_depth: int
    engines_dead: int


class SessionInfo(msgspec.Struct, frozen=True):
    name: str
    mode: Literal["record", "replay"] = "record"
    listen: str | None = None
    upstream: str | None = None
    baseline_session_id: int | None = None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


class Recorder:
    """Records one session; an ``Observer`` for the relay.

    Frames reach it two ways: copies from the relay's forwarder threads, which
    arrive on ``capture`` tagged with their link, and ``frame`` calls from the
    relay's own thread (the handshake, the coordinator). A tap thread takes
    both, stamps the copies, counts, and passes everything to the writer
    process. It is the one place that can drop, so it is the one that counts.
    """

    def __init__(self, db_path: str | Path, session: SessionInfo, *,
                 on_full: Literal["drop", "block"] = "drop", queue_size: int = 100_000,
                 context: zmq.Context | None = None):
        self.db_path = Path(db_path)
        self._seen = self._dropped = self._bytes = 0
        self._sent = 0  # frames passed on to the writer
        self._queue_size = queue_size
        db = open_database(self.db_path)
        self.session_id = db["sessions"].insert({
            **msgspec.to_builtins(session), "started_at": _now(), "status": "recording",
            "proxy_version": __version__, "frames_seen": 0, "frames_recorded": 0, "frames_dropped": 0,
        }).last_pk
        db.close()
        self._folder = tempfile.mkdtemp(prefix="replay-proxy-")
        tap, progress = f"ipc://{self._folder}/tap", f"ipc://{self._folder}/progress"
        context = context or zmq.Context.instance()
        # Read by the tap thread only; counts are cumulative, so only the newest matters.
        self._progress = context.socket(zmq.PULL)
        self._progress.setsockopt(zmq.CONFLATE, 1)
        self._progress.bind(progress)
        self._counters = (0, 0, 0, 0)
        self._progress_due = 0.0  # when the tap thread reads the writer's progress next
        # We connect, the writer binds: a connecting PUSH queues from the first frame on,
        # even before the writer process has started. Unbounded here: the tap counts.
        self._tap = context.socket(zmq.PUSH)
        self._tap.setsockopt(zmq.SNDHWM, 0)
        self._tap.setsockopt(zmq.LINGER, -1)
        self._tap.connect(tap)
        self._block = on_full == "block"
        # Forwarders must never wait for us when dropping is allowed; when it is not, they wait
        # once their copy queue holds a queue's worth (an inproc pipe is bounded only if both ends are).
        self.capture_hwm = max(1, queue_size // 2) if self._block else 0
        self.capture = f"inproc://replay-proxy-capture-{uuid.uuid4().hex}"
        self._collector = context.socket(zmq.ROUTER)
        self._collector.setsockopt(zmq.RCVHWM, self.capture_hwm)
        self._collector.setsockopt(zmq.RCVTIMEO, PROGRESS_WAIT_MS)
        self._collector.bind(self.capture)
        self._mine = context.socket(zmq.DEALER)  # frames from the relay's own thread
        self._mine.setsockopt(zmq.SNDHWM, 0)
        self._mine.setsockopt(zmq.IDENTITY, _RELAY)
        self._mine.connect(self.capture)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "replay_proxy.store.writer", str(self.db_path), str(self.session_id), tap,
             progress, str(os.getpid())], stdin=subprocess.DEVNULL,
            start_new_session=True)  # SIGINT/SIGTERM for the proxy's group must not cut the writer short
        # Its start (imports, opening the database) takes a CPU for a while: have it done before
        # the relay opens, not while the first frames pass.
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._progress.poll(100):  # its first report says it has started
            if self._process.poll() is not None or time.monotonic() > deadline:
                self._give_up_starting()
        self._tap_thread = threading.Thread(target=self._pass_on, daemon=True, name="recorder tap")
        self._tap_thread.start()
        self.status = "recording"

    def _give_up_starting(self) -> None:
        self._process.kill()
        for sock in (self._tap, self._collector, self._mine, self._progress):
            sock.close(linger=0)
        shutil.rmtree(self._folder, ignore_errors=True)
        error = f"the writer process did not start (exit code {self._process.wait(5)})"
        db = open_database(self.db_path)
        db["sessions"].update(self.session_id, {"ended_at": _now(), "status": "failed", "error": error})
        db.close()
        raise RecorderError(error)

    # --- called by the relay's thread ------------------------------------------------------

    def frame(self, event: FrameEvent) -> None:
        if self._mine.closed:  # the session is over: a late report from a peer shutting down
            return
        changed = len(event.forwarded) if event.forwarded else 0
        header = _HEADER.pack(event.ts_ns, CHANNEL_CODE[event.channel], _DIRECTION_CODE[event.direction],
                              -1 if event.engine_index is None else event.engine_index,
                              -1 if event.client_index is None else event.client_index, changed)
        self._mine.send_multipart([header, *event.frames, *(event.forwarded or ())])

    def engine_lost(self, engine_index: int, reason: str) -> None:
        if self._mine.closed:
            return
        header = _HEADER.pack(time.time_ns(), _ENGINE_LOST, 0, engine_index, -1, 0)
        self._mine.send_multipart([header, reason.encode()])

    # --- the tap thread -------------------------------------------------------------------

    def _pass_on(self) -> None:
        """Stamp, count and pass every frame on to the writer, until STOP from the relay's thread."""
        collector = self._collector
        most = min(TAP_BATCH, self._queue_size)
        receive = 0  # wait for frames (up to PROGRESS_WAIT_MS); after STOP, take only what is queued
        while True:
            batch: list[list[bytes]] = []
            frames = 0
            while frames < most:
                try:
                    source, *message = collector.recv_multipart(zmq.NOBLOCK if batch else receive)
                except zmq.Again:
                    break
                if source == _RELAY:
                    if message == [b""]:
                        receive = zmq.NOBLOCK  # STOP: what the forwarders copied is queued; take it all first
                        continue
                    _, channel, _, _, _, changed = _HEADER.unpack(message[0])
                    if channel == _ENGINE_LOST:
                        batch.append(message)
                        continue
                    parts = message[1:len(message) - changed]
                else:
                    channel, direction, engine, client = captured(source, message)
                    parts = message
                    message = [_HEADER.pack(time.time_ns(), CHANNEL_CODE[channel], _DIRECTION_CODE[direction],
                                            engine, client, 0), *message]
                batch.append(message)
                frames += 1
                self._bytes += sum(map(len, parts))
            self._seen += frames
            if time.monotonic() >= self._progress_due:
                self._read_progress(0)
            if batch:
                self._send(batch, frames)
            elif receive:  # STOP came, and everything queued before it is passed on
                self._tap.send_multipart([b""])
                return

    def _send(self, batch: list[list[bytes]], frames: int) -> None:
        """Pass a batch on, or drop it if the queue has no room for it (in block mode: wait for room)."""
        if not self._has_room(frames):
            self._read_progress(0)  # the count we have may be stale
            while not self._has_room(frames):
                if self._block and self._process.poll() is None:
                    self._read_progress(PROGRESS_WAIT_MS)
                    continue
                self._dropped += frames  # from the recording: they were forwarded all the same
                # An engine's loss is no frame: it takes no room, and is kept.
                batch, frames = [entry for entry in batch if _HEADER.unpack(entry[0])[1] == _ENGINE_LOST], 0
                if not batch:
                    return
        self._tap.send_multipart([_COUNTS.pack(len(batch), frames), _encode_batch(batch)])
        self._sent += frames

    def _has_room(self, frames: int) -> bool:
        written, _, _, failed = self._counters
        return self._sent - written - failed + frames <= self._queue_size

    def _read_progress(self, timeout_ms: int) -> None:
        """Take the writer's latest report, waiting up to ``timeout_ms`` for one."""
        if self._progress.poll(timeout_ms):
            self._counters = _PROGRESS.unpack(self._progress.recv())
        self._progress_due = time.monotonic() + PROGRESS_WAIT_MS / 1000

    def statistics(self) -> RecorderStats:
        written, requests, dead, failed = self._counters
        return RecorderStats(self._seen, written, self._dropped + failed, self._bytes, requests,
                             self._seen - self._dropped - written - failed, dead)

    def close(self, status: str = "complete", error: str | None = None) -> RecorderStats:
        """Flush everything queued, stop the writer, then finish the session row.

        Stop the relay first: what its forwarders copy after this is not recorded."""
        self._mine.send_multipart([b""])  # STOP: after every frame already queued
        self._mine.close(linger=-1)
        self._tap_thread.join(STOP_TIMEOUT_S)
        try:
            code = self._process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            code = self._process.wait(5)
            error = error or f"the writer did not finish within {STOP_TIMEOUT_S:g} s"
        if code != 0:
            status, error = "incomplete", error or f"the writer process exited with {code}"
        self.status = status
        if not self._tap_thread.is_alive():  # else it still owns them; the process exit takes them
            for sock in (self._tap, self._collector, self._progress):
                sock.close(linger=0)
        shutil.rmtree(self._folder, ignore_errors=True)
        # The final counts come from the database, where the writer left them: the progress
        # socket only keeps the newest live report, and the last one may still be in flight.
        db = open_database(self.db_path)
        row = db["sessions"].get(self.session_id)
        recorded = row["frames_recorded"] or 0
        requests = db.execute("SELECT COUNT(*) FROM requests WHERE session_id = ?", [self.session_id]).fetchone()[0]
        # Whatever was seen and not written is lost: dropped at the queue, failed, or cut off.
        stats = RecorderStats(self._seen, recorded, self._seen - recorded, self._bytes, requests, 0,
                              row["engines_dead"] or 0)
        db["sessions"].update(self.session_id, {
            "ended_at": _now(), "status": status, "error": error or row["error"], "frames_seen": stats.frames_seen,
            "frames_dropped": stats.frames_dropped, "bytes_seen": stats.bytes_seen,
        })
        db.close()
        return stats


def _write_session(db_path: str, session_id: int, tap_address: str, progress_address: str, parent: int) -> None:
    """The writer process: batches from the tap into SQLite as they come, decoded when it has time.

    Keeping a batch as the tap passed it is one row, a few microseconds a
    frame; decoding its frames and filling the frame and concept tables, about
    a hundred. So the tap always comes first: batches go to the ``undecoded``
    table, and decoding catches up (in ``seq`` order, one batch per
    transaction, deleting it from ``undecoded``) once the tap has been quiet
    for ``QUIET_MS``, or when ``MAX_UNDECODED`` frames wait, and in full
    before the writer exits. A burst therefore never backs the queue up into
    drops, and the decoding work moves to when the peers are idle instead of
    competing with them for the CPU.

    It runs in a session of its own, so the signals that stop the proxy's
    process group do not reach it: the proxy sends STOP after its last frame
    and the writer finishes the queue first. If the proxy dies without STOP,
    the writer notices it has another parent than ``parent`` (the proxy's PID,
    given, not read at start: the proxy may already be gone by then) and stops
    once the queue is empty.
    """
    import sqlite3

    context = zmq.Context()
    tap = context.socket(zmq.PULL)
    tap.setsockopt(zmq.RCVHWM, 0)  # the tap bounds the queue, in frames
    tap.bind(tap_address)
    progress = context.socket(zmq.PUSH)
    # Only the newest count matters, and a send must never block on a proxy that is gone.
    progress.setsockopt(zmq.CONFLATE, 1)
    progress.setsockopt(zmq.LINGER, 5000)
    progress.connect(progress_address)
    connection = sqlite3.connect(db_path)
    connection.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable at checkpoints
    statements = {
        table: f"INSERT INTO [{table}] ({', '.join(f'[{c}]' for c in columns)}) "
               f"VALUES ({', '.join('?' for _ in columns)})"
        for table, (columns, _) in TABLES.items()
    }
    decoder = WireDecoder()
    seq = written = decoded = requests = failed = 0
    dead: set[int | None] = set()  # engines that sent ENGINE_CORE_DEAD or vanished
    write_error = None

    def commit(rows: Rows, *, done: tuple[int, int] | None = None) -> bool:
        """Write the rows in one transaction; ``done``: the undecoded batches they replace (first_seq range)."""
        nonlocal write_error
        try:
            with connection:
                for table, values in rows.tables.items():
                    connection.executemany(statements[table], values)
                if done is not None:
                    connection.execute("DELETE FROM undecoded WHERE session_id = ? AND first_seq BETWEEN ? AND ?",
                                       (session_id, *done))
        except Exception as exc:  # noqa: BLE001 - a full disk, a locked file: count it, keep going
            write_error = f"{type(exc).__name__}: {exc}"
            return False
        return True

    def keep(batches: list[list[bytes]]) -> None:
        """Keep the tap's batches as they came, numbering their frames."""
        nonlocal seq, written, failed
        rows = Rows()
        frames = 0
        for counts, batch in batches:
            entries, batch_frames = _COUNTS.unpack(counts)
            rows.tables["undecoded"].append((session_id, seq + 1, entries, batch))
            seq += entries
            frames += batch_frames
        if commit(rows):
            written += frames
        else:
            failed += frames

    def decode_some() -> None:
        """Decode and tabulate the oldest undecoded batches; batches that fail stay undecoded."""
        nonlocal decoded, requests
        rows = Rows()
        added = entries = 0
        first = last = None
        oldest = connection.execute(
            "SELECT first_seq, entries, batch FROM undecoded WHERE session_id = ? AND first_seq > ? "
            "ORDER BY first_seq", (session_id, decoded))
        for first_seq, count, batch in oldest:
            first = first_seq if first is None else first
            last, entries = first_seq, entries + count
            added += tabulate(rows, first_seq, batch)
            if entries >= DECODE_ENTRIES:
                break
        oldest.close()
        if first is None:  # only batches whose keeping failed were left: nothing to decode
            decoded = seq
            return
        if commit(rows, done=(first, last)):
            requests += added
        decoded = last + count - 1

    def tabulate(rows: Rows, first: int, batch: bytes) -> int:
        """Add the rows of one kept batch, its first entry numbered ``first``; return its ADD count."""
        added = 0
        for number, entry in enumerate(_decode_batch(batch), first):
            ts_ns, channel, direction, engine, client, changed = _HEADER.unpack(entry[0])
            engine = None if engine < 0 else engine
            if channel == _ENGINE_LOST:
                rows.add_engine_event(session_id, number, ts_ns, engine, "lost", entry[1].decode())
                dead.add(engine)
                continue
            event = FrameEvent(ts_ns, CHANNELS[channel], _DIRECTIONS[direction], engine,
                               None if client < 0 else client, entry[1:len(entry) - changed],
                               entry[len(entry) - changed:] if changed else None)
            message = decoder.decode(event.channel, event.direction, event.frames)
            rows.add_frame(session_id, number, event, message, decoder.schema)
            added += message.kind is Kind.ADD
            if message.kind is Kind.ENGINE_CORE_DEAD:
                dead.add(event.engine_index)
        return added

    progress.send(_PROGRESS.pack(0, 0, 0, 0))  # started
    stopping = quiet = False  # quiet: the tap stayed empty for QUIET_MS, the peers are idle
    while True:
        behind = decoded < seq
        may_decode = stopping or quiet or seq - decoded > MAX_UNDECODED
        if tap.poll(0 if behind and may_decode else QUIET_MS if behind else 1000):
            batches: list[list[bytes]] = []
            while len(batches) < KEEP_BATCHES:
                try:
                    message = tap.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if message == [b""]:  # STOP: the proxy's last frame is in
                    stopping = True
                    break
                batches.append(message)
            keep(batches)
            quiet = False
        elif behind:
            quiet = True
            decode_some()
        elif stopping:
            break
        else:
            stopping = os.getppid() != parent
        progress.send(_PROGRESS.pack(written, requests, len(dead), failed))
    with connection:
        connection.execute(
            "UPDATE sessions SET vllm_version = ?, schema_release = ?, schema_exact = ?, error = ?, "
            "frames_recorded = ?, engines_dead = ? WHERE id = ?",
            (decoder.vllm_version, decoder.schema.release, int(decoder.schema_exact), write_error, written, len(dead),
             session_id))
    connection.close()
    tap.close(linger=0)
    progress.close()
    context.term()


if __name__ == "__main__":
    _write_session(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
