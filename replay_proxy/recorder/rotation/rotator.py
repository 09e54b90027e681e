"""``record --rotate-mb / --rotate-every / SIGHUP`` and ``--keep / --max-total-gb``: one recording in a
series of files, each of which stands alone. Sans-IO: the clock and the files' sizes are passed in. The
writer process holds the files (``series.py``) and acts on what this says.

Theory of operation. The writer rotates, since it is where the files are written and it knows their
size. It rotates between two of its transactions, and only once it has nothing kept to decode: under
overload a rotation waits until the writer has caught up, and it is not lost. A rotation does four
things:

* It ends the current file's session: status ``complete``, and ``continued_in`` names the next file.
* It opens the next file. Its name comes from the ``--db`` pattern's strftime fields at that moment
  (local time), with ``-1``, ``-2`` ... before the suffix if that name is taken.
* The next file's session (``continues`` names the previous file) begins with copies of the
  session's start. That is every frame before its first ADD (handshakes, registrations, the start-up
  utility calls and their results), and every handshake and registration since. So each file
  replays, diffs, cuts and exports by itself.
* ``--keep`` and ``--max-total-gb`` then delete this run's oldest closed files, never the one being
  written, nor the one whose requests are still finishing.

A request in flight at a rotation is recorded whole in the file where its ADD is. A previous file
stays open while such requests run, and what crosses for them goes there. An EngineCoreOutputs frame
that also carries other requests' outputs (or a utility result) is split, and each file gets its
part. A previous file closes when the last of those requests finishes or is aborted, or at the end. It
also closes after ``FINISHING_S``, or once it has grown by ``FINISHING_GROWTH`` of ``--rotate-mb``
(so with ``--keep K`` the files stay under (K + 1) x that size), and at most ``FINISHING_FILES`` stay
open: a rotation beyond that closes the oldest. Whatever of its
requests crosses after that goes to the current file without its ADD; replay plays requests, so it
passes over those outputs. So do the frames a writer behind its traffic keeps to decode later: they
are decoded into the current file as they are. An ABORT ends a request ``ABORT_GRACE_NS`` after it
crossed (by the frames' own times, not the writer's): vLLM's engine sends nothing for an aborted request,
but outputs it had already sent may cross after the ABORT, and those go to the request's file too.

Counts. Every frame that crossed is counted in exactly one file. That is the oldest previous file
whose requests it carries an output or ABORT of, else the current one. A file's
``frames_seen`` is what is counted there, plus what the tap dropped while it was current, so the
files' ``frames_seen`` add up to what crossed. Rows that are copies (the session's start in each new
file, the other part of a split frame) are ``frames_copied``, never ``frames_recorded``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from replay_proxy.recorder.protocol import RotationSettings
from replay_proxy.store.subset import Cutter, announced_release
from replay_proxy.wire.capture import CapturedFrame, EngineLoss
from replay_proxy.wire.messages import ENGINE_CORE_DEAD, Channel, Direction, RequestType, request_type
from replay_proxy.wire.schema import Schema
from replay_proxy.wire.registry import schema_for
from replay_proxy.wire.values import decode_msgpack

ROTATE_RETRY_S = 10.0  # after a rotation that failed (no space, no permission): try again this much later
FINISHING_FILES = 4  # previous files open at once while their requests finish ...
FINISHING_S = 60.0  # ... for this long at most ...
FINISHING_GROWTH = 1 / 8  # ... and, with --rotate-mb, growing by this share of it at most
ABORT_GRACE_NS = 2_000_000_000  # an aborted request's outputs that cross this soon after its ABORT are its own


def file_named(pattern: str, now: float) -> Path:
    """The pattern's strftime fields filled in for ``now`` (local time)."""
    return Path(time.strftime(pattern, time.localtime(now)))


def _asks(frame: CapturedFrame) -> RequestType | None:
    return request_type(frame.channel, frame.direction, frame.parts)


class Rotator:
    """When to rotate, what every new file begins with, and which of this run's files to delete."""

    def __init__(self, settings: RotationSettings, first: Path, now: float):
        self.settings = settings
        self.files = [first]  # this run's files that still exist, oldest first
        self.used = {first}  # every file this run has written
        self.start: list[CapturedFrame] = []  # what each new file begins with
        self._started = False  # an ADD has crossed: the session's start is over
        # the start-up's utility calls not answered yet: (engine, API server, id)
        self._calls: set[tuple[int | None, Any, Any]] = set()
        self._schema, _ = schema_for(None)  # the engines' release, once a registration names it
        self.requested = False  # SIGHUP
        self.due_at = self._next_boundary(now)
        self.retry_at = 0.0
        self.rotations = self.rotations_failed = self.files_deleted = 0

    def observe(self, items: Iterable[CapturedFrame | EngineLoss]) -> None:
        """Note what of these frames (in seq order) each new file must begin with: the start-up, its utility
        calls' results (which may come after the first ADD), and any later handshake or registration."""
        for item in items:
            if type(item) is not CapturedFrame:
                continue
            registration = item.channel is Channel.INPUT and item.direction is Direction.TO_FRONTEND
            if registration and (version := announced_release(item)):
                self._schema, _ = schema_for(version)
            if not self._started:
                if _asks(item) is RequestType.ADD:
                    self._started = True
                else:
                    self.start.append(item)
                    self._note_call(item)
            elif item.channel is Channel.HANDSHAKE or registration:
                self.start.append(item)  # an engine that joined later
            elif self._calls and item.channel is Channel.OUTPUT and self._answers_a_call(item):
                self.start.append(item)

    def _note_call(self, frame: CapturedFrame) -> None:
        if _asks(frame) is RequestType.UTILITY and len(frame.parts) > 1:
            with contextlib.suppress(msgspec.DecodeError):
                body = decode_msgpack(frame.parts[1])
                if isinstance(body, list) and len(body) >= 2:
                    self._calls.add((frame.engine_index, body[0], body[1]))

    def _answers_a_call(self, frame: CapturedFrame) -> bool:
        """Whether an output frame answers one of the start-up's utility calls (then no longer awaited)."""
        try:
            value = decode_msgpack(frame.parts[0])
        except msgspec.DecodeError:
            return False
        utility = self._schema.read(value, "EngineCoreOutputs", "utility_output")
        call = (frame.engine_index, frame.client_index, utility[0]) if isinstance(utility, list) and utility else None
        if call not in self._calls:
            return False
        self._calls.discard(call)
        return True

    def next_file(self, now: float, holds_data: Callable[[Path], bool]) -> Path:
        """A new file for the next part of the recording, named for ``now``: never one that ``holds_data``
        already, nor one this run has written (and perhaps deleted)."""
        path = candidate = file_named(self.settings.pattern, now)
        number = 0
        while candidate in self.used or holds_data(candidate):
            number += 1
            candidate = path.with_name(f"{path.stem}-{number}{path.suffix}")
        return candidate

    def due(self, now: float, current_bytes: int) -> bool:
        """Whether to rotate at ``now``, the file being written having grown to ``current_bytes``."""
        if now < self.retry_at:
            return False
        rotate_bytes = self.settings.rotate_bytes
        return self.requested or (self.due_at is not None and now >= self.due_at) or (
            rotate_bytes is not None and current_bytes >= rotate_bytes)

    def rotated(self, path: Path, now: float) -> None:
        self.files.append(path)
        self.used.add(path)
        self.rotations += 1
        self.requested = False
        self.due_at = self._next_boundary(now)

    def failed(self, now: float) -> None:
        self.rotations_failed += 1
        self.retry_at = now + ROTATE_RETRY_S

    def expired(self, open_files: set[Path], sizes: Mapping[Path, int]) -> list[Path]:
        """This run's oldest files beyond ``--keep`` and ``--max-total-gb`` (by their ``sizes``), older than any
        still open (so the files left are always the newest; a file still finishing its requests holds back
        the newer ones, at most ``FINISHING_FILES``, until it closes). Forgotten here: the caller deletes them."""
        keep, most = self.settings.keep, self.settings.max_total_bytes
        total = sum(sizes[path] for path in self.files) if most is not None else 0
        gone = []
        for path in list(self.files):
            if path in open_files or not (
                    (keep is not None and len(self.files) > keep) or (most is not None and total > most)):
                break
            total -= sizes[path]
            self.files.remove(path)
            gone.append(path)
        self.files_deleted += len(gone)
        return gone

    def _next_boundary(self, now: float) -> float | None:
        """The next multiple of ``--rotate-every`` since the epoch (UTC): ``1h`` rotates on the hour."""
        every = self.settings.every_s
        return None if every is None else (math.floor(now / every) + 1) * every


class Finishing:
    """One previous file's requests still in flight after a rotation: the part of a frame that goes there."""

    def __init__(self, pending: set[str], version: str | None, settings: RotationSettings, now: float,
                 file_bytes: int):
        """``now``: a monotonic clock's time; ``file_bytes``: the file's size then."""
        self.pending = pending
        self._theirs = Cutter(pending, version, in_window=lambda _: True, first_add_ns=None)
        self._aborted: dict[str, int] = {}  # request id: the frame time until which its outputs may still come
        self._until = now + FINISHING_S
        self._most = None if settings.rotate_bytes is None else \
            file_bytes + int(settings.rotate_bytes * FINISHING_GROWTH)

    def end(self, ended: Iterable[str], aborted: Iterable[str], ts_ns: int) -> None:
        """Requests that finished (no longer pending) or were aborted at ``ts_ns`` (pending for the grace)."""
        self.pending.difference_update(ended)
        for request_id in aborted:
            if request_id in self.pending:
                self._aborted.setdefault(request_id, ts_ns + ABORT_GRACE_NS)

    def expire(self, ts_ns: int) -> None:
        """A frame that crossed at ``ts_ns``: the aborted requests whose grace it is past are no longer pending."""
        if self._aborted:
            for request_id in [r for r, until in self._aborted.items() if until < ts_ns]:
                del self._aborted[request_id]
                self.pending.discard(request_id)

    def over(self, now: float, file_bytes: int) -> bool:
        """Its requests have all ended, or at ``now`` (the monotonic clock) it has waited or grown to
        ``file_bytes`` as much as it may."""
        return not self.pending or now > self._until or (self._most is not None and file_bytes > self._most)

    def part(self, frame: CapturedFrame) -> CapturedFrame | None:
        """``frame`` with only these requests' outputs (or ABORT), and no utility result."""
        return self._theirs.frame(frame)


class Others:
    """The part of a frame for the current file: all but the requests that finish in previous files."""

    def __init__(self, version: str | None):
        self._kept = _PendingInNone()
        self._cutter = Cutter(self._kept, version, in_window=lambda _: True, first_add_ns=None, every_call=True)

    def part(self, frame: CapturedFrame, finishing: list[Finishing]) -> CapturedFrame | None:
        """``frame`` without the requests still pending in ``finishing``, the previous files open now."""
        self._kept.finishing = finishing
        return self._cutter.frame(frame)


def requests_of(frame: CapturedFrame, schema: Schema) -> tuple[list[str], list[str], list[str]]:
    """(the requests a frame carries outputs or an ABORT of, those of them it finishes, those it aborts)."""
    try:
        if frame.channel is Channel.INPUT and frame.direction is Direction.TO_ENGINE:
            if _asks(frame) is RequestType.ABORT and len(frame.parts) > 1:
                ids = decode_msgpack(frame.parts[1])
                return (ids, [], ids) if isinstance(ids, list) else ([], [], [])
            return [], [], []
        if frame.channel is not Channel.OUTPUT or frame.parts == [ENGINE_CORE_DEAD]:
            return [], [], []
        value = decode_msgpack(frame.parts[0])
    except msgspec.DecodeError:
        return [], [], []
    outputs = schema.read(value, "EngineCoreOutputs", "outputs")
    if not isinstance(outputs, list):
        return [], [], []
    ids = [rid for o in outputs if (rid := schema.read(o, "EngineCoreOutput", "request_id")) is not None]
    ended = [schema.read(o, "EngineCoreOutput", "request_id") for o in outputs
             if schema.read(o, "EngineCoreOutput", "finish_reason") is not None]
    return ids, ended, []


class _PendingInNone:
    """Request ids pending in none of ``finishing``: what the cutter keeps (read as they change)."""

    def __init__(self) -> None:
        self.finishing: list[Finishing] = []

    def __contains__(self, request_id: object) -> bool:
        return not any(request_id in f.pending for f in self.finishing)
