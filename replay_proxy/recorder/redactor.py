"""The redactor process: between the recorder's tap and the writer when recording with ``--redact-key``.

Theory of operation. Redacting a busy engine's frames costs about as much
CPU as decoding and writing them, so one process doing both falls behind
where either alone keeps up (``scripts/bench/busy.py --redact-key``). This
process takes the tap's messages (``recorder/protocol.py``), redacts their
frames (``redact/frames.py``) and passes the same messages on, redacted, to
the writer, which then only decodes and writes: the two run on two cores.
Nothing unredacted goes further than this process's memory.

Each ``Batch`` it passes on counts the frames it holds now: outputs whose
request's ADD has not come yet wait here (they are the tap's "queued"
frames meanwhile), and go on with a later batch. ``Stop`` goes on last,
after what still waited (with the redaction's counts, for the session row).
Like the writer it runs in a session of its own and SCHED_IDLE, and enters
the kernel every few frames it redacts (a few tens of microseconds of work,
well under a scheduler tick), for the writer's reason; if the
proxy dies without ``Stop``, it passes on what waited and exits, and the
writer ends the session as interrupted.
"""

from __future__ import annotations

import gc
import itertools
import os
import sys
from collections.abc import Sequence

import msgspec
import zmq

from replay_proxy.redact.settings import Redaction, redaction_counts
from replay_proxy.recorder.protocol import Batch, RedactorStart, Stop, batch_message, header, stop_message
from replay_proxy.wire.capture import (
    RELAY, CapturedFrame, EngineLoss, decode_entries, engine_loss_entry, relay_entry)

PARENT_CHECK_S = 1.0  # how often, while nothing comes: is the proxy still there?
LINGER_MS = 30_000
REDACTED_PER_YIELD = 4  # frames redacted between two entries into the kernel (each about 15 us of work)


class RedactorLoop:
    """The redactor process: the tap's messages in, the same messages redacted out, until Stop."""

    def __init__(self, start: RedactorStart):
        self.parent = start.parent_pid
        self.redactor = Redaction(start.redaction).redactor(None)  # the registration names the release
        self.context = zmq.Context()
        self.tap = self.context.socket(zmq.PULL)
        self.tap.setsockopt(zmq.RCVHWM, 0)  # the tap bounds the queue, in frames
        self.tap.bind(start.tap_address)
        self.writer = self.context.socket(zmq.PUSH)
        self.writer.setsockopt(zmq.SNDHWM, 0)
        # What it passed on moves to the writer's own queue as soon as the writer is there (it takes
        # messages in as they come, however far behind its decoding is): a bound only for a writer gone.
        self.writer.setsockopt(zmq.LINGER, LINGER_MS)
        self.writer.connect(start.writer_address)
        self.last = Batch(0, 0, 0)  # the tap's counts so far
        self.redacted = itertools.count()  # frames, for give_way

    def run(self) -> None:
        while True:
            if not self.tap.poll(int(PARENT_CHECK_S * 1000)):
                if os.getppid() != self.parent:  # died without Stop: the writer notices it too
                    self._pass_on(self.redactor.flush(), self.last)
                    break
                continue
            message = self.tap.recv_multipart()
            head = header(message)
            if isinstance(head, Stop):
                self._pass_on(self.redactor.flush(), self.last)
                self.writer.send_multipart(stop_message(msgspec.structs.replace(
                    head, redaction_counts=redaction_counts(self.redactor))))
                break
            self.last = head
            self._pass_on(self.redactor.frames(decode_entries(message[1]), before_each=self.give_way), head)
        self.tap.close(linger=0)
        self.writer.close()
        self.context.term()

    def give_way(self) -> None:
        """Enter the kernel before every ``REDACTED_PER_YIELD``-th frame (see the module's docstring)."""
        if next(self.redacted) % REDACTED_PER_YIELD == 0:
            os.sched_yield()

    def _pass_on(self, redacted: Sequence[CapturedFrame | EngineLoss], head: Batch) -> None:
        """The redacted frames (and losses), as one message of the relay's own entries."""
        if not redacted:  # all of it waits for an ADD
            return
        entries = [[RELAY, *(engine_loss_entry(item) if isinstance(item, EngineLoss) else relay_entry(item))]
                   for item in redacted]
        frames = sum(type(item) is CapturedFrame for item in redacted)
        self.writer.send_multipart(batch_message(entries, Batch(frames, head.frames_seen, head.bytes_seen)))


if __name__ == "__main__":
    loop = RedactorLoop(msgspec.json.decode(sys.argv[1], type=RedactorStart))
    gc.freeze()  # as the writer: the key's permutation and the rest of start are never garbage
    loop.run()
