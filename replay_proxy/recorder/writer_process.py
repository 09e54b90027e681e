"""The proxy's side of the recorder's processes: the writer (``writer_loop.py``) and, recording redacted, the
redactor before it (``redactor.py``). Started, heard from (their ``Progress``), noticed gone, told to
rotate, stopped.

The writer runs as SCHED_IDLE: only on a core nothing else wants, so under load the engine's and the
forwarders' work comes first; it decodes live while there is CPU to spare, and keeps (then decodes) what
waits when there is not. (On this project's 2 shared cores, any work beside the forwarders costs
round-trip p99, whatever its priority: docs/performance.md.) Both run in a session of their own: the
SIGINT or SIGTERM that stops the proxy's process group must not cut their work short.

One thread at a time uses a ``WriterProcess``: the tap's while it runs (``tap.py``), then the one that
closes the recorder.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import zmq

from replay_proxy.redact.settings import RedactionSettings
from replay_proxy.recorder.protocol import Progress, RedactorStart, Stop, WriterStart, decode_progress, stop_message
from replay_proxy.recorder.rotation import RotationSettings
from replay_proxy.store.sample import RequestSample

PROGRESS_WAIT_MS = 100  # how stale the view of the writer's progress may get while no frames come
START_TIMEOUT_S = 60.0
LINGER_MS = 1000  # what was sent a writer that is still busy goes on to it this long, in the background


def _start(module: str, start: WriterStart | RedactorStart) -> subprocess.Popen[bytes]:
    """One of the recorder's processes, started with its ``start`` (JSON, its one argument), SCHED_IDLE."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, msgspec.json.encode(start).decode()], stdin=subprocess.DEVNULL,
        start_new_session=True)
    os.sched_setscheduler(process.pid, os.SCHED_IDLE, os.sched_param(0))
    return process


class WriterProcess:
    """The writer process for one session (``process``), and the redactor before it (``redactor``), if any:
    ``tap_address`` is where the tap sends, ``progress`` the writer's latest report, ``lost`` why either
    process is gone, if one is."""

    def __init__(self, db_path: Path, session_id: int, folder: str, context: zmq.Context[zmq.Socket[bytes]], *,
                 queue_size: int, max_db_bytes: int | None, redaction: RedactionSettings | None,
                 sample: RequestSample | None, rotation: RotationSettings | None):
        self.tap_address = f"ipc://{folder}/tap"
        progress = f"ipc://{folder}/progress"
        # Counts are cumulative, so only the newest report matters (each read drains the queue). Not
        # conflating: a conflating PULL drops what a peer that has just closed sent last.
        self._progress_socket = context.socket(zmq.PULL)
        self._progress_socket.bind(progress)
        self.progress = Progress()
        self.lost: str | None = None
        self.rotating = rotation is not None
        self._context = context
        self._progress_due = 0.0  # when the progress is read next
        # Redacting, the tap's messages go through the redactor process on their way to the writer.
        self._writer_address = self.tap_address if redaction is None else f"ipc://{folder}/redacted"
        self.redactor = None if redaction is None else _start(
            "replay_proxy.recorder.redactor", RedactorStart(self.tap_address, self._writer_address, os.getpid(),
                                                         redaction))
        self.process = _start("replay_proxy.recorder.writer_loop", WriterStart(
            str(db_path), session_id, self._writer_address, progress, parent_pid=os.getpid(),
            hold_frames=max(1, queue_size // 2), sockets_folder=folder, max_bytes=max_db_bytes,
            upstream_pid=self.redactor.pid if self.redactor else None, sample=sample, rotation=rotation))

    def started(self) -> bool:
        """Wait for its first report, which says it has started (its start takes a CPU for a while: better
        before the relay opens than while the first frames pass); False if it exits or never reports."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._progress_socket.poll(PROGRESS_WAIT_MS):
            if self.process.poll() is not None or time.monotonic() > deadline:
                return False
        return True

    def read_progress(self, timeout_ms: int = 0) -> None:
        """Take the writer's latest report, waiting up to ``timeout_ms`` for one; notice if it is gone."""
        while self._progress_socket.poll(timeout_ms):
            self.progress = decode_progress(self._progress_socket.recv())
            timeout_ms = 0
        self._progress_due = time.monotonic() + PROGRESS_WAIT_MS / 1000
        if self.lost is None and (code := self.process.poll()) is not None \
                and not (code == 0 and self.progress.last):  # (one that said its last word ended the session)
            self.lost = f"the writer process exited with {code} while recording"
        if self.lost is None and self.redactor is not None and (code := self.redactor.poll()) not in (
                None, 0):  # (0: it passed the Stop on)
            self.lost = f"the redactor process exited with {code} while recording"

    def progress_due(self) -> bool:
        return time.monotonic() >= self._progress_due

    def final_report(self, wait_s: float, report_wait_ms: int) -> int | None:
        """Wait ``wait_s`` for the writer to end, then ``report_wait_ms`` more for its last report (sent as it
        ends, with its final counts); its exit code, or None while it still writes. The code is taken before
        the last read, so that the report read is never older than the exit: one that exits later still writes."""
        try:
            self.process.wait(wait_s)
        except subprocess.TimeoutExpired:  # still writing: it ends the session itself, nothing is cut off
            pass
        deadline = time.monotonic() + report_wait_ms / 1000
        code = self.process.poll()
        self.read_progress()
        while not self.progress.last and time.monotonic() < deadline:
            code = self.process.poll()
            self.read_progress(PROGRESS_WAIT_MS)
        self._progress_socket.close(linger=0)
        return code

    def stop_directly(self, stop: Stop) -> None:
        """Past a redactor that is gone: the writer binds the address, so a second sender may connect."""
        if self.process.poll() is not None:
            return
        with self._context.socket(zmq.PUSH) as direct:
            direct.setsockopt(zmq.LINGER, LINGER_MS)
            direct.connect(self._writer_address)
            direct.send_multipart(stop_message(stop))

    def rotate(self) -> None:
        """Begin the next file now (SIGHUP): the writer rotates, so it is told, by its PID."""
        if self.rotating and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGHUP)

    def kill_redactor(self) -> None:
        """What the redactor holds cannot reach a writer that is gone (or one it outlived)."""
        if self.redactor is not None and self.redactor.poll() is None:
            self.redactor.kill()
            self.redactor.wait(5)

    def kill(self) -> int:
        """Both processes, by their PIDs (a writer that never started); the writer's exit code."""
        self.kill_redactor()
        self.process.kill()
        self._progress_socket.close(linger=0)
        return self.process.wait(5)
