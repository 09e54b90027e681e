"""The recorder: what the relay reports, passed on to the writer process, counted.

Theory of operation: decoding and SQLite writing happen in a separate
*process* (``store/writer.py``), so they never hold the proxy's GIL
(measured: a writer thread in the proxy process made its p99 round trip
several milliseconds, one GIL switch interval). The relay's forwarder
threads number and stamp every message as it passes and send the copies to
the recorder's ``capture`` socket in batches (in C, without waiting: see
``net/_forward.c``); the relay's own thread reports the handshake and the
coordinator with ``frame``. A tap thread takes both, counts them, and passes
what came within ``TAP_HOLD_S`` to the writer as one message (the layout is
``wire/capture.py``). Nothing in Python is woken for each frame, and the
writer only a few times a second: on this project's 2-core machine a
Python thread woken for every frame, doing nothing else, costs more
round-trip latency than the forwarding hop itself
(``scripts/bench/forward.py``).

The tap is the one place that can drop, so it is the one that counts. The
queue is bounded in frames: the writer reports how many it has written, and
a batch that would put more than ``queue_size`` frames between the tap and
SQLite is dropped from the *recording* (it was forwarded all the same; its
numbers are a gap in ``seq``) and counted, live, in the summary and in the
``sessions`` row. ``on_full="block"`` makes the tap wait for the writer
instead, and the forwarders wait once their copies back up: lossless, at
the cost of latency.

Recording redacted (``--redact-key``), a redactor process stands between
the tap and the writer (``store/redactor.py``): the tap's messages go to it,
and it passes them on, redacted, in the same form.
"""

from __future__ import annotations

import enum
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Literal

import msgspec
import zmq

from replay_proxy import __version__
from replay_proxy.clock import utc_now
from replay_proxy.errors import ReplayProxyError
from replay_proxy.redact.settings import Redaction, RedactionSettings
from replay_proxy.store import reserve
from replay_proxy.store.protocol import (
    Batch, Progress, RedactorStart, Stop, WriterStart, batch_message, decode_progress, stop_message)
from replay_proxy.store.rotation import RotationSettings
from replay_proxy.store.sample import RequestSample
from replay_proxy.store.tables import open_database
from replay_proxy.wire.capture import (
    FLUSH_MS, RELAY, CapturedFrame, EngineLoss, engine_loss_entry, entry_counts, entry_link, is_engine_loss,
    relay_entry)

TAP_BATCH = 4096  # frames per message from the tap to the writer, at most (unless one batch has more) ...
TAP_HOLD_S = 0.05  # ... and how long the tap holds them at most
BLOCK_BATCHES = 4  # in block mode, batches of copies that may wait at each end of a forwarder's pipe
STOP_GRACE_MS = 10 * FLUSH_MS  # copies still batched in a running forwarder come within FLUSH_MS
STOP_COPIES_S = 0.5  # after STOP, a stopped relay's copies are waited for while one comes at least this often
PROGRESS_WAIT_MS = 100  # how stale the tap's view of the writer's progress may get while no frames come
FINAL_REPORT_WAIT_MS = 1000  # for the writer's last report (sent after the session's end) beyond WRITER_STOP_S
# record ends within 5 s: the tap passes what it holds soon after STOP (the forwarders have stopped, so few
# copies are still on their way, and each comes within STOP_COPIES_S of the last or is counted late), and
# the writer decodes for 2 s at most after STOP, then keeps the rest and exits (else it ends the session
# itself, in the background).
TAP_STOP_S = 1.0
WRITER_STOP_S = 3.5
TAP_LINGER_MS = 1000  # what the tap sent a writer that is still busy goes on to it this long, in the background
BLOCK_STALL_S = 10.0  # in block mode the stop waits for the writer, as long as it gets on within this
START_TIMEOUT_S = 60.0
# The writer runs as SCHED_IDLE: only on a core nothing else wants, so under load the engine's and the
# forwarders' work comes first; it decodes live while there is CPU to spare, and keeps (then decodes)
# what waits when there is not. (On this project's 2 shared cores, any work beside the forwarders costs
# round-trip p99, whatever its priority: docs/performance.md.)
STOP = [b""]  # from the relay's thread to the tap, after its last entry
_STOP_ENTRY = [RELAY, *STOP]  # STOP as the tap receives it


def _start(module: str, start: WriterStart | RedactorStart) -> subprocess.Popen:
    """One of the recorder's processes, started with its ``start`` (JSON, its one argument), SCHED_IDLE."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, msgspec.json.encode(start).decode()], stdin=subprocess.DEVNULL,
        start_new_session=True)  # SIGINT/SIGTERM for the proxy's group must not cut its work short
    os.sched_setscheduler(process.pid, os.SCHED_IDLE, os.sched_param(0))
    return process


class OnFull(enum.StrEnum):
    """What the tap does when the writer's queue is full."""

    DROP = "drop"  # count the frame as dropped from the recording (it was forwarded all the same)
    BLOCK = "block"  # wait for the writer: lossless, at the cost of latency


class RecorderError(ReplayProxyError):
    """The writer process failed or did not finish in time."""


class RecorderStats(msgspec.Struct, frozen=True, kw_only=True):
    """The counts of the status line, the summary, the ``sessions`` row, the JSON log and the metrics:
    seen = recorded + sampled out + dropped + queued, on every path."""

    frames_seen: int  # forwarded
    frames_recorded: int  # in the database, decoded or kept
    frames_dropped: int  # will never be in it: dropped at a full queue, or not written (a full disk)
    queue_depth_frames: int = 0  # on their way to the database
    bytes_seen: int
    requests: int
    engines_dead: int
    frames_undecoded: int = 0
    error: str | None = None  # the writer's last write error, or its death
    drift_alarms: int = 0  # distinct ways the traffic disagreed with its release's schema
    drift: str | None = None  # the newest drift alarm
    final: bool = True  # False while the writer still writes: the frames queued are not counted yet
    # frames_dropped by why: "queue_full" (the tap's), "write_failed" (a full disk, the --max-db-mb cap),
    # "writer_lost" (the writer or redactor process died), "late_at_stop" (a copy the relay numbered that
    # never came to the tap after the stop)
    frames_dropped_by_reason: dict[str, int] = msgspec.field(default_factory=dict)
    frames_undecodable: int = 0  # recorded with a decode error
    decode_lag_s: float = 0.0  # while frames wait to be decoded: how long ago the newest decoded one crossed
    bytes_by_link: dict[tuple[str, str], int] = msgspec.field(default_factory=dict)  # (channel, direction)
    vllm_version: str | None = None  # as the engines announced it
    writer_lost: str | None = None  # why the writer (or the redactor) is gone, if it is
    frames_sampled_out: int = 0  # left out by --sample-requests: neither recorded nor dropped
    outputs_sampled_out: int = 0
    rotations: int = 0  # files begun after the first (--rotate-mb, --rotate-every, SIGHUP)
    rotations_failed: int = 0  # tried and failed (no space, no permission): tried again later
    files_deleted: int = 0  # by --keep and --max-total-gb
    db_path: str | None = None  # the file being written


class SessionInfo(msgspec.Struct, frozen=True):
    name: str
    mode: Literal["record", "replay"] = "record"
    listen: str | None = None
    upstream: str | None = None
    baseline_session_id: int | None = None
    frontend_release: str | None = None  # what the frontend writes as, where the user knows it (else found)
    frontend_source: str | None = None


class Recorder:
    """Records one session; an ``Observer`` for the relay (and for the replay players)."""

    def __init__(self, db_path: str | Path, session: SessionInfo, *, on_full: OnFull = OnFull.DROP,
                 queue_size: int = 100_000, max_db_bytes: int | None = None,
                 redaction: RedactionSettings | None = None, sample: RequestSample | None = None,
                 rotation: RotationSettings | None = None, context: zmq.Context | None = None):
        self.db_path = Path(db_path)
        self._frames_seen = self._frames_dropped = self._bytes_seen = 0
        self._numbered = 0  # messages the tap has had that were numbered (frames and engine losses)
        self._last_seq: int | None = None  # how many the relay numbered, once it has stopped
        self._frames_dropped_queue_full = 0  # of those dropped here, while the writer was there
        self._frames_dropped_late = 0  # numbered by the stopped relay, never come to the tap
        self._frames_sent = 0  # passed on to the writer
        self._bytes_by_link: dict[tuple[str, str], int] = {}  # the tap's, read by statistics()
        self._first_frame_s: float | None = None  # when the tap took the first frame (wall clock)
        self._queue_size = queue_size
        self._block = OnFull(on_full) is OnFull.BLOCK
        row = {**msgspec.to_builtins(session), "started_at": utc_now(), "status": "recording",
               "proxy_version": __version__, "frames_seen": 0, "frames_recorded": 0, "frames_dropped": 0}
        if redaction is not None:  # loaded here too: a bad key or policy fails before anything starts
            row = Redaction(redaction).session_row(row)
        if sample is not None:
            row.update(sample_requests=sample.fraction, sample_seed=sample.seed, frames_sampled_out=0,
                       outputs_sampled_out=0)
        db = open_database(self.db_path)
        self.session_id = db["sessions"].insert(row).last_pk
        db.close()
        reserve.hold(self.db_path)  # for the session's end, however full the disk gets (store/reserve.py)
        context = context or zmq.Context.instance()
        self._folder = tempfile.mkdtemp(prefix="replay-proxy-")
        tap, progress = f"ipc://{self._folder}/tap", f"ipc://{self._folder}/progress"
        # Read by the tap thread only; counts are cumulative, so only the newest matters (each read drains the
        # queue). Not conflating: a conflating PULL drops what a peer that has just closed sent last.
        self._progress_socket = context.socket(zmq.PULL)
        self._progress_socket.bind(progress)
        self._progress = Progress()
        self._ending = ("complete", None)  # how the session ended, for the tap's Stop to the writer
        self._writer_lost: str | None = None  # why the writer is gone, once the tap has seen it go
        self._progress_due = 0.0  # when the tap thread reads the writer's progress next
        # We connect, the writer binds: a connecting PUSH queues from the first frame on,
        # even before the writer process has started. Unbounded here: the tap counts.
        self._tap = context.socket(zmq.PUSH)
        self._tap.setsockopt(zmq.SNDHWM, 0)
        self._tap.setsockopt(zmq.LINGER, -1)
        self._tap.connect(tap)
        # Forwarders must never wait for us when dropping is allowed; when it is not, they wait
        # once a few batches queue (an inproc pipe is bounded only if both ends are).
        self.capture_hwm = BLOCK_BATCHES if self._block else 0
        self.capture = f"inproc://replay-proxy-capture-{uuid.uuid4().hex}"
        self._collector = context.socket(zmq.ROUTER)
        self._collector.setsockopt(zmq.RCVHWM, self.capture_hwm)
        self._collector.bind(self.capture)
        self._mine = context.socket(zmq.DEALER)  # entries from the relay's own thread
        self._mine.setsockopt(zmq.SNDHWM, 0)
        self._mine.setsockopt(zmq.IDENTITY, RELAY)
        self._mine.connect(self.capture)
        # Redacting, the tap's messages go through the redactor process on their way to the writer.
        self._context = context
        self._writer_tap = writer_tap = tap if redaction is None else f"ipc://{self._folder}/redacted"
        self._redactor = None if redaction is None else _start(
            "replay_proxy.store.redactor", RedactorStart(tap, writer_tap, os.getpid(), redaction))
        self._process = _start("replay_proxy.store.writer", WriterStart(
            str(self.db_path), self.session_id, writer_tap, progress, parent_pid=os.getpid(),
            hold_frames=max(1, queue_size // 2), sockets_folder=self._folder, max_bytes=max_db_bytes,
            upstream_pid=self._redactor.pid if self._redactor else None, sample=sample, rotation=rotation))
        self._rotating = rotation is not None
        # Its start (imports, opening the database) takes a CPU for a while: have it done before
        # the relay opens, not while the first frames pass.
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._progress_socket.poll(100):  # its first report says it has started
            if self._process.poll() is not None or time.monotonic() > deadline:
                self._give_up_starting()
        self._tap_thread = threading.Thread(target=self._pass_on, daemon=True, name="recorder tap")
        self._tap_thread.start()
        self.status = "recording"

    def _give_up_starting(self) -> None:
        self._kill_redactor()
        self._process.kill()
        for sock in (self._tap, self._collector, self._mine, self._progress_socket):
            sock.close(linger=0)
        shutil.rmtree(self._folder, ignore_errors=True)
        error = f"the writer process did not start (exit code {self._process.wait(5)})"
        reserve.release(self.db_path)
        db = open_database(self.db_path)
        db["sessions"].update(self.session_id, {"ended_at": utc_now(), "status": "failed", "error": error})
        db.close()
        raise RecorderError(error)

    # --- called by the relay's thread ------------------------------------------------------

    def frame(self, frame: CapturedFrame) -> None:
        if not self._mine.closed:  # else the session is over: a late report from a peer shutting down
            self._mine.send_multipart(relay_entry(frame))

    def engine_lost(self, loss: EngineLoss) -> None:
        if not self._mine.closed:
            self._mine.send_multipart(engine_loss_entry(loss))

    def relay_stopped(self, last_seq: int) -> None:
        self._last_seq = last_seq

    # --- the tap thread -------------------------------------------------------------------

    def _pass_on(self) -> None:
        """Count and pass every entry on to the writer, until STOP from the relay's thread; then send
        the writer its Stop (this thread owns the socket, and only it knows when the last frame is in)."""
        collector = self._collector
        most = min(TAP_BATCH, self._queue_size)
        stop_by = None  # after STOP: when the copies not yet in are given up (pushed on while they come)
        stop_wait_s = 0.0
        while True:
            entries: list[list[bytes]] = []
            frames = 0
            due = None  # when the entries go: held a while, so that the writer's side wakes less
            while frames < most:
                # (after STOP with every copy in, nothing more is waited for)
                deadline = time.monotonic() if stop_by is not None and self._copies_in() else due or stop_by
                if not collector.poll(PROGRESS_WAIT_MS if deadline is None
                                      else max(0.0, deadline - time.monotonic()) * 1000):
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
                self._numbered += entry_frames or is_engine_loss(entry)
                frames += entry_frames
                self._bytes_seen += entry_bytes
                if entry_frames:
                    link = entry_link(entry)
                    self._bytes_by_link[link] = self._bytes_by_link.get(link, 0) + entry_bytes
                entries.append(entry)
            self._frames_seen += frames
            if frames and self._first_frame_s is None:
                self._first_frame_s = time.time()
            if time.monotonic() >= self._progress_due:
                self._read_progress(0)
            if entries:
                self._send(entries, frames)  # (in block mode it may wait for the writer: that is not quiet)
                if stop_by is not None:
                    stop_by = time.monotonic() + stop_wait_s
            elif stop_by is not None and (self._copies_in() or time.monotonic() >= stop_by):  # all passed on
                if self._last_seq is not None:  # forwarded, but their copies never came: counted, as dropped
                    late = max(0, self._last_seq - self._numbered)
                    self._frames_seen += late
                    self._frames_dropped += late
                    self._frames_dropped_late += late
                status, error = self._ending
                self._read_progress(0)  # is everyone still there?
                if self._writer_lost is None:
                    self._tap.send_multipart(stop_message(Stop(status, error, self._frames_seen, self._bytes_seen)))
                elif self._process.poll() is None:  # the redactor died: the writer ends with what it passed on
                    self._stop_writer_directly(Stop("incomplete", self._writer_lost, self._frames_seen,
                                                    self._bytes_seen))
                return

    def _copies_in(self) -> bool:
        """Every message the stopped relay numbered has come to the tap."""
        return self._last_seq is not None and self._numbered >= self._last_seq

    def _stop_writer_directly(self, stop: Stop) -> None:
        """Past a redactor that is gone: the writer binds the address, so a second sender may connect."""
        with self._context.socket(zmq.PUSH) as direct:
            direct.setsockopt(zmq.LINGER, TAP_LINGER_MS)
            direct.connect(self._writer_tap)
            direct.send_multipart(stop_message(stop))

    def _send(self, entries: list[list[bytes]], frames: int) -> None:
        """Pass entries on, or drop them if the queue has no room (in block mode: wait for room)."""
        if not self._has_room(frames):
            self._read_progress(0)  # the count we have may be stale
            while not self._has_room(frames):
                if self._block and self._writer_lost is None:
                    self._read_progress(PROGRESS_WAIT_MS)
                    continue
                self._frames_dropped += frames  # from the recording: they were forwarded all the same
                self._frames_dropped_queue_full += frames if self._writer_lost is None else 0
                # An engine's loss is no frame: it takes no room, and is kept (while a writer is there).
                entries, frames = [entry for entry in entries if is_engine_loss(entry)], 0
                if not entries or self._writer_lost is not None:
                    return
        self._tap.send_multipart(batch_message(entries, Batch(frames, self._frames_seen, self._bytes_seen)))
        self._frames_sent += frames

    def _has_room(self, frames: int) -> bool:
        """Room for ``frames`` more; an empty queue takes a batch of copies larger than its size.
        A writer that is gone has none."""
        if self._writer_lost is not None:
            return False
        p = self._progress
        queued = self._frames_sent - p.frames_written - p.frames_failed - p.frames_sampled_out
        return queued == 0 or queued + frames <= self._queue_size

    def _read_progress(self, timeout_ms: int) -> None:
        """Take the writer's latest report, waiting up to ``timeout_ms`` for one; notice if it is gone."""
        while self._progress_socket.poll(timeout_ms):
            self._progress = decode_progress(self._progress_socket.recv())
            timeout_ms = 0
        self._progress_due = time.monotonic() + PROGRESS_WAIT_MS / 1000
        if self._writer_lost is None and (code := self._process.poll()) is not None \
                and not (code == 0 and self._progress.last):  # (one that said its last word ended the session)
            self._writer_lost = f"the writer process exited with {code} while recording"
        if self._writer_lost is None and self._redactor is not None and (code := self._redactor.poll()) not in (
                None, 0):  # (0: it passed the Stop on)
            self._writer_lost = f"the redactor process exited with {code} while recording"

    def _kill_redactor(self) -> None:
        """What the redactor holds cannot reach a writer that is gone (or one it outlived)."""
        if self._redactor is not None and self._redactor.poll() is None:
            self._redactor.kill()
            self._redactor.wait(5)

    def rotate(self) -> None:
        """Begin the next file now (SIGHUP): the writer rotates, so it is told, by its PID."""
        if self._rotating and self._process.poll() is None:
            os.kill(self._process.pid, signal.SIGHUP)

    def statistics(self) -> RecorderStats:
        """The counts so far: what is neither written nor dropped is queued."""
        p = self._progress
        lost = self._frames_dropped + p.frames_failed  # never to be in the database
        done = p.frames_written + p.frames_sampled_out
        queued = 0 if self._writer_lost else self._frames_seen - lost - done
        dropped = self._frames_seen - done - queued
        return RecorderStats(frames_seen=self._frames_seen, frames_recorded=p.frames_written,
                             frames_dropped=dropped, queue_depth_frames=queued,
                             bytes_seen=self._bytes_seen, requests=p.requests, engines_dead=p.engines_dead,
                             frames_undecoded=p.frames_undecoded, error=self._writer_lost or p.write_error,
                             drift_alarms=p.drift_alarms, drift=p.drift, **self._detail(dropped),
                             decode_lag_s=self._decode_lag_s() if queued or p.frames_undecoded else 0.0)

    def _decode_lag_s(self) -> float:
        """While frames wait to be decoded: since the newest decoded one crossed (or the first, if none has)."""
        decoded_s = self._progress.decoded_through_ns / 1e9 or self._first_frame_s
        return max(0.0, time.time() - decoded_s) if decoded_s else 0.0

    def _detail(self, dropped: int, failed: int | None = None) -> dict:
        """What the statistics say beyond the sessions row's counts, from the tap's own counters and the
        writer's last report (``failed``: the frames it could not write, where known better)."""
        p = self._progress
        failed = p.frames_failed if failed is None else failed
        reasons = {"queue_full": self._frames_dropped_queue_full, "write_failed": failed,
                   "late_at_stop": self._frames_dropped_late}
        reasons["writer_lost"] = max(0, dropped - sum(reasons.values()))
        return {"frames_dropped_by_reason": reasons, "frames_undecodable": p.frames_undecodable,
                "bytes_by_link": dict(self._bytes_by_link), "vllm_version": p.vllm_version,
                "writer_lost": self._writer_lost, "frames_sampled_out": p.frames_sampled_out,
                "outputs_sampled_out": p.outputs_sampled_out, "rotations": p.rotations,
                "rotations_failed": p.rotations_failed, "files_deleted": p.files_deleted,
                "db_path": p.db_path or str(self.db_path)}

    def close(self, status: str = "complete", error: str | None = None,
              writer_wait_s: float = WRITER_STOP_S) -> RecorderStats:
        """Pass on everything queued, tell the writer how the session ended, and wait (``writer_wait_s``) for it.

        Stop the relay first: what its forwarders copy after this is not recorded. The writer ends
        the session row itself; if it is gone, the recorder does, from what the database holds. If the
        writer is still at it when the wait ends, the counts returned are not final (``final``): what
        it has not written yet is queued, not dropped.
        """
        self._ending = (status, error)
        self._mine.send_multipart(STOP)  # after every entry already queued
        self._mine.close(linger=-1)
        self._wait_for_tap()
        passed_on = not self._tap_thread.is_alive()  # and the tap has sent the writer its Stop
        if passed_on:  # its sockets are this thread's now
            try:
                self._process.wait(writer_wait_s)
            except subprocess.TimeoutExpired:  # still writing: it ends the session itself, nothing is cut off
                pass
            self._read_progress(0)
            # A writer that has ended sent its last report, with its final counts, as it did: wait for it.
            deadline = time.monotonic() + FINAL_REPORT_WAIT_MS / 1000
            while not self._progress.last and time.monotonic() < deadline:
                self._read_progress(PROGRESS_WAIT_MS)
            for sock in (self._collector, self._progress_socket):
                sock.close(linger=0)
            # A writer still at it takes the rest from its socket (not from this process's queue, which
            # linger=0 would throw away) while this process lives.
            self._tap.close(linger=TAP_LINGER_MS)
        code = self._process.poll()
        if code is None:
            # The sockets' folder stays for the writer, which removes it when it ends: the tap may not have
            # connected yet (ZMQ reconnects every 100 ms), and it could not once the socket's file was gone.
            self.status = "finishing"  # the writer is still at it, in the background
            live = self.statistics()
            return msgspec.structs.replace(live, final=False, error=(
                f"the writer (PID {self._process.pid}) is still writing {live.queue_depth_frames:,} frames; "
                "it ends the session itself"))
        self._kill_redactor()
        shutil.rmtree(self._folder, ignore_errors=True)
        if self._rotating and self._progress.db_path is not None:  # the writer's last report: the file it ended in
            self.db_path, self.session_id = Path(self._progress.db_path), self._progress.session_id
        reserve.release(self.db_path)  # (the writer gave it back to its last transaction, unless it died first)
        db = open_database(self.db_path)
        if code != 0:  # the writer died: the session is ended here, by what is kept
            kept = db.execute("SELECT (SELECT COUNT(*) FROM frames WHERE session_id = :s) + (SELECT "
                              "COALESCE(SUM(frames), 0) FROM undecoded WHERE session_id = :s)",
                              {"s": self.session_id}).fetchone()[0]
            p = self._progress  # (the dead writer's last word: a rotating recording's other files are closed)
            sampled_out = p.frames_sampled_out
            seen = self._frames_seen - p.frames_seen_closed_files
            db["sessions"].update(self.session_id, {
                "ended_at": utc_now(), "status": "incomplete", "frames_recorded": kept,
                "frames_seen": seen, "frames_dropped": seen - kept - sampled_out,
                "bytes_seen": self._bytes_seen,
                "error": error or self._writer_lost or f"the writer process exited with {code}"})
        row = db["sessions"].get(self.session_id)
        # A writer that ended the session itself lost nothing: what the tap did not drop, it could not write.
        def failed(dropped: int) -> int | None:
            tap_dropped = self._frames_dropped_queue_full + self._frames_dropped_late
            return max(0, dropped - tap_dropped) if code == 0 and self._writer_lost is None else None

        dropped = row["frames_dropped"] or 0
        requests = db.execute("SELECT COUNT(*) FROM requests WHERE session_id = ?", [self.session_id]).fetchone()[0]
        alarms = [m for (m,) in db.execute("SELECT message FROM drift_alarms WHERE session_id = ? ORDER BY rowid",
                                           [self.session_id])]
        db.close()
        self.status = row["status"]
        if self._rotating:  # the totals over every file, from the writer's last word and the tap's own
            p = self._progress
            dropped = self._frames_seen - p.frames_written - p.frames_sampled_out
            return RecorderStats(frames_seen=self._frames_seen, frames_recorded=p.frames_written,
                                 frames_dropped=dropped, bytes_seen=self._bytes_seen, requests=p.requests,
                                 engines_dead=p.engines_dead, frames_undecoded=p.frames_undecoded, error=row["error"],
                                 drift_alarms=p.drift_alarms, drift=p.drift, **self._detail(dropped, failed(dropped)))
        return RecorderStats(frames_seen=row["frames_seen"] or 0, frames_recorded=row["frames_recorded"] or 0,
                             frames_dropped=dropped, bytes_seen=row["bytes_seen"] or 0,
                             requests=requests, engines_dead=row["engines_dead"] or 0,
                             frames_undecoded=row["frames_undecoded"] or 0, error=row["error"],
                             drift_alarms=len(alarms), drift=alarms[-1] if alarms else None,
                             **{**self._detail(dropped, failed(dropped)),
                                "frames_sampled_out": row["frames_sampled_out"] or 0,
                                "outputs_sampled_out": row["outputs_sampled_out"] or 0})

    def _wait_for_tap(self) -> None:
        """Until the tap has passed everything on. Dropping, it does within STOP_COPIES_S; blocking, it
        waits for the writer, so this waits as long as the writer gets on (lossless takes what it takes)."""
        self._tap_thread.join(TAP_STOP_S + STOP_COPIES_S)
        while self._block and self._tap_thread.is_alive():
            before = self._progress
            self._tap_thread.join(BLOCK_STALL_S)
            if self._progress == before:
                return
