"""The recorder's tap: every copy the relay makes, counted and passed on to the writer process in batches.

Two sockets come in. The relay's forwarder threads number and stamp every message as it passes and send
the copies to ``capture`` in batches (in C, without waiting: ``net/_forward.c``); the relay's own thread
reports the handshake and the coordinator through ``frame`` and ``engine_lost``. The tap's thread takes
both, counts them (``TapCounts``) and passes what came within ``TAP_HOLD_S`` to the writer as one message
(the layout is ``wire/capture.py``). Nothing in Python is woken for each frame, and the writer only a few
times a second: on this project's 2-core machine a Python thread woken for every frame, doing nothing
else, costs more round-trip latency than the forwarding hop itself (``scripts/bench/forward.py``).

The tap is the one place that can drop, so it is the one that counts. The queue is bounded in frames: the
writer reports how many it has written, and a batch that would put more than ``queue_size`` frames
between the tap and SQLite is dropped from the *recording* (it was forwarded all the same; its numbers are
a gap in ``seq``) and counted, live. ``block`` makes the tap wait for the writer instead, and the
forwarders wait once their copies back up: lossless, at the cost of latency.

Which thread does what: ``frame``, ``engine_lost`` and ``relay_stopped`` are the relay's thread's;
``stop`` the closing thread's; everything else runs on the tap's own thread, which alone writes ``counts``
and uses the writer process's handle until it ends.
"""

from __future__ import annotations

import math
import threading
import time
import uuid

import zmq

from replay_proxy.store.counts import TapCounts
from replay_proxy.recorder.protocol import Batch, Stop, batch_message, stop_message
from replay_proxy.recorder.writer_process import LINGER_MS, PROGRESS_WAIT_MS, WriterProcess
from replay_proxy.wire.capture import (
    FLUSH_MS, RELAY, CapturedFrame, EngineLoss, engine_loss_entry, entry_counts, entry_link, is_engine_loss,
    relay_entry)

TAP_BATCH = 4096  # frames per message from the tap to the writer, at most (unless one batch has more) ...
TAP_HOLD_S = 0.05  # ... and how long the tap holds them at most
BLOCK_BATCHES = 4  # in block mode, batches of copies that may wait at each end of a forwarder's pipe
STOP_GRACE_MS = 10 * FLUSH_MS  # copies still batched in a running forwarder come within FLUSH_MS
STOP_COPIES_S = 0.5  # after STOP, a stopped relay's copies are waited for while one comes at least this often
# The tap passes what it holds soon after STOP: the forwarders have stopped, so few copies are still on
# their way, and each comes within STOP_COPIES_S of the last or is counted late.
TAP_STOP_S = 1.0
BLOCK_STALL_S = 10.0  # in block mode the stop waits for the writer, as long as it gets on within this
STOP = [b""]  # from the relay's thread to the tap, after its last entry
_STOP_ENTRY = [RELAY, *STOP]  # STOP as the tap receives it


class Tap:
    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], writer: WriterProcess, *, queue_size: int, block: bool):
        # Written by the tap's thread alone (read by others, a field at a time):
        self.counts = TapCounts()
        self.first_frame_s: float | None = None  # when the tap took the first frame (wall clock)
        self._writer, self._queue_size, self._block = writer, queue_size, block  # (the writer: see its docstring)
        # Written by the relay's thread once it has stopped, read by the tap's after STOP:
        self._last_seq: int | None = None  # how many the relay numbered
        # Written by the closing thread before it sends STOP, read by the tap's after it:
        self._ending = Stop("complete", None, 0, 0)  # how the session ended, for the tap's Stop to the writer
        # We connect, the writer binds: a connecting PUSH queues from the first frame on, even before the
        # writer process has started. Unbounded here: the tap counts.
        self._out = context.socket(zmq.PUSH)
        self._out.setsockopt(zmq.SNDHWM, 0)
        self._out.setsockopt(zmq.LINGER, -1)
        self._out.connect(writer.tap_address)
        # Forwarders must never wait for us when dropping is allowed; when it is not, they wait
        # once a few batches queue (an inproc pipe is bounded only if both ends are).
        self.capture_hwm = BLOCK_BATCHES if block else 0
        self.capture = f"inproc://replay-proxy-capture-{uuid.uuid4().hex}"
        self._collector = context.socket(zmq.ROUTER)
        self._collector.setsockopt(zmq.RCVHWM, self.capture_hwm)
        self._collector.bind(self.capture)
        self._relay = context.socket(zmq.DEALER)  # entries from the relay's own thread
        self._relay.setsockopt(zmq.SNDHWM, 0)
        self._relay.setsockopt(zmq.IDENTITY, RELAY)
        self._relay.connect(self.capture)
        self._thread = threading.Thread(target=self._pass_on, daemon=True, name="recorder tap")

    def start(self) -> None:
        self._thread.start()

    def close(self, linger_ms: int = LINGER_MS) -> None:
        """Once its thread has ended (or never began). What it sent a writer still at it goes on to it for
        ``linger_ms`` in the background (not thrown away with this process's queue, as linger 0 would)."""
        self._relay.close(linger=0)
        self._collector.close(linger=0)
        self._out.close(linger=linger_ms)

    # --- called by the relay's thread ------------------------------------------------------

    def frame(self, frame: CapturedFrame) -> None:
        if not self._relay.closed:  # else the session is over: a late report from a peer shutting down
            self._relay.send_multipart(relay_entry(frame))

    def engine_lost(self, loss: EngineLoss) -> None:
        if not self._relay.closed:
            self._relay.send_multipart(engine_loss_entry(loss))

    def relay_stopped(self, last_seq: int) -> None:
        self._last_seq = last_seq

    # --- called by the closing thread ------------------------------------------------------

    def stop(self, status: str, error: str | None) -> bool:
        """Pass on everything queued, then tell the writer how the session ended. True once the tap's thread
        has done so (its sockets, and the writer process's handle, are the caller's then). Dropping, it does
        within STOP_COPIES_S; blocking, it waits for the writer, so this waits as long as the writer gets on
        (lossless takes what it takes)."""
        self._ending = Stop(status, error, 0, 0)
        self._relay.send_multipart(STOP)  # after every entry already queued
        self._relay.close(linger=-1)
        self._thread.join(TAP_STOP_S + STOP_COPIES_S)
        while self._block and self._thread.is_alive():
            before = self._writer.progress
            self._thread.join(BLOCK_STALL_S)
            if self._writer.progress == before:
                break
        return not self._thread.is_alive()

    # --- the tap's thread -------------------------------------------------------------------

    def _pass_on(self) -> None:
        """Count and pass every entry on to the writer, until STOP from the relay's thread; then send
        the writer its Stop (this thread owns the socket, and only it knows when the last frame is in)."""
        collector, counts, writer = self._collector, self.counts, self._writer
        most = min(TAP_BATCH, self._queue_size)
        stop_by = None  # after STOP: when the copies not yet in are given up (pushed on while they come)
        stop_wait_s = 0.0
        while True:
            entries: list[list[bytes]] = []
            frames = 0
            due = None  # when the entries go: held a while, so that the writer's side wakes less
            while frames < most:
                # (after STOP with every copy in, nothing more is waited for)
                deadline: float | None = (time.monotonic() if stop_by is not None and self._copies_in()
                                          else due or stop_by)
                if not collector.poll(PROGRESS_WAIT_MS if deadline is None  # (ms, whole: as pyzmq takes them)
                                      else int(max(0.0, deadline - time.monotonic()) * 1000)):
                    break
                entry = collector.recv_multipart()
                if due is None:
                    due = min(time.monotonic() + TAP_HOLD_S, stop_by or math.inf)
                if entry == _STOP_ENTRY:
                    # STOP. The forwarders' copies come by other sockets than STOP, so some may still be on
                    # their way: once the relay has said how many it numbered, they are waited for by count
                    # while they keep coming (a forwarder blocked on a full pipe, in block mode, sends its next
                    # batch only once the tap has read the last; a loaded machine delivers late), else for
                    # FLUSH_MS after the last (a running forwarder's come within it).
                    stop_wait_s = STOP_GRACE_MS / 1000 if self._last_seq is None else STOP_COPIES_S
                    stop_by = time.monotonic() + stop_wait_s
                    continue
                if stop_by is not None:
                    stop_by = time.monotonic() + stop_wait_s
                entry_frames, entry_bytes = entry_counts(entry)
                counts.frames_numbered += entry_frames or is_engine_loss(entry)
                frames += entry_frames
                counts.bytes_seen += entry_bytes
                if entry_frames:
                    link = entry_link(entry)
                    counts.bytes_by_link[link] = counts.bytes_by_link.get(link, 0) + entry_bytes
                entries.append(entry)
            counts.frames_seen += frames
            if frames and self.first_frame_s is None:
                self.first_frame_s = time.time()
            if writer.progress_due():
                writer.read_progress()
            if entries:
                self._send(entries, frames)  # (in block mode it may wait for the writer: that is not quiet)
                if stop_by is not None:
                    stop_by = time.monotonic() + stop_wait_s
            elif stop_by is not None and (self._copies_in() or time.monotonic() >= stop_by):  # all passed on
                if self._last_seq is not None:  # forwarded, but their copies never came: counted, as dropped
                    late = max(0, self._last_seq - counts.frames_numbered)
                    counts.frames_seen += late
                    counts.dropped_late += late
                writer.read_progress()  # is everyone still there?
                stop = Stop(self._ending.status, self._ending.error, counts.frames_seen, counts.bytes_seen)
                if writer.lost is None:
                    self._out.send_multipart(stop_message(stop))
                else:  # the redactor died: the writer ends with what it passed on
                    writer.stop_directly(Stop("incomplete", writer.lost, stop.frames_seen, stop.bytes_seen))
                return

    def _copies_in(self) -> bool:
        """Every message the stopped relay numbered has come to the tap."""
        return self._last_seq is not None and self.counts.frames_numbered >= self._last_seq

    def _send(self, entries: list[list[bytes]], frames: int) -> None:
        """Pass entries on, or drop them if the queue has no room (in block mode: wait for room)."""
        counts, writer = self.counts, self._writer
        if not self._has_room(frames):
            writer.read_progress()  # the count we have may be stale
            while not self._has_room(frames):
                if self._block and writer.lost is None:
                    writer.read_progress(PROGRESS_WAIT_MS)
                    continue
                # Dropped from the recording: they were forwarded all the same.
                if writer.lost is None:
                    counts.dropped_queue_full += frames
                else:
                    counts.dropped_writer_lost += frames
                # An engine's loss is no frame: it takes no room, and is kept (while a writer is there).
                entries, frames = [entry for entry in entries if is_engine_loss(entry)], 0
                if not entries or writer.lost is not None:
                    return
        self._out.send_multipart(batch_message(entries, Batch(frames, counts.frames_seen, counts.bytes_seen)))
        counts.frames_sent += frames

    def _has_room(self, frames: int) -> bool:
        """Room for ``frames`` more; an empty queue takes a batch of copies larger than its size.
        A writer that is gone has none."""
        if self._writer.lost is not None:
            return False
        p = self._writer.progress
        queued = self.counts.queued(p.counts.frames_recorded, p.counts.frames_failed, p.counts.frames_sampled_out)
        return queued == 0 or queued + frames <= self._queue_size
