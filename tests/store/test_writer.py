"""The recorder's bounded queue: drops are counted, never silent; 'block' loses nothing."""

import sys
import time
from pathlib import Path

import pytest
import sqlite_utils

from replay_proxy.store.recorder import Recorder, RecorderError, SessionInfo
from replay_proxy.wire.capture import CapturedFrame, EngineLoss
from replay_proxy.wire.encode import encode
from replay_proxy.wire.messages import Channel, Direction



def frame(seq):
    """An ABORT as the relay reports it, numbered ``seq`` (the relay numbers what it reports)."""
    return CapturedFrame(seq, time.time_ns(), Channel.INPUT, Direction.TO_ENGINE, 0, 0, [b"\x01", encode(["req-1"])])


def record_burst(db_path, on_full, frames=3000):
    recorder = Recorder(db_path, SessionInfo(name=on_full), on_full=on_full, queue_size=2)
    for seq in range(1, frames + 1):
        recorder.frame(frame(seq))
    return recorder, recorder.close()


def test_a_full_queue_drops_and_counts(db_path):
    recorder, stats = record_burst(db_path, "drop")
    assert stats.frames_seen == 3000
    assert stats.frames_dropped > 0
    assert stats.frames_recorded + stats.frames_dropped == 3000
    db = sqlite_utils.Database(db_path)
    numbers = [r["seq"] for r in db.query("SELECT seq FROM frames ORDER BY seq")]
    assert len(numbers) == len(set(numbers)) == stats.frames_recorded
    assert set(numbers) <= set(range(1, 3001))  # numbered as passed: a dropped frame leaves a gap
    row = db["sessions"].get(recorder.session_id)
    assert (row["frames_dropped"], row["frames_recorded"], row["status"], row["mode"]) == (
        stats.frames_dropped, stats.frames_recorded, "complete", "record")


def test_block_policy_records_everything(db_path):
    recorder, stats = record_burst(db_path, "block")
    assert (stats.frames_seen, stats.frames_recorded, stats.frames_dropped) == (3000, 3000, 0)
    assert sqlite_utils.Database(db_path)["aborts"].count == 3000


def test_the_writer_finishes_when_the_proxy_dies_without_stop(tmp_path):
    """A SIGKILLed proxy sends no STOP: the writer notices its new parent and exits, keeping what it had."""
    import subprocess

    script = (
        "import os, sys, time\n"
        "from replay_proxy.store.recorder import Recorder, SessionInfo\n"
        "from tests.store.test_writer import frame\n"
        "r = Recorder(sys.argv[1], SessionInfo(name='killed'))\n"
        "[r.frame(frame(seq)) for seq in range(1, 51)]\n"
        "while r.statistics().frames_recorded < 50: time.sleep(0.05)\n"
        "print(r._process.pid, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    db = tmp_path / "r.db"
    proxy = subprocess.run([sys.executable, "-c", script, str(db)], capture_output=True, text=True, timeout=60,
                           cwd=Path(__file__).resolve().parents[2])
    writer = int(proxy.stdout.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and Path(f"/proc/{writer}").exists() and \
            "Z" not in Path(f"/proc/{writer}/stat").read_text().split()[2]:
        time.sleep(0.2)
    assert not Path(f"/proc/{writer}").exists() or "Z" in Path(f"/proc/{writer}/stat").read_text().split()[2]
    assert sqlite_utils.Database(db)["aborts"].count == 50


def test_a_writer_that_cannot_start_fails_the_session_with_a_clear_error(db_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the writer process exits at once
    with pytest.raises(RecorderError, match="did not start"):
        Recorder(db_path, SessionInfo(name="doomed"))
    row = next(sqlite_utils.Database(db_path).query("SELECT status, error FROM sessions"))
    assert row["status"] == "failed" and "exit code 1" in row["error"]


def test_kept_frames_are_decoded_once_the_traffic_pauses_while_the_session_is_live(db_path):
    recorder = Recorder(db_path, SessionInfo(name="live"))
    for seq in range(1, 11):
        recorder.frame(frame(seq))
    db = sqlite_utils.Database(db_path)
    deadline = time.monotonic() + 20
    while db["frames"].count < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r["kind"] for r in db.query("SELECT kind FROM frames ORDER BY seq")] == ["ABORT"] * 10
    assert db["undecoded"].count == 0  # each kept batch is deleted as it is decoded
    stats = recorder.close()
    assert (stats.frames_recorded, db["aborts"].count, db["undecoded"].count) == (10, 10, 0)


def test_a_full_queue_drops_frames_but_never_an_engine_loss(db_path):
    recorder = Recorder(db_path, SessionInfo(name="losses"), queue_size=2)
    for i in range(1000):
        recorder.frame(frame(2 * i + 1))
        recorder.engine_lost(EngineLoss(2 * i + 2, time.time_ns(), i, "gone"))
    stats = recorder.close()
    assert stats.frames_dropped > 0
    db = sqlite_utils.Database(db_path)
    assert db["engine_events"].count == 1000
    assert stats.engines_dead == 1000


def test_a_writer_can_be_given_a_lower_priority_and_still_records_everything(db_path):
    import os

    recorder = Recorder(db_path, SessionInfo(name="yielding"), writer_niceness=10)
    assert os.getpriority(os.PRIO_PROCESS, recorder._process.pid) == 10
    for seq in range(1, 101):
        recorder.frame(frame(seq))
    assert recorder.close().frames_recorded == 100
