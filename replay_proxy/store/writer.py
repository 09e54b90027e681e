"""The writer process: the tap's messages into SQLite, decoded when there is time.

Theory of operation. While the tap sends (a message every ``TAP_HOLD_S`` or
so), the writer only holds what came, up to ``hold_frames`` (half the
recorder's queue). Keeping a message as the tap passed it is one row, a few
microseconds a frame; decoding its frames and filling the frame and concept
tables, about a hundred. So once nothing has come for ``QUIET_S``, or
``hold_frames`` are held, the held messages go to the ``undecoded`` table in
one transaction, and decoding catches up (the oldest messages first, about
``DECODE_FRAMES`` frames a transaction in ``seq`` order, deleting them from
``undecoded``) while nothing comes, or when ``MAX_UNDECODED`` frames wait,
and in full before the writer exits. A burst therefore never backs the queue
up into drops, and the writing and decoding move to when the peers are idle
instead of competing with them for the CPU.

It runs in a session of its own, so the signals that stop the proxy's
process group do not reach it: the proxy sends STOP after its last frame and
the writer finishes the queue first. If the proxy dies without STOP, the
writer notices it has another parent than ``parent`` (the proxy's PID,
given, not read at start: the proxy may already be gone by then) and stops
once the queue is empty.

After every step it reports its ``Progress`` to the recorder's tap, which
bounds the queue with it.
"""

from __future__ import annotations

import os
import sqlite3
import struct
import sys
import time
from typing import NamedTuple

import zmq

from replay_proxy.store.rows import Rows
from replay_proxy.store.tables import TABLES
from replay_proxy.wire.capture import STOP, EngineLoss, decode_entries, tap_frames
from replay_proxy.wire.messages import Kind, WireDecoder

DECODE_FRAMES = 500  # frames decoded per transaction, about: the tap is looked at again after each
QUIET_S = 0.1  # twice the tap's hold (recorder.py): once nothing more came for this long, keep and decode ...
MAX_UNDECODED = 100_000  # ... or decodes while the tap still sends, once this many frames are kept
PARENT_CHECK_S = 1.0  # idle this long: is the proxy still there?


class Progress(NamedTuple):
    """What the writer reports after every step; cumulative, so only the newest matters."""

    frames_written: int  # in the database, kept or decoded
    requests: int  # ADDs decoded
    engines_dead: int  # sent ENGINE_CORE_DEAD or vanished
    frames_failed: int  # could not be written (a full disk, a locked file)


PROGRESS = struct.Struct("<qqqq")  # a Progress on the wire


class Writer:
    """One session's writer: holds, keeps and decodes the tap's messages (see the module's docstring)."""

    def __init__(self, db_path: str, session_id: int):
        self.session_id = session_id
        self.connection = sqlite3.connect(db_path)
        self.connection.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable at checkpoints
        self.statements = {
            table: f"INSERT INTO [{table}] ({', '.join(f'[{c}]' for c in columns)}) "
                   f"VALUES ({', '.join('?' for _ in columns)})"
            for table, (columns, _) in TABLES.items()
        }
        self.decoder = WireDecoder()
        self.last_kept = self.last_decoded = 0  # numbers of the tap's messages in ``undecoded``
        self.frames_undecoded = self.frames_written = self.frames_failed = 0
        self.requests = 0
        self.dead: set[int | None] = set()  # engines that sent ENGINE_CORE_DEAD or vanished
        self.write_error: str | None = None

    def progress(self) -> Progress:
        return Progress(self.frames_written, self.requests, len(self.dead), self.frames_failed)

    def _commit(self, rows: Rows, *, done: tuple[int, int] | None = None) -> bool:
        """Write the rows in one transaction; ``done``: the kept messages they replace (a number range)."""
        try:
            with self.connection:
                for table, values in rows.tables.items():
                    self.connection.executemany(self.statements[table], values)
                if done is not None:
                    self.connection.execute("DELETE FROM undecoded WHERE session_id = ? AND number BETWEEN ? AND ?",
                                            (self.session_id, *done))
        except Exception as exc:  # noqa: BLE001 - a full disk, a locked file: count it, keep going
            self.write_error = f"{type(exc).__name__}: {exc}"
            return False
        return True

    def keep(self, messages: list[list[bytes]]) -> None:
        """Keep the tap's messages as they came, numbering them."""
        rows = Rows()
        frames = 0
        for message in messages:
            self.last_kept += 1
            rows.tables["undecoded"].append((self.session_id, self.last_kept, tap_frames(message), message[1]))
            frames += tap_frames(message)
        if self._commit(rows):
            self.frames_written += frames
            self.frames_undecoded += frames
        else:
            self.frames_failed += frames

    @property
    def behind(self) -> bool:
        """Kept messages wait to be decoded."""
        return self.last_decoded < self.last_kept

    def decode_some(self) -> None:
        """Decode and tabulate the oldest kept messages, in seq order; those that fail stay undecoded."""
        rows = Rows()
        captured = []
        frames = 0
        first = last = None
        oldest = self.connection.execute(
            "SELECT number, frames, batch FROM undecoded WHERE session_id = ? AND number > ? ORDER BY number",
            (self.session_id, self.last_decoded))
        for number, count, entries in oldest:
            first = number if first is None else first
            last, frames = number, frames + count
            captured.extend(decode_entries(entries))
            if frames >= DECODE_FRAMES:
                break
        oldest.close()
        if last is None:  # only messages whose keeping failed were left: nothing to decode
            self.last_decoded = self.last_kept
            return
        added = 0
        for item in sorted(captured, key=lambda numbered: numbered.seq):
            if isinstance(item, EngineLoss):
                rows.add_engine_event(self.session_id, item.seq, item.ts_ns, item.engine_index, "lost", item.reason)
                self.dead.add(item.engine_index)
                continue
            message = self.decoder.decode(item.channel, item.direction, item.parts)
            rows.add_frame(self.session_id, item, message, self.decoder.schema)
            added += message.kind is Kind.ADD
            if message.kind is Kind.ENGINE_CORE_DEAD:
                self.dead.add(item.engine_index)
        if self._commit(rows, done=(first, last)):
            self.requests += added
        self.last_decoded, self.frames_undecoded = last, self.frames_undecoded - frames

    def finish(self) -> None:
        """Write the session's totals and close the database."""
        decoder = self.decoder
        with self.connection:
            self.connection.execute(
                "UPDATE sessions SET vllm_version = ?, schema_release = ?, schema_exact = ?, error = ?, "
                "frames_recorded = ?, engines_dead = ? WHERE id = ?",
                (decoder.vllm_version, decoder.schema.release, int(decoder.schema_exact), self.write_error,
                 self.frames_written, len(self.dead), self.session_id))
        self.connection.close()


def run(db_path: str, session_id: int, tap_address: str, progress_address: str, parent: int,
        hold_frames: int) -> None:
    """The writer process's loop: take what the tap sends, hold, keep, decode, report."""
    context = zmq.Context()
    tap = context.socket(zmq.PULL)
    tap.setsockopt(zmq.RCVHWM, 0)  # the tap bounds the queue, in frames
    tap.bind(tap_address)
    progress = context.socket(zmq.PUSH)
    # Only the newest count matters, and a send must never block on a proxy that is gone.
    progress.setsockopt(zmq.CONFLATE, 1)
    progress.setsockopt(zmq.LINGER, 5000)
    progress.connect(progress_address)
    writer = Writer(db_path, session_id)
    progress.send(PROGRESS.pack(*writer.progress()))  # started
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
            if message == STOP:  # the proxy's last frame is in
                stopping = True
                break
            held.append(message)
            held_frames += tap_frames(message)
            last_message = time.monotonic()
        quiet = stopping or time.monotonic() - last_message >= QUIET_S
        if held and (quiet or held_frames >= hold_frames):
            writer.keep(held)
            held, held_frames = [], 0
        elif writer.behind and (quiet or writer.frames_undecoded > MAX_UNDECODED):
            writer.decode_some()
        elif stopping:
            break
        elif not tap.poll(QUIET_S * 1000 if held or writer.behind else PARENT_CHECK_S * 1000) \
                and not held and not writer.behind:
            stopping = os.getppid() != parent  # idle: is the proxy still there?
        progress.send(PROGRESS.pack(*writer.progress()))
    writer.finish()
    tap.close(linger=0)
    progress.close()
    context.term()


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
