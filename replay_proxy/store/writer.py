"""The recorder: frames in from the proxy, rows out to SQLite.

Theory of operation: decoding and SQLite writing happen in a separate
*process*, so they never hold the proxy's GIL (measured: a writer thread
in the proxy process made its p99 round trip several milliseconds, one GIL
switch interval). The relay's forwarder threads number and stamp every
message as it passes and send the copies to the recorder's capture socket
in batches (in C, without waiting: see ``net/_forward.c``). The recorder's
tap thread counts them and passes what came within ``TAP_HOLD_S`` to the
writer process as one ZMQ message. Nothing in Python is woken for each
frame, and the writer only a few times a second: on this
project's 2-core machine a Python thread woken for every frame, doing
nothing else, costs more round-trip latency than the forwarding hop itself
(``scripts/bench/forward.py``).

The queue is bounded in frames: the writer reports how many it has written,
and a batch that would put more than ``queue_size`` frames between the tap
and SQLite is dropped from the *recording* (it was forwarded all the same;
its numbers are a gap in ``seq``) and counted; the count is shown live, in
the summary and in the ``sessions`` row. ``on_full="block"`` makes the tap
wait for the writer instead, and the forwarders wait once their copies back
up: lossless, at the cost of latency. The writer holds what came in memory
while the peers are busy, keeps it as it came (one row per message from the
tap) once they pause or half the queue is held, and decodes it into the
frame and concept tables when they are idle (see ``_write_session``).
"""

from __future__ import annotations

import datetime
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import msgspec
import zmq

from replay_proxy import __version__
from replay_proxy.errors import ReplayProxyError
from replay_proxy.net.loop import FLUSH_MS, Counter, batch_counts, unbatch
from replay_proxy.net.relay import CHANNEL_CODE, CHANNELS, FrameEvent, captured
from replay_proxy.store.rows import Rows
from replay_proxy.store.tables import TABLES, open_database
from replay_proxy.wire.messages import Direction, Kind, WireDecoder

TAP_BATCH = 4096  # frames per message from the tap to the writer, at most (unless one batch has more) ...
TAP_HOLD_S = 0.05  # ... and how long the tap holds them at most
BLOCK_BATCHES = 4  # in block mode, batches of copies that may wait at each end of a forwarder's pipe
DECODE_FRAMES = 500  # frames decoded per transaction, about: the tap is looked at again after each
STOP_GRACE_MS = 10 * FLUSH_MS  # copies still batched in a running forwarder come within FLUSH_MS
PROGRESS_WAIT_MS = 100  # how stale the tap's view of the writer's progress may get while no frames come
QUIET_S = 2 * TAP_HOLD_S  # the writer keeps and decodes what came once nothing more came for this long ...
MAX_UNDECODED = 100_000  # ... or decodes while the tap still sends, once this many frames are kept
STOP_TIMEOUT_S = 120.0
START_TIMEOUT_S = 60.0
# A frame reported by the relay's own thread: seq, ts_ns, channel, direction, engine index,
# client index (-1: none), parts that were forwarded changed.
_HEADER = struct.Struct("<QqBBiiH")
_DIRECTIONS = list(Direction)
_DIRECTION_CODE = {d: i for i, d in enumerate(_DIRECTIONS)}  # dict lookups: runs per frame the relay reports
_RELAY = b"R"  # the identity of the relay thread's frames at the tap
_ENGINE_LOST = 255  # channel code of an engine event rather than a frame
# Counters the writer reports after every batch: frames written, requests, engines dead, frames failed.
_PROGRESS = struct.Struct("<qqqq")
# A message from the tap: its frame count, then a msgpack list of entries, each either
# [_RELAY, header, *parts, *forwarded parts] (a frame or an engine event from the relay's thread)
# or [forwarder's tag, batch of copies]. [b""]: STOP.
_FRAMES = struct.Struct("<q")
_encode_batch = msgspec.msgpack.Encoder().encode
_decode_batch = msgspec.msgpack.Decoder(list[list[bytes]]).decode


def _is_engine_lost(entry: list[bytes]) -> bool:
    return entry[0] == _RELAY and _HEADER.unpack(entry[1])[2] == _ENGINE_LOST


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

    Frames reach it two ways: batches of copies from the relay's forwarder
    threads, which arrive on ``capture`` tagged with their link, and ``frame``
    calls from the relay's own thread (the handshake, the coordinator). Both
    number their frames from one ``counter``, so ``seq`` is the order the
    proxy forwarded them in, across links. A tap thread takes both, counts,
    and passes everything to the writer process. It is the one place that
    can drop, so it is the one that counts.
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
        # once a few batches queue (an inproc pipe is bounded only if both ends are).
        self.capture_hwm = BLOCK_BATCHES if self._block else 0
        self.counter = Counter()
        self.capture = f"inproc://replay-proxy-capture-{uuid.uuid4().hex}"
        self._collector = context.socket(zmq.ROUTER)
        self._collector.setsockopt(zmq.RCVHWM, self.capture_hwm)
        self._collector.bind(self.capture)
        self._mine = context.socket(zmq.DEALER)  # frames from the relay's own thread
        self._mine.setsockopt(zmq.SNDHWM, 0)
        self._mine.setsockopt(zmq.IDENTITY, _RELAY)
        self._mine.connect(self.capture)
        self._process = subprocess.Popen(
            [sys.executable, "-m", "replay_proxy.store.writer", str(self.db_path), str(self.session_id), tap,
             progress, str(os.getpid()), str(max(1, queue_size // 2))], stdin=subprocess.DEVNULL,
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
        header = _HEADER.pack(self.counter.next(), event.ts_ns, CHANNEL_CODE[event.channel],
                              _DIRECTION_CODE[event.direction],
                              -1 if event.engine_index is None else event.engine_index,
                              -1 if event.client_index is None else event.client_index, changed)
        self._mine.send_multipart([header, *event.frames, *(event.forwarded or ())])

    def engine_lost(self, engine_index: int, reason: str) -> None:
        if self._mine.closed:
            return
        header = _HEADER.pack(self.counter.next(), time.time_ns(), _ENGINE_LOST, 0, engine_index, -1, 0)
        self._mine.send_multipart([header, reason.encode()])

    # --- the tap thread -------------------------------------------------------------------

    def _pass_on(self) -> None:
        """Count and pass every frame on to the writer, until STOP from the relay's thread."""
        collector = self._collector
        most = min(TAP_BATCH, self._queue_size)
        stop_by = None  # after STOP: when the forwarders' last batches are in
        while True:
            batch: list[list[bytes]] = []
            frames = 0
            due = None  # when the batch goes: held a while, so that the writer's side wakes less
            while frames < most:
                deadline = due or stop_by
                if not collector.poll(PROGRESS_WAIT_MS if deadline is None
                                      else max(0.0, deadline - time.monotonic()) * 1000):
                    break
                message = collector.recv_multipart()
                if due is None:
                    due = min(time.monotonic() + TAP_HOLD_S, stop_by or math.inf)
                if message[0] == _RELAY:
                    if message[1:] == [b""]:
                        # STOP: a forwarder still running sends what it has batched within FLUSH_MS.
                        stop_by = time.monotonic() + STOP_GRACE_MS / 1000
                        continue
                    _, _, channel, _, _, _, changed = _HEADER.unpack(message[1])
                    if channel != _ENGINE_LOST:
                        frames += 1
                        self._bytes += sum(map(len, message[2:len(message) - changed]))
                else:
                    copies, nbytes = batch_counts(message[1])
                    frames += copies
                    self._bytes += nbytes
                batch.append(message)
            self._seen += frames
            if time.monotonic() >= self._progress_due:
                self._read_progress(0)
            if batch:
                self._send(batch, frames)
            elif stop_by is not None and time.monotonic() >= stop_by:  # everything before STOP is passed on
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
                batch, frames = [entry for entry in batch if _is_engine_lost(entry)], 0
                if not batch:
                    return
        self._tap.send_multipart([_FRAMES.pack(frames), _encode_batch(batch)])
        self._sent += frames

    def _has_room(self, frames: int) -> bool:
        """Room for ``frames`` more; an empty queue takes a batch of copies larger than its size."""
        written, _, _, failed = self._counters
        queued = self._sent - written - failed
        return queued == 0 or queued + frames <= self._queue_size

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


class _EngineLoss(msgspec.Struct, frozen=True):
    ts_ns: int
    engine_index: int | None
    reason: str


def _unpack(message: bytes) -> Iterator[tuple[int, FrameEvent | _EngineLoss]]:
    """The numbered frames and engine losses of one message from the tap, as it was kept."""
    for entry in _decode_batch(message):
        if entry[0] != _RELAY:  # a batch of copies from a forwarder
            for seq, ts_ns, parts in unbatch(entry[1]):
                channel, direction, engine, client = captured(entry[0], parts)
                yield seq, FrameEvent(ts_ns, channel, direction, engine, client, parts)
            continue
        seq, ts_ns, channel, direction, engine, client, changed = _HEADER.unpack(entry[1])
        engine = None if engine < 0 else engine
        if channel == _ENGINE_LOST:
            yield seq, _EngineLoss(ts_ns, engine, entry[2].decode())
            continue
        end = len(entry) - changed
        yield seq, FrameEvent(ts_ns, CHANNELS[channel], _DIRECTIONS[direction], engine,
                              None if client < 0 else client, entry[2:end], entry[end:] if changed else None)


def _write_session(db_path: str, session_id: int, tap_address: str, progress_address: str, parent: int,
                   hold_frames: int) -> None:
    """The writer process: messages from the tap into SQLite, decoded when it has time.

    While the tap sends (a message every ``TAP_HOLD_S`` or so), the writer
    only holds what came, up to ``hold_frames`` (half the queue).
    Keeping a message as the tap passed it is one row, a few microseconds a
    frame; decoding its frames and filling the frame and concept tables, about
    a hundred. So once nothing has come for ``QUIET_S``, or ``hold_frames``
    are held, the held messages go to the ``undecoded`` table in one
    transaction, and decoding catches up (the oldest messages first, about
    ``DECODE_FRAMES`` frames a transaction in ``seq`` order, deleting them
    from ``undecoded``) while nothing comes, or when ``MAX_UNDECODED`` frames
    wait, and in full before the writer exits. A burst therefore never backs
    the queue up into drops, and the writing and decoding move to when the
    peers are idle instead of competing with them for the CPU.

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
    kept = decoded = 0  # numbers of the tap's messages: the last kept, the last decoded
    undecoded = written = requests = failed = 0  # frames
    dead: set[int | None] = set()  # engines that sent ENGINE_CORE_DEAD or vanished
    write_error = None

    def commit(rows: Rows, *, done: tuple[int, int] | None = None) -> bool:
        """Write the rows in one transaction; ``done``: the kept messages they replace (a number range)."""
        nonlocal write_error
        try:
            with connection:
                for table, values in rows.tables.items():
                    connection.executemany(statements[table], values)
                if done is not None:
                    connection.execute("DELETE FROM undecoded WHERE session_id = ? AND number BETWEEN ? AND ?",
                                       (session_id, *done))
        except Exception as exc:  # noqa: BLE001 - a full disk, a locked file: count it, keep going
            write_error = f"{type(exc).__name__}: {exc}"
            return False
        return True

    def keep(messages: list[list[bytes]]) -> None:
        """Keep the tap's messages as they came, numbering them."""
        nonlocal kept, undecoded, written, failed
        rows = Rows()
        frames = 0
        for count, batch in messages:
            (message_frames,) = _FRAMES.unpack(count)
            kept += 1
            rows.tables["undecoded"].append((session_id, kept, message_frames, batch))
            frames += message_frames
        if commit(rows):
            written += frames
            undecoded += frames
        else:
            failed += frames

    def decode_some() -> None:
        """Decode and tabulate the oldest kept messages, in seq order; those that fail stay undecoded."""
        nonlocal decoded, undecoded, requests
        rows = Rows()
        events: list[tuple[int, FrameEvent | _EngineLoss]] = []
        frames = 0
        first = last = None
        oldest = connection.execute(
            "SELECT number, frames, batch FROM undecoded WHERE session_id = ? AND number > ? ORDER BY number",
            (session_id, decoded))
        for number, count, batch in oldest:
            first = number if first is None else first
            last, frames = number, frames + count
            events.extend(_unpack(batch))
            if frames >= DECODE_FRAMES:
                break
        oldest.close()
        if last is None:  # only messages whose keeping failed were left: nothing to decode
            decoded = kept
            return
        added = 0
        for seq, event in sorted(events, key=lambda numbered: numbered[0]):
            if isinstance(event, _EngineLoss):
                rows.add_engine_event(session_id, seq, event.ts_ns, event.engine_index, "lost", event.reason)
                dead.add(event.engine_index)
                continue
            message = decoder.decode(event.channel, event.direction, event.frames)
            rows.add_frame(session_id, seq, event, message, decoder.schema)
            added += message.kind is Kind.ADD
            if message.kind is Kind.ENGINE_CORE_DEAD:
                dead.add(event.engine_index)
        if commit(rows, done=(first, last)):
            requests += added
        decoded, undecoded = last, undecoded - frames

    progress.send(_PROGRESS.pack(0, 0, 0, 0))  # started
    held: list[list[bytes]] = []  # the tap's messages, in memory while the peers are busy
    held_frames = 0
    last_message = time.monotonic()
    stopping = False
    while True:
        while not stopping:  # take what the tap has sent since the last look, without waiting
            try:
                message = tap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if message == [b""]:  # STOP: the proxy's last frame is in
                stopping = True
                break
            held.append(message)
            held_frames += _FRAMES.unpack(message[0])[0]
            last_message = time.monotonic()
        quiet = stopping or time.monotonic() - last_message >= QUIET_S
        if held and (quiet or held_frames >= hold_frames):
            keep(held)
            held, held_frames = [], 0
        elif decoded < kept and (quiet or undecoded > MAX_UNDECODED):
            decode_some()
        elif stopping:
            break
        elif not tap.poll(QUIET_S * 1000 if held or decoded < kept else 1000) and not held and decoded == kept:
            stopping = os.getppid() != parent  # idle for a second: is the proxy still there?
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
    _write_session(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
