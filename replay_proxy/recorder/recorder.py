"""The recorder: what the relay reports, recorded, and every frame accounted for once.

Theory of operation: decoding and SQLite writing happen in a separate *process*, so they never hold the
proxy's GIL (measured: a writer thread in the proxy process made its p99 round trip several milliseconds,
one GIL switch interval). A recording has three parts, one per thread of control:

* the tap (``tap.py``), a thread of the proxy's: it takes the relay's copies, counts them, and passes
  them on in batches, or drops them at a full queue;
* the writer process (``writer_process.py`` starts and watches it, ``writer_loop.py`` is its code), and,
  recording with ``--redact-key``, the redactor process before it (``redactor.py``);
* this ``Recorder``, the relay's ``Observer``: it begins the session's row, puts the tap's and the
  writer's counts together (``counts.py``), and ends the session with them.
"""

from __future__ import annotations

import enum
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Literal

import msgspec
import zmq

from replay_proxy import __version__
from replay_proxy.clock import utc_now
from replay_proxy.errors import ReplayProxyError
from replay_proxy.redact.settings import Redaction, RedactionSettings
from replay_proxy.store.counts import FrameCounts, TapCounts, WriterCounts, dropped_by_reason
from replay_proxy.recorder.protocol import Progress
from replay_proxy.recorder.rotation import RotationSettings
from replay_proxy.store.sample import RequestSample
from replay_proxy.store.tables import begin_session, end_session, ended_session, frames_kept
from replay_proxy.recorder.tap import Tap
from replay_proxy.recorder.writer_process import WriterProcess
from replay_proxy.wire.capture import CapturedFrame, EngineLoss

# record ends within 5 s: the tap passes what it holds soon after STOP (``tap.py``), and the writer decodes
# for 2 s at most after STOP, then keeps the rest and exits (else it ends the session itself, in the
# background).
WRITER_STOP_S = 3.5
FINAL_REPORT_WAIT_MS = 1000  # for the writer's last report (sent after the session's end) beyond WRITER_STOP_S


class OnFull(enum.StrEnum):
    """What the tap does when the writer's queue is full."""

    DROP = "drop"  # count the frame as dropped from the recording (it was forwarded all the same)
    BLOCK = "block"  # wait for the writer: lossless, at the cost of latency


class RecorderError(ReplayProxyError):
    """The writer process failed or did not finish in time."""


class RecorderStats(WriterCounts, kw_only=True, array_like=False):
    """The counts of the status line, the summary, the ``sessions`` row, the JSON log and the metrics:
    seen = recorded + sampled out + dropped + queued, on every path. The writer's counts are its own fields
    (``WriterCounts``: frames recorded, failed, undecoded, undecodable, sampled out; requests, engines dead,
    drift alarms); the rest are the tap's, the recorder's and the rotation's."""

    frames_seen: int  # forwarded
    frames_dropped: int  # will never be in it: dropped at a full queue, or not written (a full disk)
    queue_depth_frames: int = 0  # on their way to the database
    bytes_seen: int
    error: str | None = None  # the writer's last write error, or its death
    drift: str | None = None  # the newest drift alarm
    final: bool = True  # False while the writer still writes: the frames queued are not counted yet
    # frames_dropped by why (counts.dropped_by_reason)
    frames_dropped_by_reason: dict[str, int] = msgspec.field(default_factory=dict)
    decode_lag_s: float = 0.0  # while frames wait to be decoded: how long ago the newest decoded one crossed
    bytes_by_link: dict[tuple[str, str], int] = msgspec.field(default_factory=dict)  # (channel, direction)
    vllm_version: str | None = None  # as the engines announced it
    writer_lost: str | None = None  # why the writer (or the redactor) is gone, if it is
    rotations: int = 0  # files begun after the first (--rotate-mb, --rotate-every, SIGHUP)
    rotations_failed: int = 0  # tried and failed (no space, no permission): tried again later
    files_deleted: int = 0  # by --keep and --max-total-gb
    db_path: str | None = None  # the file being written

    def frames(self) -> FrameCounts:
        return FrameCounts(self.frames_seen, self.frames_recorded, self.frames_sampled_out, self.frames_dropped,
                           self.queue_depth_frames)


class SessionInfo(msgspec.Struct, frozen=True):
    name: str
    mode: Literal["record", "replay"] = "record"
    listen: str | None = None
    upstream: str | None = None
    baseline_session_id: int | None = None
    frontend_release: str | None = None  # what the frontend writes as, where the user knows it (else found)
    frontend_source: str | None = None
    frontend_name: str | None = None  # which frontend, where the user says (record --frontend smg==1.13.0)
    frontend_version: str | None = None
    # Which proxy of a fleet recorded it: the machine, and the proxy on it (record --instance), the partitions of
    # export's dataset (store/export.py).
    proxy_host: str = msgspec.field(default_factory=socket.gethostname)
    proxy_instance: str | None = None


class Recorder:
    """Records one session; an ``Observer`` for the relay (and for the replay players).

    Its own fields are set at the start and by ``close`` (the thread that made it); ``statistics`` may be
    called from any thread (the status line's, the metrics server's); the tap's and the writer process's
    fields are theirs (``tap.py``)."""

    def __init__(self, db_path: str | Path, session: SessionInfo, *, on_full: OnFull = OnFull.DROP,
                 queue_size: int = 100_000, max_db_bytes: int | None = None,
                 redaction: RedactionSettings | None = None, sample: RequestSample | None = None,
                 rotation: RotationSettings | None = None, context: zmq.Context[zmq.Socket[bytes]] | None = None):
        self.db_path = Path(db_path)
        row = {**msgspec.to_builtins(session), "started_at": utc_now(), "status": "recording",
               "proxy_version": __version__, "frames_seen": 0, "frames_recorded": 0, "frames_dropped": 0}
        if redaction is not None:  # loaded here too: a bad key or policy fails before anything starts
            row = Redaction(redaction).session_row(row)
        if sample is not None:
            row.update(sample_requests=sample.fraction, sample_seed=sample.seed, frames_sampled_out=0,
                       outputs_sampled_out=0)
        self.session_id, _ = begin_session(self.db_path, row)  # (without room held, its end is written if it can be)
        context = context or zmq.Context.instance()
        self._folder = tempfile.mkdtemp(prefix="replay-proxy-")  # the processes' sockets
        self.writer = WriterProcess(self.db_path, self.session_id, self._folder, context, queue_size=queue_size,
                                    max_db_bytes=max_db_bytes, redaction=redaction, sample=sample, rotation=rotation)
        self._tap = Tap(context, self.writer, queue_size=queue_size, block=OnFull(on_full) is OnFull.BLOCK)
        self.capture, self.capture_hwm = self._tap.capture, self._tap.capture_hwm
        if not self.writer.started():
            self._give_up_starting()
        self._tap.start()
        self.status = "recording"

    def _give_up_starting(self) -> None:
        self._tap.close(linger_ms=0)
        error = f"the writer process did not start (exit code {self.writer.kill()})"
        shutil.rmtree(self._folder, ignore_errors=True)
        end_session(self.db_path, self.session_id, status="failed", error=error)
        raise RecorderError(error)

    # --- called by the relay's thread ------------------------------------------------------

    def frame(self, frame: CapturedFrame) -> None:
        self._tap.frame(frame)

    def engine_lost(self, loss: EngineLoss) -> None:
        self._tap.engine_lost(loss)

    def relay_stopped(self, last_seq: int) -> None:
        self._tap.relay_stopped(last_seq)

    # --- by anyone ------------------------------------------------------------------------

    def rotate(self) -> None:
        """Begin the next file now (SIGHUP)."""
        self.writer.rotate()

    def statistics(self) -> RecorderStats:
        """The counts so far: what is neither written nor dropped is queued."""
        tap, p, lost = self._tap.counts, self.writer.progress, self.writer.lost
        counts = FrameCounts.live(tap.frames_seen, p.counts.frames_recorded, p.counts.frames_sampled_out,
                                  tap.frames_dropped + p.counts.frames_failed, lost is not None)
        return recorder_stats(counts, tap, p, write_failed=p.counts.frames_failed, error=lost or p.write_error,
                              writer_lost=lost, db_path=str(self.db_path), decode_lag_s=self._decode_lag_s()
                              if counts.queued or p.counts.frames_undecoded else 0.0)

    def _decode_lag_s(self) -> float:
        """While frames wait to be decoded: since the newest decoded one crossed (or the first, if none has)."""
        decoded_s = self.writer.progress.decoded_through_ns / 1e9 or self._tap.first_frame_s
        return max(0.0, time.time() - decoded_s) if decoded_s else 0.0

    # --- the end ------------------------------------------------------------------------------

    def close(self, status: str = "complete", error: str | None = None,
              writer_wait_s: float = WRITER_STOP_S) -> RecorderStats:
        """Pass on everything queued, tell the writer how the session ended, and wait (``writer_wait_s``) for it.

        Stop the relay first: what its forwarders copy after this is not recorded. The writer ends
        the session row itself; if it is gone, the recorder does, from what the database holds. If the
        writer is still at it when the wait ends, the counts returned are not final (``final``): what
        it has not written yet is queued, not dropped.
        """
        # The exit code that goes with the report last read: a writer that exits after its report was given up
        # on is still writing as far as this close knows (its report would name a file retention deleted since).
        code = self.writer.process.poll()
        if self._tap.stop(status, error):  # the tap's sockets, and the writer's progress, are this thread's now
            code = self.writer.final_report(writer_wait_s, FINAL_REPORT_WAIT_MS)
            self._tap.close()
        if code is None:
            # The sockets' folder stays for the writer, which removes it when it ends: the tap may not have
            # connected yet (ZMQ reconnects every 100 ms), and it could not once the socket's file was gone.
            self.status = "finishing"  # the writer is still at it, in the background
            live = self.statistics()
            return msgspec.structs.replace(live, final=False, error=(
                f"the writer (PID {self.writer.process.pid}) is still writing {live.queue_depth_frames:,} frames; "
                "it ends the session itself"))
        self.writer.kill_redactor()
        shutil.rmtree(self._folder, ignore_errors=True)
        p, tap = self.writer.progress, self._tap.counts
        if self.writer.rotating and p.db_path is not None and p.session_id is not None:  # the file it ended in
            self.db_path, self.session_id = Path(p.db_path), p.session_id
        if code != 0:
            self._end_for_a_dead_writer(code, error)
        row, requests, alarms = ended_session(self.db_path, self.session_id)
        self.status = row["status"]
        if self.writer.rotating:  # the totals over every file, from the writer's last word and the tap's own
            counts = FrameCounts.ended(tap.frames_seen, p.counts.frames_recorded, p.counts.frames_sampled_out)
            progress = p
        else:  # as the session's row says, whoever ended it (a writer that died wrote no counts of its own)
            counts = FrameCounts(row["frames_seen"] or 0, row["frames_recorded"] or 0, row["frames_sampled_out"] or 0,
                                 row["frames_dropped"] or 0)
            written = {name: getattr(p.counts, name) if row[name] is None else row[name]
                       for name in WriterCounts.__struct_fields__}
            progress = msgspec.structs.replace(p, counts=WriterCounts(**{
                **written, "requests": requests, "drift_alarms": len(alarms)}), drift=alarms[-1] if alarms else None)
        # A writer that ended the session itself lost nothing: what the tap did not drop, it could not write.
        write_failed = max(0, counts.dropped - tap.dropped_queue_full - tap.dropped_late) \
            if code == 0 and self.writer.lost is None else p.counts.frames_failed
        return recorder_stats(counts, tap, progress, write_failed=write_failed, error=row["error"],
                              writer_lost=self.writer.lost, db_path=str(self.db_path))

    def _end_for_a_dead_writer(self, code: int, error: str | None) -> None:
        """The session ended by what its file holds (a rotating recording's other files were closed)."""
        kept = frames_kept(self.db_path, self.session_id)
        p, tap = self.writer.progress, self._tap.counts  # (the dead writer's last word)
        end_session(self.db_path, self.session_id, status="incomplete",
                    error=error or self.writer.lost or f"the writer process exited with {code}",
                    counts=FrameCounts.ended(tap.frames_seen - p.frames_seen_closed_files, kept,
                                             p.counts.frames_sampled_out), bytes_seen=tap.bytes_seen)


def recorder_stats(counts: FrameCounts, tap: TapCounts, progress: Progress, *, write_failed: int,
                   error: str | None, writer_lost: str | None, db_path: str, decode_lag_s: float = 0.0
                   ) -> RecorderStats:
    """The statistics, from where each frame is (``counts``), the tap's own counts and the writer's report."""
    p = progress
    return RecorderStats(
        **{**msgspec.structs.asdict(p.counts), "frames_recorded": counts.recorded,
           "frames_sampled_out": counts.sampled_out},
        frames_seen=counts.seen, frames_dropped=counts.dropped, queue_depth_frames=counts.queued,
        bytes_seen=tap.bytes_seen, frames_dropped_by_reason=dropped_by_reason(counts.dropped, tap, write_failed),
        bytes_by_link=dict(tap.bytes_by_link), error=error, drift=p.drift, decode_lag_s=decode_lag_s,
        vllm_version=p.vllm_version, writer_lost=writer_lost, rotations=p.rotations,
        rotations_failed=p.rotations_failed, files_deleted=p.files_deleted, db_path=p.db_path or db_path)
