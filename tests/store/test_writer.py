"""The recorder's bounded queue: drops are counted, never silent; 'block' loses nothing."""

import sqlite_utils

from replay_proxy.net.relay import FrameEvent
from replay_proxy.store.writer import Recorder, SessionInfo
from replay_proxy.wire.encode import encode
from replay_proxy.wire.messages import Channel, Direction

FRAME = FrameEvent(1, Channel.INPUT, Direction.TO_ENGINE, 0, 0, [b"\x01", encode(["req-1"])])


def record_burst(db_path, on_full, frames=3000):
    recorder = Recorder(db_path, SessionInfo(name=on_full), on_full=on_full, queue_size=2)
    for _ in range(frames):
        recorder.frame(FRAME)
    return recorder, recorder.close()


def test_a_full_queue_drops_and_counts(db_path):
    recorder, stats = record_burst(db_path, "drop")
    assert stats.frames_seen == 3000
    assert stats.frames_dropped > 0
    assert stats.frames_recorded + stats.frames_dropped == 3000
    db = sqlite_utils.Database(db_path)
    assert db["frames"].count == stats.frames_recorded
    row = db["sessions"].get(recorder.session_id)
    assert (row["frames_dropped"], row["frames_recorded"], row["status"]) == (
        stats.frames_dropped, stats.frames_recorded, "complete")


def test_block_policy_records_everything(db_path):
    recorder, stats = record_burst(db_path, "block")
    assert (stats.frames_seen, stats.frames_recorded, stats.frames_dropped) == (3000, 3000, 0)
    assert sqlite_utils.Database(db_path)["aborts"].count == 3000
