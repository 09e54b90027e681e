"""What several test modules share: the command line, waiting, a recorded sim session in one nursery, a
frame as the relay reports it, a paused writer, the command that starts sim engines, a sample report, recorded
frames edited in place."""

import contextlib
import json
import os
import shlex
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from replay_proxy.compare.findings import Change, Finding, Report, Severity
from replay_proxy.net.relay import Relay
from replay_proxy.sim.engine import SimEngine
from replay_proxy.sim.frontend import SimFrontend
from replay_proxy.recorder import Recorder, SessionInfo
from replay_proxy.store import raw
from replay_proxy.wire.capture import CapturedFrame
from replay_proxy.wire.encode import encode
from replay_proxy.wire.messages import Channel, Direction

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "replay_proxy"]
ENGINE = [*CLI, "sim", "engine"]


def cli(*args, timeout=60):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def frame(seq, request_id="req-1"):
    """An ABORT as the relay reports it, numbered ``seq`` (the relay numbers what it reports)."""
    return CapturedFrame(seq, time.time_ns(), Channel.INPUT, Direction.TO_ENGINE, 0, 0,
                         [b"\x01", encode([request_id])])


def wait_for(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


@contextlib.contextmanager
def writer_paused(recorder):
    """The recorder's writer process stopped (SIGSTOP, by its PID) inside the block, and continued after
    it whatever happens there: it takes nothing meanwhile, so the queue surely fills."""
    os.kill(recorder.writer.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(recorder.writer.process.pid, signal.SIGCONT)


def engines_command(listen, drift=None, engines=1, release="0.32.0"):
    """A shell command that starts ``engines`` sim engines dialling ``listen``, with ``drift``."""
    drift_args = ["--drift", json.dumps(drift)] if drift else []
    command = " & ".join(shlex.join([*ENGINE, "--handshake", listen, "--index", str(i), "--release", release,
                                     *drift_args]) for i in range(engines))
    return shlex.join(["bash", "-c", f"{command} & wait"])


# A report with a finding of each category and severity, and every part the HTML shows
REPORT = Report(
    title="diff", baseline="a", candidate="b",
    findings=[
        Finding("schema", Severity.BREAKING, "field_inserted", "EngineCoreOutput: inserted at 5",
                struct="EngineCoreOutput", field="finish_reason", position=5, breaks=("python-frontend",)),
        Finding("behaviour", Severity.REGRESSION, "token_mismatch", "tokens diverge at 2", request_id="r1"),
        Finding("behaviour", Severity.WARNING, "abort_progress", "aborted later", request_id="r2"),
        Finding("performance", Severity.REGRESSION, "itl_regression", "itl_ms.p50 10 -> 12 ms: +20.0%",
                field="itl_ms.p50", baseline=10.0, candidate=12.0,
                change=Change(relative=0.2, low=0.12, high=0.29, minimum_detectable=0.08, paired=True,
                              samples=(40, 40))),
        Finding("performance", Severity.INFO, "ttft_no_change", "ttft_ms.p50 5 -> 5.1 ms: +2.0%",
                field="ttft_ms.p50", baseline=5.0, candidate=5.1,
                change=Change(relative=0.02, low=-0.04, high=0.08, minimum_detectable=0.11, paired=True,
                              samples=(8, 8))),
    ],
    samples={"ttft_ms": {"baseline": [1.0, 2.0, 3.0], "candidate": [2.0, 4.0]}},
    schemas={"EngineCoreOutput": {"baseline": ["0 request_id: str"], "candidate": ["0 request_id: str", "1 x: int"]}},
    checks=["schema:EngineCoreOutput", "behaviour:r1", "behaviour:r2", "behaviour:r3", "performance:itl_ms.p50",
            "performance:ttft_ms.p50", "performance:e2e_ms.p50"],
    performance_threshold=0.05,
)


class RecordedSession:
    """Sim frontend <-> relay (recording) <-> sim engines, in one nursery."""

    def __init__(self, nursery, db, engines=1, api_servers=1, engine_drift=None, frontend_drift=None,
                 name="test", coordinator=False, record_coordinator=False, frontend_release="0.32.0",
                 engine_release="0.32.0", **recorder_options):
        self.nursery, self.db, self.name = nursery, db, name
        self.frontend_release, self.engine_release = frontend_release, engine_release
        self.n_engines, self.api_servers = engines, api_servers
        self.engine_drift, self.frontend_drift = engine_drift, frontend_drift
        self.coordinator, self.record_coordinator = coordinator, record_coordinator
        self.recorder_options = recorder_options  # on_full, queue_size

    async def start(self):
        kwargs = {"drift": self.frontend_drift} if self.frontend_drift else {}
        self.frontend = SimFrontend(engines=self.n_engines, api_servers=self.api_servers,
                                    coordinator=self.coordinator, release=self.frontend_release, **kwargs)
        upstream = await self.nursery.start(self.frontend.run)
        self.recorder = Recorder(self.db, SessionInfo(name=self.name, upstream=upstream), **self.recorder_options)
        self.relay = Relay("tcp://127.0.0.1:0", upstream, self.recorder, record_coordinator=self.record_coordinator)
        self.nursery.start_soon(self.relay.run)
        await self.relay.listening.wait()
        kwargs = {"drift": self.engine_drift} if self.engine_drift else {}
        self.engines = [SimEngine(self.relay.listen, i, release=self.engine_release, **kwargs)
                        for i in range(self.n_engines)]
        for engine in self.engines:
            self.nursery.start_soon(engine.run)
        await self.frontend.ready.wait()
        return self


def edit_frames(path, where, change):
    """Every frame of the recording at ``path`` that ``where`` selects (SQL over ``frames``) given the parts that
    ``change`` makes of its parts, in place, where its bytes are (its batch, or ``frames.raw`` in a file of layout 3):
    a recording as if a peer had sent otherwise."""
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        chosen = {(row["session_id"], row["seq"]): change(row["parts"]) for row in raw.frames_with_bytes(db, where)}
        if "raw" in {column[1] for column in db.execute("PRAGMA table_info(frames)")}:
            for (session_id, seq), parts in chosen.items():
                db.execute("UPDATE frames SET raw = ? WHERE session_id = ? AND seq = ? AND raw IS NOT NULL",
                           [msgspec.msgpack.encode(parts), session_id, seq])
        for session_id, first_seq, frames, data in db.execute("SELECT session_id, first_seq, frames, data "
                                                              "FROM frame_batches").fetchall():
            held = raw.unpack(frames, data)
            if any((session_id, f.seq) in chosen for f in held):
                batch = raw.pack(session_id, [f.seq for f in held], [
                    raw.item(f.seq, chosen.get((session_id, f.seq), f.parts), f.forwarded) for f in held])
                db.execute("UPDATE frame_batches SET data = ? WHERE session_id = ? AND first_seq = ?",
                           [batch.data, session_id, first_seq])
