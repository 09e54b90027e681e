"""The writer process: what the recorder's tap sends, into SQLite (``writer.py``, or a rotating
recording's ``rotation/series.py``), until Stop.

It runs in a session of its own, so the signals that stop the proxy's
process group do not reach it: the proxy sends STOP, with the session's
status and final counts, after its last frame. If the proxy dies without
STOP, the writer notices it has another parent than ``parent`` (the proxy's
PID, given, not read at start: the proxy may already be gone by then),
finishes what it has and marks the session ``interrupted``, with the count of
frames seen that the tap's last message carried. Recording redacted, the
messages come through the redactor process (``recorder/redactor.py``), which
may still be passing STOP on when the proxy has gone: the writer waits for
it while that process runs.

It holds what comes in memory while it decodes, and keeps (``Writer.keep``)
what waits beyond ``HOLD_BYTES`` or half the recorder's queue. On STOP it
decodes for at most ``STOP_DECODE_S``, keeps the rest and exits. After every
step it reports its ``Progress`` to the recorder's tap, which bounds the
queue with it and shows it on the status line.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import time

import msgspec
import zmq

from replay_proxy.recorder.protocol import Batch, Stop, WriterStart, encode_progress, header
from replay_proxy.recorder.rotation.series import Series
from replay_proxy.store.writer import DECODE_FRAMES, Entries, Writer
from replay_proxy.wire.capture import decode_entries

HOLD_BYTES = 64 * 2**20  # tap messages waiting in memory beyond this are kept on disk instead
PROGRESS_HWM = 16  # reports waiting for the proxy to read them, at most
STOP_DECODE_S = 2.0  # after STOP: decode this long at most, then keep the rest
PARENT_CHECK_S = 1.0  # how often: is the proxy still there?


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
        self.series = None if start.rotation is None else Series(start, start.rotation, self.writer)
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
            self.writer.finish(self.stop)
        else:
            assert self.stop is not None  # (the loop ends once a Stop came, or was made for a proxy gone)
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
            self.tap.poll(int(PARENT_CHECK_S * 1000))
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
    loop = WriterLoop(msgspec.json.decode(sys.argv[1], type=WriterStart))
    gc.freeze()  # what start made lives as long as the process: no collection need walk it
    loop.run()
