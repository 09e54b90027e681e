"""The writer process: the tap's messages into SQLite, decoded as they come.

Theory of operation. The tap sends a message every ``TAP_HOLD_S`` or so
(``recorder.py``). The writer takes what has come, decodes it (the typed
fast path for conforming output frames, ``wire/typed.py``) and writes the
frame and concept tables in transactions of about ``DECODE_FRAMES`` frames,
so a frame is queryable well within a second of crossing the proxy and a
failed transaction (a full disk) loses no more than that.

If decoding falls behind, what waits is bounded: past ``HOLD_BYTES``, or
half the recorder's queue (``hold_frames``: the queue must not fill while
keeping would keep up), the waiting messages are *kept* as they came (one
row each in ``undecoded``, a few microseconds a frame) and decoded from
there, oldest first, until it has caught up; frames are always decoded in the order they
came. On STOP the writer decodes for at most ``STOP_DECODE_S``, keeps the
rest and exits, so ``record`` ends in seconds at any load; whatever is kept
undecoded is counted in ``sessions.frames_undecoded`` and ``replay-proxy
decode`` (or a replay or diff of the session) finishes it.

It runs in a session of its own, so the signals that stop the proxy's
process group do not reach it: the proxy sends STOP, with the session's
status and final counts, after its last frame. If the proxy dies without
STOP, the writer notices it has another parent than ``parent`` (the proxy's
PID, given, not read at start: the proxy may already be gone by then),
finishes what it has and marks the session ``interrupted``, with the count of
frames seen that the tap's last message carried. Recording redacted, the
messages come through the redactor process (``store/redactor.py``), which
may still be passing STOP on when the proxy has gone: the writer waits for
it while that process runs.

After every step it reports its ``Progress`` to the recorder's tap, which
bounds the queue with it and shows it on the status line.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import sys
import time
from collections.abc import Iterable

import msgspec
import zmq

from replay_proxy.clock import utc_now
from replay_proxy.redact.settings import Redaction, redaction_counts
from replay_proxy.store.protocol import Batch, Progress, Stop, WriterStart, encode_progress, header
from replay_proxy.store.rows import Rows
from replay_proxy.store.tables import TABLES
from replay_proxy.wire.capture import CapturedFrame, EngineLoss, decode_entries
from replay_proxy.wire.messages import Kind, WireDecoder
from replay_proxy.wire.schema import release_key

DECODE_FRAMES = 2_000  # frames a transaction, about: the tap is looked at again after each
HOLD_BYTES = 64 * 2**20  # tap messages waiting in memory beyond this are kept on disk instead
STOP_DECODE_S = 2.0  # after STOP: decode this long at most, then keep the rest
PARENT_CHECK_S = 1.0  # how often: is the proxy still there?


Entries = tuple[int, bytes]  # a tap message's frames, and its entries (wire/capture.py) as sent


class Writer:
    """One session's writer: decodes, or keeps and later decodes, the tap's messages.

    It picks up where the session's database stands, so it also finishes a session left partly
    decoded (``replay-proxy decode``). With ``redaction`` (``replay-proxy redact``), every frame is
    redacted before it is written; a recording is redacted before it reaches the writer
    (``store/redactor.py``).
    """

    def __init__(self, db_path: str, session_id: int, *, max_bytes: int | None = None,
                 redaction: Redaction | None = None):
        self.session_id = session_id
        self.connection = sqlite3.connect(db_path, timeout=30)
        self.connection.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable at checkpoints
        self.connection.execute("PRAGMA cache_size=-32768")  # 32 MB: the tables' B-tree pages stay in memory
        if max_bytes:  # the file's own page size: an older file may have another
            page_bytes = self.connection.execute("PRAGMA page_size").fetchone()[0]
            self.connection.execute(f"PRAGMA max_page_count={max(1, max_bytes // page_bytes)}")
        self.statements = {
            table: f"INSERT INTO [{table}] ({', '.join(f'[{c}]' for c in columns)}) "
                   f"VALUES ({', '.join('?' for _ in columns)})"
            for table, (columns, _) in TABLES.items()
        }
        version, recorded = self.connection.execute(
            "SELECT vllm_version, COALESCE(frames_recorded, 0) FROM sessions WHERE id = ?", (session_id,)).fetchone()
        self.decoder = WireDecoder()
        self.decoder.learn_version(version)  # a session decoded before in part: its registration is past
        self.redactor = redaction.redactor(version) if redaction is not None else None
        self.request_numbers = dict(self.connection.execute(
            "SELECT request_id, number FROM request_ids WHERE session_id = ?", (session_id,)))
        first, last, undecoded = self.connection.execute(
            "SELECT MIN(number), MAX(number), COALESCE(SUM(frames), 0) FROM undecoded WHERE session_id = ?",
            (session_id,)).fetchone()
        self.last_decoded = (first - 1) if first is not None else 0  # numbers of the kept messages
        self.last_kept = last or 0
        self.frames_undecoded, self.frames_written, self.frames_failed = undecoded, recorded, 0
        self.requests = 0
        self.dead: set[int | None] = {e for (e,) in self.connection.execute(  # sent ENGINE_CORE_DEAD or vanished
            "SELECT DISTINCT engine_index FROM engine_events WHERE session_id = ?", (session_id,))}
        self.write_error: str | None = None
        self.alarmed = {tuple(r) for r in self.connection.execute(  # drift alarms raised: (struct, issue, field, position)
            "SELECT struct, issue, field, position FROM drift_alarms WHERE session_id = ?", (session_id,))}
        self.last_alarm: str | None = None

    def progress(self) -> Progress:
        return Progress(frames_written=self.frames_written, requests=self.requests, engines_dead=len(self.dead),
                        frames_failed=self.frames_failed, frames_undecoded=self.frames_undecoded,
                        drift_alarms=len(self.alarmed), write_error=self.write_error, drift=self.last_alarm)

    def _alarms(self, rows: Rows) -> None:
        """A drift alarm row for each new way a frame disagreed with its schema (the first frame of each)."""
        announced = self.decoder.vllm_version
        for frame, kind, flags, schema in rows.flagged:
            exact = announced is not None and release_key(announced) == release_key(schema.release)
            against = f"the {schema.release} schema" + ("" if exact else
                                                        f" (nearest to the announced {announced or 'nothing'})")
            for flag in flags:
                key = (flag.struct, flag.issue, flag.field, flag.position)
                if key in self.alarmed:
                    continue
                self.alarmed.add(key)
                where = f"position {flag.position}" if flag.position is not None else \
                    f"field {flag.field}" if flag.field else flag.path
                self.last_alarm = (f"drift: {kind} {flag.struct} {where}: {flag.issue.replace('_', ' ')}"
                                   f"{f' (expected {flag.expected}, got {flag.got})' if flag.expected else ''}"
                                   f" against {against}")
                rows.tables["drift_alarms"].append((
                    self.session_id, frame.seq, frame.ts_ns, frame.engine_index, frame.client_index, str(kind),
                    flag.struct, flag.issue, flag.field, flag.position, flag.path, flag.expected, flag.got,
                    schema.release, announced, self.last_alarm))

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
            rows.forget_new_request_ids()
            return False
        return True

    def _tabulate(self, captured: Iterable[CapturedFrame | EngineLoss]) -> tuple[Rows, int]:
        """Every row of these frames, in seq order; and how many were ADDs."""
        rows = Rows(self.request_numbers)
        added = 0
        for item in sorted(captured, key=lambda numbered: numbered.seq):
            if isinstance(item, EngineLoss):
                rows.add_engine_event(self.session_id, item.seq, item.ts_ns, item.engine_index, "lost", item.reason)
                self.dead.add(item.engine_index)
                continue
            kind = rows.add(self.session_id, item, self.decoder)
            added += kind is Kind.ADD
            if kind is Kind.ENGINE_CORE_DEAD:
                self.dead.add(item.engine_index)
        if rows.flagged:
            self._alarms(rows)
        return rows, added

    def write(self, messages: list[Entries]) -> None:
        """Decode the tap's messages and write them, in one transaction."""
        self.write_frames([item for _, entries in messages for item in decode_entries(entries)])

    def write_frames(self, captured: list[CapturedFrame | EngineLoss]) -> None:
        """Tabulate and write captured frames, in one transaction (redacted first, if redacting)."""
        if self.redactor is not None:
            captured = self.redactor.frames(captured)
        frames = sum(type(item) is CapturedFrame for item in captured)
        rows, added = self._tabulate(captured)
        if self._commit(rows):
            self.frames_written += frames
            self.requests += added
        else:
            self.frames_failed += frames

    def keep(self, messages: list[Entries]) -> None:
        """Keep the tap's messages as they came, numbering them, about ``DECODE_FRAMES`` x 10 a transaction."""
        while messages:
            rows, frames, taken = Rows(), 0, 0
            for count, entries in messages:
                rows.tables["undecoded"].append((self.session_id, self.last_kept + taken + 1, count, entries))
                frames, taken = frames + count, taken + 1
                if frames >= 10 * DECODE_FRAMES:
                    break
            messages = messages[taken:]
            if self._commit(rows):
                self.last_kept += taken
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
        rows, added = self._tabulate(captured)
        if self._commit(rows, done=(first, last)):
            self.requests += added
            self.frames_undecoded -= frames
        self.last_decoded = last

    def decode_all(self) -> None:
        while self.behind:
            self.decode_some()

    def finish(self, stop: Stop | None = None) -> None:
        """Write the session's totals (and, given how it ended, its end) and close the database."""
        if self.redactor is not None:  # outputs that waited for their request's ADD to the end
            self.write_frames(self.redactor.flush())
        decoder = self.decoder
        end = {} if stop is None else {"status": stop.status, "frames_seen": stop.frames_seen,
                                       "bytes_seen": stop.bytes_seen,
                                       "frames_dropped": max(0, stop.frames_seen - self.frames_written),
                                       "ended_at": utc_now()}
        if stop is not None and (self.frames_failed or self.write_error) and stop.status == "complete":
            end["status"] = "incomplete"
        error = (stop.error if stop else None) or self.write_error
        values = {"vllm_version": decoder.vllm_version, "schema_release": decoder.schema.release,
                  "schema_exact": int(decoder.schema_exact), "frames_recorded": self.frames_written,
                  "frames_undecoded": self.frames_undecoded, "engines_dead": len(self.dead), **end}
        if self.redactor is not None:
            values["redaction_counts"] = redaction_counts(self.redactor)
        elif stop is not None and stop.redaction_counts is not None:  # redacted by the redactor process
            values["redaction_counts"] = stop.redaction_counts
        assignments = ", ".join(f"{k} = ?" for k in values)
        with self.connection:
            self.connection.execute(f"UPDATE sessions SET {assignments}, error = COALESCE(?, error) WHERE id = ?",
                                    (*values.values(), error, self.session_id))
        self.connection.close()


def finish_decoding(db_path: str, session_id: int) -> int:
    """Decode what a session kept undecoded; return how many frames that was."""
    writer = Writer(db_path, session_id)
    before = writer.frames_undecoded
    writer.decode_all()
    writer.finish()
    return before - writer.frames_undecoded


class WriterLoop:
    """The writer process: take what the tap sends, decode it (or keep it), report, until Stop."""

    def __init__(self, start: WriterStart):
        self.context = zmq.Context()
        self.tap = self.context.socket(zmq.PULL)
        self.tap.setsockopt(zmq.RCVHWM, 0)  # the tap bounds the queue, in frames
        self.tap.bind(start.tap_address)
        self.progress_socket = self.context.socket(zmq.PUSH)
        # Only the newest count matters, and a send must never block on a proxy that is gone.
        self.progress_socket.setsockopt(zmq.CONFLATE, 1)
        self.progress_socket.setsockopt(zmq.LINGER, 5000)
        self.progress_socket.connect(start.progress_address)
        self.parent, self.upstream, self.hold_frames = start.parent_pid, start.upstream_pid, start.hold_frames
        self.sockets_folder = start.sockets_folder
        self.writer = Writer(start.db_path, start.session_id, max_bytes=start.max_bytes)
        self.held: list[Entries] = []  # the tap's messages waiting, in memory, oldest first
        self.held_bytes = self.held_frames = 0
        self.stop: Stop | None = None
        self.stop_by: float | None = None  # after Stop: when decoding gives way to keeping
        self.last_batch = Batch(0, 0, 0)  # its counts, for a proxy that dies without Stop
        self.parent_checked = time.monotonic()
        self.parent_gone = False

    def run(self) -> None:
        self._report()  # the first report says the writer has started
        while self._step():
            if self.stop is None and time.monotonic() - self.parent_checked >= PARENT_CHECK_S:
                self.parent_checked = time.monotonic()
                # Died without Stop (or a redactor still passes it on): finish what came, say so.
                self.parent_gone = os.getppid() != self.parent and not _running(self.upstream)
            self._report()
        self.writer.finish(self.stop)
        self.tap.close(linger=0)
        self.progress_socket.close()
        self.context.term()
        shutil.rmtree(self.sockets_folder, ignore_errors=True)  # the recorder leaves it to a writer still at it

    def _report(self) -> None:
        self.progress_socket.send(encode_progress(self.writer.progress()))

    def _take(self) -> None:
        """Take what the tap has sent since the last look, without waiting."""
        while self.stop is None:
            try:
                message = self.tap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                if self.parent_gone:  # everything the proxy sent before it died is in
                    self._stopping(Stop("interrupted", "the proxy exited without stopping the recording",
                                        self.last_batch.frames_seen, self.last_batch.bytes_seen))
                return
            head = header(message)
            if isinstance(head, Stop):  # the proxy's last frame is in
                self._stopping(head)
                return
            self.held.append((head.frames, message[1]))
            self.held_bytes += len(message[1])
            self.held_frames += head.frames
            self.last_batch = head

    def _stopping(self, stop: Stop) -> None:
        self.stop, self.stop_by = stop, time.monotonic() + STOP_DECODE_S

    def _step(self) -> bool:
        """One step: keep, decode or write; False once Stop has come and everything before it is in."""
        self._take()
        writer = self.writer
        late = self.stop_by is not None and time.monotonic() > self.stop_by
        # In order, and bounded in memory and in the recorder's queue (``hold_frames``): keep.
        if self.held and (writer.behind or self.held_bytes > HOLD_BYTES or self.held_frames > self.hold_frames
                          or late):
            writer.keep(self.held)
            self.held, self.held_bytes, self.held_frames = [], 0, 0
        elif writer.behind and not late:
            writer.decode_some()
        elif self.held:
            taken, frames = 0, 0
            while taken < len(self.held) and frames < DECODE_FRAMES:
                frames += self.held[taken][0]
                taken += 1
            writer.write(self.held[:taken])
            self.held_bytes -= sum(len(entries) for _, entries in self.held[:taken])
            self.held_frames -= frames
            del self.held[:taken]
        elif self.stop is not None:
            return False
        else:
            self.tap.poll(PARENT_CHECK_S * 1000)
        return True


def _running(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    WriterLoop(msgspec.json.decode(sys.argv[1], type=WriterStart)).run()
