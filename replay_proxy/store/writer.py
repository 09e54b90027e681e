"""The writer: the tap's messages into SQLite rows, decoded as they come (its process is
``writer_loop.py``).

Theory of operation. The tap sends a message every ``TAP_HOLD_S`` or so
(``tap.py``). The writer takes what has come, decodes it (the typed
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
collector's reach, so that no collection walks them (``writer_loop.py``). That took
recording's idle round-trip p99 from 5x the minimal recorder's to 1.3x to
1.5x (docs/performance.md).
"""

from __future__ import annotations

import enum
import os
import sqlite3
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import msgspec

from replay_proxy.redact.settings import Redaction, redaction_counts
from replay_proxy.store import raw
from replay_proxy.store.counts import FrameCounts, WriterCounts
from replay_proxy.store.progress import Progress, Stop
from replay_proxy.store.rows import Rows
from replay_proxy.store.sample import RequestSample, Sampler
from replay_proxy.store.tables import COPIED, TABLES, end_session, written
from replay_proxy.wire.capture import CapturedFrame, EngineLoss, decode_entries
from replay_proxy.wire.messages import Kind, WireDecoder
from replay_proxy.wire.schema import release_key

DECODE_FRAMES = 2_000  # frames a transaction, about: the tap is looked at again after each
# SQLite checkpoints its log at 1,000 pages, 4 MB: most of what a busy recording took on disk in its first seconds.
WAL_BYTES = 2**20
SQLITE_STEPS_PER_YIELD = 1_000  # about 50 inserted rows (20 steps each): a tenth of a millisecond
DECODED_PER_YIELD = 32  # frames unpacked from the tap's messages (about 2 us each)


T = TypeVar("T")
Entries = tuple[int, bytes]  # a tap message's frames, and its entries (wire/capture.py) as sent


# The session row's columns of the counts, in WriterCounts's order (tables.py makes a column of each).
_COUNTED = ", ".join(f"COALESCE([{name}], 0)" for name in WriterCounts.__struct_fields__)


class Copies(enum.Enum):
    """What of a frame that another file of a rotating recording counts is a copy here: nothing; the whole of
    it, every row (the session's start, which each file begins with); or its ``frames`` row alone (a split
    frame's other part: the outputs and results it carries here are this file's own)."""

    NONE = "none"
    WHOLE = "whole"
    FRAME = "frame"


def _insert(table: str, copy: bool) -> str:
    """The INSERT of a row of ``table`` as written; ``copy``: as a copy (``write_copies``), its ``copied`` column 1,
    said by the statement."""
    columns, marked = written(table), copy and COPIED in TABLES[table][0]
    return (f"INSERT INTO [{table}] ({', '.join(f'[{c}]' for c in columns)}{', [copied]' if marked else ''}) "
            f"VALUES ({', '.join('?' * len(columns))}{', 1' if marked else ''})")


class Writer:
    """One session's writer: decodes, or keeps and later decodes, the tap's messages.

    It picks up where the session's database stands, so it also finishes a session left partly
    decoded (``replay-proxy decode``). With ``redaction`` (``replay-proxy redact``), every frame is
    redacted before it is written; a recording is redacted before it reaches the writer
    (``recorder/redactor.py``).
    """

    def __init__(self, db_path: str, session_id: int, *, max_bytes: int | None = None,
                 redaction: Redaction | None = None, sample: RequestSample | None = None):
        self.db_path, self.session_id = db_path, session_id
        self.connection = sqlite3.connect(db_path, timeout=30)
        self.connection.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable at checkpoints
        self.connection.set_progress_handler(os.sched_yield, SQLITE_STEPS_PER_YIELD)  # (returns None: go on)
        self.connection.execute("PRAGMA cache_size=-32768")  # 32 MB: the tables' B-tree pages stay in memory
        page_bytes = self.connection.execute("PRAGMA page_size").fetchone()[0]  # (an older file may have others)
        # The write-ahead log checkpointed at WAL_BYTES, and cut back to them after a bigger transaction.
        self.connection.execute(f"PRAGMA wal_autocheckpoint={WAL_BYTES // page_bytes}")
        self.connection.execute(f"PRAGMA journal_size_limit={WAL_BYTES}")
        if max_bytes:
            self.connection.execute(f"PRAGMA max_page_count={max(1, max_bytes // page_bytes)}")
        self.statements = {table: _insert(table, copy=False) for table in TABLES}
        self.copy_statements = {table: _insert(table, copy=True) for table in TABLES}
        version, frontend_release, frontend_source, *counted = self.connection.execute(
            f"SELECT vllm_version, frontend_release, frontend_source, {_COUNTED} FROM sessions WHERE id = ?",
            (session_id,)).fetchone()
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
        # The counts go on from the session's row (a session recorded before and decoded now), save the ones kept
        # as sets (below) and the frames waiting in ``undecoded``, counted there.
        self.counts = msgspec.structs.replace(WriterCounts(*counted), frames_undecoded=undecoded)
        self.decoded_through_ns = 0
        self.sampler = Sampler(sample) if sample is not None else None
        self.frames_copied = 0  # rows counted in another file of a rotating recording (recorder/rotation/)
        self.small_batch_frames = 0  # frames in batches written since the last merge, each smaller than a merged one
        self.dead: set[int | None] = {e for (e,) in self.connection.execute(  # sent ENGINE_CORE_DEAD or vanished
            "SELECT DISTINCT engine_index FROM engine_events WHERE session_id = ?", (session_id,))}
        self.write_error: str | None = None
        # Drift alarms raised: (struct, issue, field, position)
        self.alarmed = {tuple(r) for r in self.connection.execute(
            "SELECT struct, issue, field, position FROM drift_alarms WHERE session_id = ?", (session_id,))}
        self.last_alarm: str | None = None

    def session_row(self) -> dict[str, Any]:
        """The session's row as it stands."""
        cursor = self.connection.execute("SELECT * FROM sessions WHERE id = ?", (self.session_id,))
        return dict(zip([d[0] for d in cursor.description], cursor.fetchone()))

    def counted(self) -> WriterCounts:
        """A copy of the counts, the engines dead and the drift alarms among them."""
        return msgspec.structs.replace(self.counts, engines_dead=len(self.dead), drift_alarms=len(self.alarmed))

    def progress(self) -> Progress:
        return Progress(counts=self.counted(), write_error=self.write_error, drift=self.last_alarm,
                        decoded_through_ns=self.decoded_through_ns, vllm_version=self.decoder.vllm_version)

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

    def _commit(self, rows: Rows, *, done: tuple[int, int] | None = None, copies: Copies = Copies.NONE) -> bool:
        """Write the rows, and their frames' bytes as a batch, in one transaction; ``done``: the kept messages they
        replace (a number range); ``copies``: which of them are marked as copies of rows another file counts."""
        batch = raw.pack(self.session_id, rows.raw_seqs, rows.raw_items, os.sched_yield) if rows.raw_items else None
        try:
            with self.connection:
                for table, values in rows.tables.items():
                    copy = copies is Copies.WHOLE or (copies is Copies.FRAME and table == "frames")
                    self.connection.executemany((self.copy_statements if copy else self.statements)[table], values)
                if batch is not None:
                    self.connection.execute(self.statements["frame_batches"], batch)
                if done is not None:
                    self.connection.execute("DELETE FROM undecoded WHERE session_id = ? AND number BETWEEN ? AND ?",
                                            (self.session_id, *done))
        except Exception as exc:  # noqa: BLE001 - a full disk, a locked file: count it, keep going
            self.write_error = f"{type(exc).__name__}: {exc}"
            rows.forget_new_request_ids()
            return False
        if batch is not None and batch.frames < raw.BATCH_FRAMES:
            self.small_batch_frames += batch.frames
            if self.small_batch_frames >= raw.BATCH_FRAMES:
                self._merge_small_batches()
        return True

    def _merge_small_batches(self) -> None:
        """The session's small batches (a quiet recording writes a few frames a transaction) as one, in the
        transaction that deletes them: they compress together as a batch of ``raw.BATCH_FRAMES`` does."""
        self.small_batch_frames = 0
        small = self.connection.execute("SELECT first_seq, frames, data FROM frame_batches WHERE session_id = ? "
                                        "AND frames < ? ORDER BY first_seq", (self.session_id, raw.BATCH_FRAMES))
        firsts, batches = [], []
        for first_seq, frames, data in small:
            firsts.append((self.session_id, first_seq))
            batches.append((frames, data))
        if len(batches) < 2:
            return
        batch = raw.merged(self.session_id, batches, os.sched_yield)
        try:
            with self.connection:
                self.connection.executemany("DELETE FROM frame_batches WHERE session_id = ? AND first_seq = ?", firsts)
                self.connection.execute(self.statements["frame_batches"], batch)
        except Exception:  # noqa: BLE001 - a full disk: the small batches stay as they are, all of them read
            return

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
               EXCEPT SELECT request_id FROM outputs WHERE session_id = :s AND finish_reason IS NOT NULL
               EXCEPT SELECT request_id FROM aborts WHERE session_id = :s""", {"s": self.session_id})}

    def _decoded(self, rows: Rows, added: int) -> None:
        """Count what a written transaction decoded."""
        self.counts.requests += added
        self.counts.frames_undecodable += rows.frames_undecodable
        self.decoded_through_ns = max(self.decoded_through_ns, rows.newest_ts_ns)

    def write(self, messages: list[Entries]) -> None:
        """Decode the tap's messages and write them, in one transaction."""
        self.write_frames(list(_giving_way((item for _, entries in messages for item in decode_entries(entries)),
                                           DECODED_PER_YIELD)))

    def write_frames(self, captured: list[CapturedFrame | EngineLoss]) -> None:
        """Tabulate and write captured frames, in one transaction (redacted first, if redacting)."""
        if self.redactor is not None:
            captured = self.redactor.frames(captured)
        captured, left_out, outputs_left_out = self._sample(captured)
        self.counts.frames_sampled_out += left_out  # (written or not: never to be recorded)
        self.counts.outputs_sampled_out += outputs_left_out
        frames = sum(type(item) is CapturedFrame for item in captured)
        rows, added = self._tabulate(captured)
        if self._commit(rows):
            self.counts.frames_recorded += frames
            self._decoded(rows, added)
        else:
            self.counts.frames_failed += frames

    def write_copies(self, captured: list[CapturedFrame | EngineLoss], copies: Copies) -> None:
        """Rows of frames that another file of a rotating recording counts (``rotation/``), in one transaction:
        counted here only as copied, and marked so (``Copies``). What the sample leaves out of them, or a write
        that fails, is counted where the frames are."""
        captured, _, _ = self._sample(captured)
        rows, _ = self._tabulate(captured)
        if self._commit(rows, copies=copies):
            self.frames_copied += sum(type(item) is CapturedFrame for item in captured)

    def _sample(self, captured: list[CapturedFrame | EngineLoss]
                ) -> tuple[list[CapturedFrame | EngineLoss], int, int]:
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
                self.counts.frames_recorded += frames
                self.counts.frames_undecoded += frames
            else:
                self.counts.frames_failed += frames

    @property
    def behind(self) -> bool:
        """Kept messages wait to be decoded."""
        return self.last_decoded < self.last_kept

    def decode_some(self) -> None:
        """Decode and tabulate the oldest kept messages, in seq order; those that fail stay undecoded."""
        captured: list[CapturedFrame | EngineLoss] = []
        frames = 0
        first: int | None = None
        last: int | None = None
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
        if first is None or last is None:  # only messages whose keeping failed were left: nothing to decode
            self.last_decoded = self.last_kept
            return
        captured, left_out, outputs_left_out = self._sample(captured)
        rows, added = self._tabulate(captured)
        if self._commit(rows, done=(first, last)):
            self._decoded(rows, added)
            self.counts.frames_undecoded -= frames
            # Counted as recorded when they were kept: left out by the sample now that they are decoded.
            self.counts.frames_recorded -= left_out
            self.counts.frames_sampled_out += left_out
            self.counts.outputs_sampled_out += outputs_left_out
        self.last_decoded = last

    def decode_all(self) -> None:
        while self.behind:
            self.decode_some()

    def account(self, seen: int) -> FrameCounts:
        """Where the ``seen`` frames of a session that ends here are."""
        return FrameCounts.ended(seen, self.counts.frames_recorded, self.counts.frames_sampled_out)

    def finish(self, stop: Stop | None = None, **row: object) -> None:
        """Close the database, and write the session's totals (and, given how it ended, its end, and ``row``'s
        values)."""
        if self.redactor is not None:  # outputs that waited for their request's ADD to the end
            self.write_frames([*self.redactor.flush()])
        decoder = self.decoder
        values = {"vllm_version": decoder.vllm_version, "schema_release": decoder.schema.release,
                  "frontend_release": decoder.frontend_release,
                  "frontend_source": None if decoder.frontend_source is None else str(decoder.frontend_source),
                  "schema_exact": int(decoder.schema_exact), **msgspec.structs.asdict(self.counted())}
        if stop is not None:
            status = "incomplete" if stop.status == "complete" and (self.counts.frames_failed or self.write_error) \
                else stop.status
            values.update(status=status, counts=self.account(stop.frames_seen), bytes_seen=stop.bytes_seen)
        if self.frames_copied:
            values["frames_copied"] = self.frames_copied
        values.update(row)
        if self.redactor is not None:
            values["redaction_counts"] = redaction_counts(self.redactor)
        elif stop is not None and stop.redaction_counts is not None:  # redacted by the redactor process
            values["redaction_counts"] = stop.redaction_counts
        self.connection.close()
        end_session(self.db_path, self.session_id, error=(stop.error if stop else None) or self.write_error,
                    **values)


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
    before = writer.counts.frames_undecoded
    writer.decode_all()
    writer.finish()
    return before - writer.counts.frames_undecoded
