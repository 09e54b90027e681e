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

SCHED_IDLE is not enough to keep out of the forwarders' way. A task woken
on the core where the writer runs waited for it up to one scheduler tick
(4 ms on this project's machine, ``perf sched timehist``): this kernel,
as one with lazy preemption does, switches away from a running task at
the tick or when that task enters the kernel. So the writer enters it at
least every tenth of a millisecond or so of its work: ``sched_yield``
before each frame it tabulates and every ``DECODED_PER_YIELD`` frames it
unpacks (``_giving_way``), and every ``SQLITE_STEPS_PER_YIELD`` steps of
SQLite's virtual machine (a progress handler). For the same reason the
objects made at start (schemas, decoders) are frozen out of the garbage
collector's reach, so that no collection walks them. That took
recording's idle round-trip p99 from 5x the minimal recorder's to 1.3x to
1.5x (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal
import sqlite3
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import msgspec
import zmq

from replay_proxy.clock import utc_now
from replay_proxy.redact.settings import Redaction, redaction_counts
from replay_proxy.store import reserve
from replay_proxy.store.protocol import Batch, Progress, Stop, WriterStart, encode_progress, header
from replay_proxy.store.rotation import FINISHING_FILES, ROTATE_RETRY_S, Finishing, Others, Rotator, requests_of
from replay_proxy.store.rows import Rows
from replay_proxy.store.sample import RequestSample, Sampler
from replay_proxy.store.tables import TABLES, open_database
from replay_proxy.wire.capture import CapturedFrame, EngineLoss, decode_entries
from replay_proxy.wire.messages import Kind, WireDecoder
from replay_proxy.wire.schema import release_key

DECODE_FRAMES = 2_000  # frames a transaction, about: the tap is looked at again after each
HOLD_BYTES = 64 * 2**20  # tap messages waiting in memory beyond this are kept on disk instead
PROGRESS_HWM = 16  # reports waiting for the proxy to read them, at most
STOP_DECODE_S = 2.0  # after STOP: decode this long at most, then keep the rest
PARENT_CHECK_S = 1.0  # how often: is the proxy still there?
SQLITE_STEPS_PER_YIELD = 1_000  # about 50 inserted rows (20 steps each): a tenth of a millisecond
DECODED_PER_YIELD = 32  # frames unpacked from the tap's messages (about 2 us each)


T = TypeVar("T")
Entries = tuple[int, bytes]  # a tap message's frames, and its entries (wire/capture.py) as sent


class Writer:
    """One session's writer: decodes, or keeps and later decodes, the tap's messages.

    It picks up where the session's database stands, so it also finishes a session left partly
    decoded (``replay-proxy decode``). With ``redaction`` (``replay-proxy redact``), every frame is
    redacted before it is written; a recording is redacted before it reaches the writer
    (``store/redactor.py``).
    """

    def __init__(self, db_path: str, session_id: int, *, max_bytes: int | None = None,
                 redaction: Redaction | None = None, sample: RequestSample | None = None):
        self.session_id = session_id
        self.connection = sqlite3.connect(db_path, timeout=30)
        self.connection.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable at checkpoints
        self.connection.set_progress_handler(os.sched_yield, SQLITE_STEPS_PER_YIELD)  # (returns None: go on)
        self.connection.execute("PRAGMA cache_size=-32768")  # 32 MB: the tables' B-tree pages stay in memory
        if max_bytes:  # the file's own page size: an older file may have another
            page_bytes = self.connection.execute("PRAGMA page_size").fetchone()[0]
            self.connection.execute(f"PRAGMA max_page_count={max(1, max_bytes // page_bytes)}")
        self.statements = {
            table: f"INSERT INTO [{table}] ({', '.join(f'[{c}]' for c in columns)}) "
                   f"VALUES ({', '.join('?' for _ in columns)})"
            for table, (columns, _) in TABLES.items()
        }
        version, recorded, frontend_release, frontend_source = self.connection.execute(
            "SELECT vllm_version, COALESCE(frames_recorded, 0), frontend_release, frontend_source FROM sessions "
            "WHERE id = ?", (session_id,)).fetchone()
        self.decoder = WireDecoder(frontend_release=frontend_release, frontend_source=frontend_source)
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
        self.requests = self.frames_undecodable = self.decoded_through_ns = 0
        self.sampler = Sampler(sample) if sample is not None else None
        self.frames_sampled_out = self.outputs_sampled_out = 0  # (not sampled: 0)
        self.frames_copied = 0  # rows counted in another file of a rotating recording (store/rotation.py)
        self.dead: set[int | None] = {e for (e,) in self.connection.execute(  # sent ENGINE_CORE_DEAD or vanished
            "SELECT DISTINCT engine_index FROM engine_events WHERE session_id = ?", (session_id,))}
        self.write_error: str | None = None
        # Drift alarms raised: (struct, issue, field, position)
        self.alarmed = {tuple(r) for r in self.connection.execute(
            "SELECT struct, issue, field, position FROM drift_alarms WHERE session_id = ?", (session_id,))}
        self.last_alarm: str | None = None

    def progress(self) -> Progress:
        return Progress(frames_written=self.frames_written, requests=self.requests, engines_dead=len(self.dead),
                        frames_failed=self.frames_failed, frames_undecoded=self.frames_undecoded,
                        drift_alarms=len(self.alarmed), write_error=self.write_error, drift=self.last_alarm,
                        frames_undecodable=self.frames_undecodable, decoded_through_ns=self.decoded_through_ns,
                        vllm_version=self.decoder.vllm_version, frames_sampled_out=self.frames_sampled_out,
                        outputs_sampled_out=self.outputs_sampled_out)

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
        for item in _giving_way(sorted(captured, key=lambda numbered: numbered.seq)):
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

    def requests_in_flight(self) -> set[str]:
        """This session's requests added and neither finished nor aborted yet (one pass over its outputs)."""
        return {rid for (rid,) in self.connection.execute(
            """SELECT request_id FROM requests WHERE session_id = :s
               EXCEPT SELECT i.request_id FROM output_rows o JOIN request_ids i ON i.session_id = o.session_id
                   AND i.number = o.request WHERE o.session_id = :s AND o.finish_reason IS NOT NULL
               EXCEPT SELECT request_id FROM aborts WHERE session_id = :s""", {"s": self.session_id})}

    def _decoded(self, rows: Rows, added: int) -> None:
        """Count what a written transaction decoded."""
        self.requests += added
        self.frames_undecodable += rows.frames_undecodable
        self.decoded_through_ns = max(self.decoded_through_ns, rows.newest_ts_ns)

    def write(self, messages: list[Entries]) -> None:
        """Decode the tap's messages and write them, in one transaction."""
        self.write_frames(list(_giving_way((item for _, entries in messages for item in decode_entries(entries)),
                                           DECODED_PER_YIELD)))

    def write_frames(self, captured: list[CapturedFrame | EngineLoss], *, copies: bool = False) -> None:
        """Tabulate and write captured frames, in one transaction (redacted first, if redacting); ``copies``:
        rows of frames another file of a rotating recording counts."""
        if self.redactor is not None:
            captured = self.redactor.frames(captured)
        captured, left_out, outputs_left_out = self._sample(captured)
        self.frames_sampled_out += left_out  # (written or not: never to be recorded)
        self.outputs_sampled_out += outputs_left_out
        frames = sum(type(item) is CapturedFrame for item in captured)
        rows, added = self._tabulate(captured)
        if not self._commit(rows):
            self.frames_failed += 0 if copies else frames
        elif copies:
            self.frames_copied += frames
        else:
            self.frames_written += frames
            self._decoded(rows, added)

    def _sample(self, captured: list[CapturedFrame | EngineLoss]) -> tuple[list, int, int]:
        """What ``--sample-requests`` keeps of captured frames, and how many frames and outputs it left out."""
        if self.sampler is None:
            return captured, 0, 0
        outputs_before = self.sampler.outputs_left_out
        kept = self.sampler.frames(captured)
        left_out = sum(type(item) is CapturedFrame for item in captured) - sum(
            type(item) is CapturedFrame for item in kept)
        return kept, left_out, self.sampler.outputs_left_out - outputs_before

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
        captured, left_out, outputs_left_out = self._sample(captured)
        rows, added = self._tabulate(captured)
        if self._commit(rows, done=(first, last)):
            self._decoded(rows, added)
            self.frames_undecoded -= frames
            # Counted as recorded when they were kept: left out by the sample now that they are decoded.
            self.frames_written -= left_out
            self.frames_sampled_out += left_out
            self.outputs_sampled_out += outputs_left_out
        self.last_decoded = last

    def decode_all(self) -> None:
        while self.behind:
            self.decode_some()

    def finish(self, stop: Stop | None = None, **row: object) -> None:
        """Write the session's totals (and, given how it ended, its end, and ``row``'s values) and close the
        database."""
        if self.redactor is not None:  # outputs that waited for their request's ADD to the end
            self.write_frames(self.redactor.flush())
        decoder = self.decoder
        end = {} if stop is None else {"status": stop.status, "frames_seen": stop.frames_seen,
                                       "bytes_seen": stop.bytes_seen, "frames_dropped": max(
                                           0, stop.frames_seen - self.frames_written - self.frames_sampled_out),
                                       "ended_at": utc_now()}
        if stop is not None and (self.frames_failed or self.write_error) and stop.status == "complete":
            end["status"] = "incomplete"
        error = (stop.error if stop else None) or self.write_error
        values = {"vllm_version": decoder.vllm_version, "schema_release": decoder.schema.release,
                  "frontend_release": decoder.frontend_release,
                  "frontend_source": None if decoder.frontend_source is None else str(decoder.frontend_source),
                  "schema_exact": int(decoder.schema_exact), "frames_recorded": self.frames_written,
                  "frames_undecoded": self.frames_undecoded, "engines_dead": len(self.dead), **end}
        if self.sampler is not None:
            values.update(frames_sampled_out=self.frames_sampled_out, outputs_sampled_out=self.outputs_sampled_out)
        if self.frames_copied:
            values["frames_copied"] = self.frames_copied
        values.update(row)
        if self.redactor is not None:
            values["redaction_counts"] = redaction_counts(self.redactor)
        elif stop is not None and stop.redaction_counts is not None:  # redacted by the redactor process
            values["redaction_counts"] = stop.redaction_counts
        assignments = ", ".join(f"{k} = ?" for k in values)
        with self.connection:
            self.connection.execute(f"UPDATE sessions SET {assignments}, error = COALESCE(?, error) WHERE id = ?",
                                    (*values.values(), error, self.session_id))
        self.connection.close()


def _giving_way(items: Iterable[T], every: int = 1) -> Iterator[T]:
    """``items``, entering the kernel before every ``every``-th: a forwarder woken on this core gets it
    then, not at the next tick (the module's docstring says why)."""
    for i, item in enumerate(items):
        if i % every == 0:
            os.sched_yield()
        yield item


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
        # Reports are cumulative, so a full queue may lose one (it is sent without waiting: never blocking on
        # a proxy that is gone), but not the last, which waits for room (bounded). Not conflating: a
        # conflating socket lost that last report when it closed, under load (seen as stale final counts).
        self.progress_socket.setsockopt(zmq.SNDHWM, PROGRESS_HWM)
        self.progress_socket.setsockopt(zmq.SNDTIMEO, 5000)
        self.progress_socket.setsockopt(zmq.LINGER, 5000)
        self.progress_socket.connect(start.progress_address)
        self.parent, self.upstream, self.hold_frames = start.parent_pid, start.upstream_pid, start.hold_frames
        self.sockets_folder = start.sockets_folder
        self.db_path = start.db_path
        self.writer = Writer(start.db_path, start.session_id, max_bytes=start.max_bytes, sample=start.sample)
        self.series = None if start.rotation is None else Series(start, self.writer)
        self.received = 0  # frames in the tap's messages taken so far
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
        if self.series is None:
            reserve.release(self.db_path)  # the room kept for this last transaction, however full the disk is
            self.writer.finish(self.stop)
        else:
            self.series.finish(self.stop, self.received)
        self._report(last=True)  # the last word, after the end: a rotating recording's totals are read from it
        self.tap.close(linger=0)
        self.progress_socket.close()  # (its linger delivers that last word)
        self.context.term()
        shutil.rmtree(self.sockets_folder, ignore_errors=True)  # the recorder leaves it to a writer still at it

    def _report(self, last: bool = False) -> None:
        progress = self.writer.progress() if self.series is None else self.series.progress()
        try:
            self.progress_socket.send(encode_progress(msgspec.structs.replace(progress, last=last)),
                                      0 if last else zmq.NOBLOCK)
        except zmq.Again:  # (the proxy has not read the last few: the next report carries these counts too)
            pass

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
            self.received += head.frames
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
            if self.series is None:
                writer.write(self.held[:taken])
            else:
                self.series.write([item for _, entries in self.held[:taken] for item in decode_entries(entries)])
            self.held_bytes -= sum(len(entries) for _, entries in self.held[:taken])
            self.held_frames -= frames
            del self.held[:taken]
            if self.series is not None and not self.held and self.stop is None and self.series.due():
                # Everything taken is written: the tap's counts so far belong to the files before the next.
                self.writer = self.series.rotate(self.received, self.last_batch)
        elif self.stop is not None:
            return False
        elif self.series is not None and self.series.due():  # (SIGHUP, or the clock, while nothing comes)
            self.writer = self.series.rotate(self.received, self.last_batch)
        else:
            self.tap.poll(PARENT_CHECK_S * 1000)
        return True


class _Part:
    """One file of a rotating recording: its writer, and the tap's counts when it became the current file."""

    def __init__(self, path: Path, writer: Writer, received: int, head: Batch):
        self.path, self.writer = path, writer
        self.started = (received, head.frames_seen, head.bytes_seen)
        self.tap_dropped = self.bytes_seen = 0  # while it was the current file: set when it stops being that
        self.continued_in: str | None = None  # the file begun after it
        self.closed = False

    def stopped_being_current(self, received: int, head: Batch) -> None:
        start_received, start_seen, start_bytes = self.started
        self.tap_dropped = (head.frames_seen - received) - (start_seen - start_received)
        self.bytes_seen = head.bytes_seen - start_bytes

    def seen(self) -> int:
        """Every frame counted in this file, and what the tap dropped while it was current."""
        w = self.writer
        return w.frames_written + w.frames_failed + w.frames_sampled_out + self.tap_dropped


class Series:
    """The files of a rotating recording, as the writer process holds them (``store/rotation.py``): the
    current one, the previous ones while their requests finish, and the totals of those already closed."""

    def __init__(self, start: WriterStart, first: Writer):
        self.options = {"max_bytes": start.max_bytes, "sample": start.sample}
        self.rotator = Rotator(start.rotation, Path(start.db_path))
        self.current = _Part(Path(start.db_path), first, 0, Batch(0, 0, 0))
        self.finishing: list[tuple[_Part, Finishing]] = []  # previous files whose requests still run, oldest first
        self.others: Others | None = None  # (made at the first rotation, when the release is known)
        self.closed = Progress()  # the totals of the files already closed
        self.closed_seen = self.closed_bytes = 0
        self.dead: set[int | None] = set()
        self.alarmed: set[tuple] = set()
        self.rotation_error: str | None = None  # the last rotation's, until one succeeds
        signal.signal(signal.SIGHUP, lambda *_: setattr(self.rotator, "requested", True))  # the proxy passes it on

    def due(self) -> bool:
        return not self.current.writer.behind and self.rotator.due(self.current.path)

    def write(self, captured: list[CapturedFrame | EngineLoss]) -> None:
        captured.sort(key=lambda numbered: numbered.seq)
        self.rotator.observe(captured)
        if self.finishing:
            captured = self._route(captured)
        self.current.writer.write_frames(captured)

    def _route(self, captured: list[CapturedFrame | EngineLoss]) -> list[CapturedFrame | EngineLoss]:
        """Write each previous file's part of these frames there (counted in the oldest that has one); return
        the current file's frames, having written its part of the others as copies."""
        schema = self.current.writer.decoder.schema
        counted: dict[int, list] = {id(part): [] for part, _ in self.finishing}
        copies: dict[int, list] = {id(part): [] for part, _ in self.finishing}
        current, current_copies = [], []
        for item in captured:
            ids, ended, aborted = requests_of(item, schema) if type(item) is CapturedFrame else ([], [], [])
            for _, finishing in self.finishing:
                finishing.expire(item.ts_ns)
            owners = [(part, f) for part, f in self.finishing if f.pending.intersection(ids)]
            if not owners:
                current.append(item)
                continue
            if (rest := self.others.part(item)) is not None:  # (before the requests it ends are no longer pending)
                current_copies.append(rest)
            for n, (part, finishing) in enumerate(owners):
                (copies if n else counted)[id(part)].append(finishing.part(item))
                finishing.end(ended, aborted, item.ts_ns)
        for part, _ in self.finishing:
            if counted[id(part)]:
                part.writer.write_frames(counted[id(part)])
            if copies[id(part)]:
                part.writer.write_frames(copies[id(part)], copies=True)
        if current_copies:
            self.current.writer.write_frames(current_copies, copies=True)
        for part, finishing in list(self.finishing):
            if finishing.over():
                self._close(part)
        return current

    def rotate(self, received: int, head: Batch) -> Writer:
        """Close the current file (or leave it open while its requests finish) and open the next: its writer
        (the current one's, if the next file could not be made: tried again later, and counted)."""
        old = self.current
        path = self.rotator.next_file()
        try:
            with contextlib.closing(open_database(path)) as db:
                row = {k: v for k, v in _session_row(old.writer).items() if k in _CARRIED}
                session_id = db["sessions"].insert({**row, "started_at": utc_now(), "status": "recording",
                                                    "continues": old.path.name, "frames_seen": 0,
                                                    "frames_recorded": 0, "frames_dropped": 0}).last_pk
            if not reserve.hold(path):  # a file whose end could not be written is no file to begin
                raise OSError("no room for the reserve its session's end needs")
            writer = Writer(str(path), session_id, **self.options)
            writer.write_frames(list(self.rotator.start), copies=True)
            if writer.frames_copied < sum(type(item) is CapturedFrame for item in self.rotator.start):
                writer.connection.close()
                raise OSError(f"no room for the session's start ({writer.write_error})")
        except (OSError, sqlite3.Error) as exc:  # no space, no permission: forwarding goes on, into this file
            for made in (path, *(path.with_name(path.name + end) for end in ("-wal", "-shm"))):
                made.unlink(missing_ok=True)  # (what it began of the file: a file no session row ends)
            reserve.release(path)
            self.rotator.failed()  # (not a write error: no frame is lost, and the session may end complete)
            self.rotation_error = f"rotation to {path} failed ({type(exc).__name__}: {exc}); tried again " \
                                  f"in {ROTATE_RETRY_S:g} s"
            return old.writer
        self.rotation_error = None
        old.stopped_being_current(received, head)
        old.continued_in = path.name
        pending = old.writer.requests_in_flight()
        self.current = _Part(path, writer, received, head)
        self.rotator.rotated(path)
        if pending:
            self.finishing.append((old, Finishing(pending, old.writer.decoder.vllm_version, old.path,
                                                  self.rotator.settings)))
            self.others = self.others or Others(lambda: [f for _, f in self.finishing],
                                                old.writer.decoder.vllm_version)
        else:
            self._close(old)
        while len(self.finishing) > FINISHING_FILES:  # its requests still running go on into the files after it
            self._close(self.finishing[0][0])
        return writer

    def _close(self, part: _Part) -> None:
        """End a file's session with its own counts, then let --keep and --max-total-gb act."""
        seen = part.seen()
        self._closing(part, Stop("complete", None, seen, part.bytes_seen), continued_in=part.continued_in)
        self.finishing = [(p, f) for p, f in self.finishing if p is not part]
        keep_open = {self.current.path} | {p.path for p, _ in self.finishing}
        for path in self.rotator.expired(keep_open):
            for gone in (path, *(path.with_name(path.name + end) for end in ("-wal", "-shm"))):
                gone.unlink(missing_ok=True)
            reserve.release(path)

    def _closing(self, part: _Part, stop: Stop, **row: object) -> None:
        w = part.writer
        self.dead |= w.dead
        self.alarmed |= w.alarmed
        self.closed = _sum(self.closed, w.progress())
        self.closed_seen += stop.frames_seen
        self.closed_bytes += stop.bytes_seen
        part.closed = True
        reserve.release(part.path)
        try:
            w.finish(stop, **row)
        except sqlite3.Error as exc:  # (its reserve was given back for this: only a disk that took it fails here)
            self.rotation_error = f"the end of {part.path}'s session could not be written: {exc}"

    def finish(self, stop: Stop, received: int) -> None:
        """The end: the previous files with their own counts, the current one with the rest of the tap's."""
        while self.finishing:
            self._close(self.finishing[0][0])
        self._closing(self.current, msgspec.structs.replace(
            stop, frames_seen=stop.frames_seen - self.closed_seen, bytes_seen=stop.bytes_seen - self.closed_bytes))

    def progress(self) -> Progress:
        """The totals over every file of this run, and which file is being written."""
        open_parts = [p for p in (*(p for p, _ in self.finishing), self.current) if not p.closed]
        total = self.closed
        for part in open_parts:
            total = _sum(total, part.writer.progress())
        writers = [p.writer for p in open_parts]
        return msgspec.structs.replace(
            total, engines_dead=len(self.dead.union(*(w.dead for w in writers))),
            drift_alarms=len(self.alarmed.union(*(w.alarmed for w in writers))), db_path=str(self.current.path),
            write_error=total.write_error or self.rotation_error,
            session_id=self.current.writer.session_id, rotations=self.rotator.rotations,
            rotations_failed=self.rotator.rotations_failed, files_deleted=self.rotator.files_deleted,
            frames_seen_closed_files=self.closed_seen)


# What a new file's session row takes from the one before it.
_CARRIED = ("name", "mode", "listen", "upstream", "proxy_version", "redaction_policy", "redaction_key",
            "sample_requests", "sample_seed", "frontend_release", "frontend_source")
_SUMMED = ("frames_written", "requests", "frames_failed", "frames_undecoded", "frames_undecodable",
           "frames_sampled_out", "outputs_sampled_out")


def _sum(a: Progress, b: Progress) -> Progress:
    """``b`` with ``a``'s counts added to its own."""
    return msgspec.structs.replace(b, **{name: getattr(a, name) + getattr(b, name) for name in _SUMMED},
                                   decoded_through_ns=max(a.decoded_through_ns, b.decoded_through_ns),
                                   vllm_version=b.vllm_version or a.vllm_version, drift=b.drift or a.drift)


def _session_row(writer: Writer) -> dict:
    cursor = writer.connection.execute("SELECT * FROM sessions WHERE id = ?", (writer.session_id,))
    return dict(zip([d[0] for d in cursor.description], cursor.fetchone()))


def _running(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    loop = WriterLoop(msgspec.json.decode(sys.argv[1], type=WriterStart))
    gc.freeze()  # what start made lives as long as the process: no collection need walk it
    loop.run()
