"""The writer process's files of a rotating recording (``rotator.py`` says when to rotate and what each
file begins with): the current one, the previous ones while their requests finish, and what the closed
ones counted. Each file has a ``Writer`` of its own and ends with its own account (``store/counts.py``),
so the files' ``frames_seen`` add up to what the tap saw."""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import msgspec

from replay_proxy.clock import utc_now
from replay_proxy.store import reserve
from replay_proxy.store.counts import FrameCounts
from replay_proxy.recorder.protocol import Batch, Progress, RotationSettings, Stop, WriterStart
from replay_proxy.recorder.rotation.files import database_bytes, holds_data, remove
from replay_proxy.recorder.rotation.rotator import (
    FINISHING_FILES, ROTATE_RETRY_S, Finishing, Others, Rotator, requests_of)
from replay_proxy.store.tables import begin_session
from replay_proxy.store.writer import Copies, Writer
from replay_proxy.wire.capture import CapturedFrame, EngineLoss


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
        c = self.writer.counts
        return c.frames_recorded + c.frames_failed + c.frames_sampled_out + self.tap_dropped


class Series:
    """The files of a rotating recording, as the writer process holds them (``rotator.py`` decides): the
    current one, the previous ones while their requests finish, and the totals of those already closed."""

    def __init__(self, start: WriterStart, rotation: RotationSettings, first: Writer):
        self.max_bytes, self.sample = start.max_bytes, start.sample  # (each file's writer's)
        self.rotator = Rotator(rotation, Path(start.db_path), time.time())
        self.current = _Part(Path(start.db_path), first, 0, Batch(0, 0, 0))
        self.finishing: list[tuple[_Part, Finishing]] = []  # previous files whose requests still run, oldest first
        self.others: Others | None = None  # (made at the first rotation, when the release is known)
        self.closed_progress = Progress()  # the totals of the files already closed ...
        self.closed, self.closed_bytes = FrameCounts(), 0  # ... and where each frame they saw is
        self.dead: set[int | None] = set()
        self.alarmed: set[tuple[Any, ...]] = set()
        self.rotation_error: str | None = None  # the last rotation's, until one succeeds
        signal.signal(signal.SIGHUP, lambda *_: setattr(self.rotator, "requested", True))  # the proxy passes it on

    def due(self) -> bool:
        return not self.current.writer.behind and self.rotator.due(time.time(), database_bytes(self.current.path))

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
        counted: dict[int, list[CapturedFrame | EngineLoss]] = {id(part): [] for part, _ in self.finishing}
        copies: dict[int, list[CapturedFrame | EngineLoss]] = {id(part): [] for part, _ in self.finishing}
        current: list[CapturedFrame | EngineLoss] = []
        current_copies: list[CapturedFrame | EngineLoss] = []
        for item in captured:
            ids, ended, aborted = requests_of(item, schema) if type(item) is CapturedFrame else ([], [], [])
            for _, finishing in self.finishing:
                finishing.expire(item.ts_ns)
            owners = [(part, f) for part, f in self.finishing if f.pending.intersection(ids)]
            if not owners or not isinstance(item, CapturedFrame):  # (a loss names no request)
                current.append(item)
                continue
            assert self.others is not None  # (made at the first rotation, before any file was left finishing)
            rest = self.others.part(item, [f for _, f in self.finishing])  # (before the requests it ends are done)
            if rest is not None:
                current_copies.append(rest)
            for n, (part, finishing) in enumerate(owners):
                if (theirs := finishing.part(item)) is not None:
                    (copies if n else counted)[id(part)].append(theirs)
                finishing.end(ended, aborted, item.ts_ns)
        for part, _ in self.finishing:
            if counted[id(part)]:
                part.writer.write_frames(counted[id(part)])
            if copies[id(part)]:
                part.writer.write_copies(copies[id(part)], Copies.FRAME)
        if current_copies:
            self.current.writer.write_copies(current_copies, Copies.FRAME)
        for part, finishing in list(self.finishing):
            if finishing.over(time.monotonic(), database_bytes(part.path)):
                self._close(part)
        return current

    def rotate(self, received: int, head: Batch) -> Writer:
        """Close the current file (or leave it open while its requests finish) and open the next: its writer
        (the current one's, if the next file could not be made: tried again later, and counted)."""
        old = self.current
        path = self.rotator.next_file(time.time(), holds_data)
        try:
            row = {k: v for k, v in old.writer.session_row().items() if k in _CARRIED}
            session_id, held = begin_session(path, {
                **row, "started_at": utc_now(), "status": "recording", "continues": old.path.name, "frames_seen": 0,
                "frames_recorded": 0, "frames_dropped": 0})
            if not held:  # a file whose end could not be written is no file to begin
                raise OSError("no room for the reserve its session's end needs")
            writer = Writer(str(path), session_id, max_bytes=self.max_bytes, sample=self.sample)
            writer.write_copies(list(self.rotator.start), Copies.WHOLE)
            if writer.frames_copied < sum(type(item) is CapturedFrame for item in self.rotator.start):
                writer.connection.close()
                raise OSError(f"no room for the session's start ({writer.write_error})")
        except (OSError, sqlite3.Error) as exc:  # no space, no permission: forwarding goes on, into this file
            remove(path)  # (what it began of the file: a file no session row ends)
            reserve.release(path)
            self.rotator.failed(time.time())  # (not a write error: no frame is lost, and the session may end complete)
            self.rotation_error = f"rotation to {path} failed ({type(exc).__name__}: {exc}); tried again " \
                                  f"in {ROTATE_RETRY_S:g} s"
            return old.writer
        self.rotation_error = None
        old.stopped_being_current(received, head)
        old.continued_in = path.name
        pending = old.writer.requests_in_flight()
        self.current = _Part(path, writer, received, head)
        self.rotator.rotated(path, time.time())
        if pending:
            self.finishing.append((old, Finishing(pending, old.writer.decoder.vllm_version, self.rotator.settings,
                                                  time.monotonic(), database_bytes(old.path))))
            self.others = self.others or Others(old.writer.decoder.vllm_version)
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
        for path in self.rotator.expired(keep_open, {path: database_bytes(path) for path in self.rotator.files}):
            remove(path)
            reserve.release(path)

    def _closing(self, part: _Part, stop: Stop, **row: object) -> None:
        w = part.writer
        self.dead |= w.dead
        self.alarmed |= w.alarmed
        self.closed_progress = _sum(self.closed_progress, w.progress())
        self.closed += w.account(stop.frames_seen)
        self.closed_bytes += stop.bytes_seen
        part.closed = True
        try:
            w.finish(stop, **row)
        except sqlite3.Error as exc:  # (its reserve is given back for this: only a disk that took it fails here)
            self.rotation_error = f"the end of {part.path}'s session could not be written: {exc}"

    def finish(self, stop: Stop, received: int) -> None:
        """The end: the previous files with their own counts, the current one with the rest of the tap's."""
        while self.finishing:
            self._close(self.finishing[0][0])
        self._closing(self.current, msgspec.structs.replace(
            stop, frames_seen=stop.frames_seen - self.closed.seen, bytes_seen=stop.bytes_seen - self.closed_bytes))

    def progress(self) -> Progress:
        """The totals over every file of this run, and which file is being written."""
        open_parts = [p for p in (*(p for p, _ in self.finishing), self.current) if not p.closed]
        total = self.closed_progress
        for part in open_parts:
            total = _sum(total, part.writer.progress())
        writers = [p.writer for p in open_parts]
        counts = msgspec.structs.replace(  # (the files may share dead engines and drift alarms)
            total.counts, engines_dead=len(self.dead.union(*(w.dead for w in writers))),
            drift_alarms=len(self.alarmed.union(*(w.alarmed for w in writers))))
        return msgspec.structs.replace(
            total, counts=counts, db_path=str(self.current.path),
            write_error=total.write_error or self.rotation_error,
            session_id=self.current.writer.session_id, rotations=self.rotator.rotations,
            rotations_failed=self.rotator.rotations_failed, files_deleted=self.rotator.files_deleted,
            frames_seen_closed_files=self.closed.seen)


# What a new file's session row takes from the one before it.
_CARRIED = ("name", "mode", "listen", "upstream", "proxy_version", "proxy_host", "proxy_instance", "redaction_policy",
            "redaction_key", "sample_requests", "sample_seed", "frontend_release", "frontend_source",
            "frontend_name", "frontend_version")


def _sum(a: Progress, b: Progress) -> Progress:
    """``b`` with ``a``'s counts added to its own."""
    return msgspec.structs.replace(b, counts=a.counts + b.counts,
                                   decoded_through_ns=max(a.decoded_through_ns, b.decoded_through_ns),
                                   vllm_version=b.vllm_version or a.vllm_version, drift=b.drift or a.drift)

