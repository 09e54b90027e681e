"""The recorder and its writer: drops are counted, never silent; 'block' loses nothing; a full disk,
a dead proxy and a dead writer each end the session with exact counts; recording resumes when space
comes back; kept frames are decoded later."""

import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import sqlite_utils
import zmq

from replay_proxy.record.metrics import health
from replay_proxy.recorder.recorder import Recorder, RecorderError, SessionInfo
from replay_proxy.store.session import SessionError, decode_and_load, load_session
from replay_proxy.store.tables import open_database
from replay_proxy.store.progress import Stop
from replay_proxy.store.writer import SQLITE_STEPS_PER_YIELD, Writer
from replay_proxy.wire.capture import RELAY, capture_tag, EngineLoss, encode_entries, relay_entry
from replay_proxy.wire.encode import encode
from replay_proxy.wire.messages import Channel
from tests.helpers import frame, wait_for, writer_paused




def kept_in_the_database(db_path, session_id):
    """Frames of the session in the database: decoded ones, and those kept undecoded."""
    return next(sqlite_utils.Database(db_path).query(
        "SELECT (SELECT COUNT(*) FROM frames WHERE session_id = :s) "
        "+ (SELECT COALESCE(SUM(frames), 0) FROM undecoded WHERE session_id = :s) AS n", {"s": session_id}))["n"]



def record_burst(db_path, on_full, frames=3000):
    """``frames`` ABORTs through a recorder whose queue holds 2, its writer paused until they are in."""
    recorder = Recorder(db_path, SessionInfo(name=on_full), on_full=on_full, queue_size=2)
    with writer_paused(recorder):
        for seq in range(1, frames + 1):
            recorder.frame(frame(seq))
        # dropping, the tap takes every frame; blocking, it waits at a full queue
        full = (lambda s: s.frames_seen == frames) if on_full == "drop" else (lambda s: s.queue_depth_frames >= 2)
        assert wait_for(lambda: full(recorder.statistics()))
    return recorder, recorder.close()


def test_decode_lag_counts_while_frames_wait_and_is_zero_once_they_are_decoded(db_path):
    recorder = Recorder(db_path, SessionInfo(name="lag"))
    with writer_paused(recorder):
        for seq in range(1, 101):
            recorder.frame(frame(seq))
        assert wait_for(lambda: recorder.statistics().frames_seen == 100)
        # None decoded yet: the lag is the time since the first frame came, whatever this machine's speed.
        first_frame_s = recorder._tap.first_frame_s
        before = time.time()
        lag_s = recorder.statistics().decode_lag_s
        assert before - first_frame_s <= lag_s <= time.time() - first_frame_s
    assert wait_for(lambda: recorder.statistics().frames_recorded == 100)
    assert recorder.statistics().decode_lag_s == 0  # (/metrics: replay_proxy_decode_lag_seconds)
    recorder.close()


def test_a_full_queue_drops_and_counts(db_path):
    recorder, stats = record_burst(db_path, "drop")
    assert stats.frames_seen == 3000
    assert 2998 <= stats.frames_dropped < 3000  # the writer took nothing while they came: all but a batch
    assert stats.frames_recorded + stats.frames_dropped == 3000 and stats.frames().balanced()
    db = sqlite_utils.Database(db_path)
    numbers = [r["seq"] for r in db.query("SELECT seq FROM frames ORDER BY seq")]
    assert len(numbers) == len(set(numbers)) == stats.frames_recorded
    assert set(numbers) <= set(range(1, 3001))  # numbered as passed: a dropped frame leaves a gap
    row = db["sessions"].get(recorder.session_id)
    assert (row["frames_dropped"], row["frames_recorded"], row["status"], row["mode"]) == (
        stats.frames_dropped, stats.frames_recorded, "complete", "record")


def test_block_policy_records_everything(db_path):
    recorder, stats = record_burst(db_path, "block")
    assert (stats.frames_seen, stats.frames_recorded, stats.frames_dropped, stats.final) == (3000, 3000, 0, True)
    assert sqlite_utils.Database(db_path)["aborts"].count == 3000


def test_a_stop_that_ends_before_the_writer_calls_nothing_still_being_written_dropped(db_path, monkeypatch):
    """Close waits for the writer a bounded time; what the writer has not written by then is queued,
    and the counts say they are not final, until the writer ends the session with the real ones."""
    monkeypatch.setattr("replay_proxy.recorder.recorder.WRITER_STOP_S", 0.0)
    recorder = Recorder(db_path, SessionInfo(name="slow writer"))
    with writer_paused(recorder):  # it writes nothing until close has returned
        for seq in range(1, 5001):
            recorder.frame(frame(seq))
        stats = recorder.close()
    assert (recorder.status, stats.final, stats.frames_seen, stats.frames_dropped) == ("finishing", False, 5000, 0)
    assert stats.frames_recorded + stats.queue_depth_frames == 5000 and stats.queue_depth_frames > 0
    assert stats.frames().balanced()
    assert "still writing" in stats.error
    recorder.writer.process.wait(60)
    row = sqlite_utils.Database(db_path)["sessions"].get(recorder.session_id)
    assert (row["status"], row["frames_seen"], row["frames_recorded"], row["frames_dropped"]) == (
        "complete", 5000, 5000, 0)


def test_the_writer_finishes_when_the_proxy_dies_without_stop(tmp_path):
    """A SIGKILLed proxy sends no STOP: the writer notices its new parent and exits, keeping what it had."""
    import subprocess

    script = (
        "import os, sys, time\n"
        "from replay_proxy.recorder.recorder import Recorder, SessionInfo\n"
        "from tests.helpers import frame\n"
        "r = Recorder(sys.argv[1], SessionInfo(name='killed'))\n"
        "[r.frame(frame(seq)) for seq in range(1, 51)]\n"
        "while r.statistics().frames_recorded < 50: time.sleep(0.05)\n"
        "print(r.writer.process.pid, flush=True)\n"
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
    row = sqlite_utils.Database(db)["sessions"].get(1)
    assert (row["status"], row["frames_seen"], row["frames_recorded"], row["frames_dropped"]) == (
        "interrupted", 50, 50, 0)
    assert "without stopping" in row["error"] and row["ended_at"]


def test_a_writer_that_cannot_start_fails_the_session_with_a_clear_error(db_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the writer process exits at once
    with pytest.raises(RecorderError, match="did not start"):
        Recorder(db_path, SessionInfo(name="doomed"))
    row = next(sqlite_utils.Database(db_path).query("SELECT status, error FROM sessions"))
    assert row["status"] == "failed" and "exit code 1" in row["error"]


def test_frames_are_decoded_while_the_traffic_never_pauses(db_path):
    recorder = Recorder(db_path, SessionInfo(name="live"))
    db = sqlite_utils.Database(db_path)
    sent, in_tables = 0, 0
    # A frame every millisecond or so, without a pause, until the tables hold some (bounded in frames,
    # not in time: how soon they do is this machine's speed); then as many again, still without a pause.
    while in_tables == 0 and sent < 60_000:
        sent += 1
        recorder.frame(frame(sent))
        if sent % 200 == 0:
            in_tables = db["frames"].count
        time.sleep(0.001)
    decoded_while_sending = sent
    for _ in range(decoded_while_sending):
        sent += 1
        recorder.frame(frame(sent))
        time.sleep(0.001)
    assert 0 < in_tables <= decoded_while_sending < 60_000
    stats = recorder.close()
    assert (stats.frames_recorded, db["aborts"].count, db["undecoded"].count) == (sent, sent, 0)


def test_a_dead_writer_is_noticed_counted_and_ends_the_session_incomplete(db_path):
    recorder = Recorder(db_path, SessionInfo(name="writer dies"))
    for seq in range(1, 101):
        recorder.frame(frame(seq))
    assert wait_for(lambda: recorder.statistics().frames_recorded == 100)
    recorder.writer.process.kill()  # by its PID
    assert wait_for(lambda: recorder.statistics().error is not None, timeout=5)  # the tap looks every 100 ms
    assert "writer process exited" in recorder.statistics().error
    assert "writer process exited" in health(recorder.statistics())  # /healthz: 503 with the reason
    for seq in range(101, 201):  # still forwarded by the relay: counted, not recorded
        recorder.frame(frame(seq))
    assert wait_for(lambda: recorder.statistics().frames_seen == 200)
    stats = recorder.close()
    row = sqlite_utils.Database(db_path)["sessions"].get(recorder.session_id)
    assert (recorder.status, row["status"]) == ("incomplete", "incomplete")
    assert (stats.frames_seen, stats.frames_recorded, stats.frames_dropped) == (200, 100, 100)
    assert stats.frames().balanced()
    assert stats.frames_dropped_by_reason == {"queue_full": 0, "write_failed": 0, "late_at_stop": 0,
                                              "writer_lost": 100}  # (/metrics)
    assert (row["frames_seen"], row["frames_recorded"], row["frames_dropped"]) == (200, 100, 100)
    assert kept_in_the_database(db_path, recorder.session_id) == 100


def test_a_full_database_keeps_what_fits_and_counts_the_rest_exactly(db_path):
    # Room for 2.4 MB beyond the empty tables: one transaction of the writer's (at most some 2,000 of
    # these frames, about 1.7 MB) always fits, all 12,000 frames (decoded or kept) never do.
    empty = open_database(db_path)
    empty_bytes = empty.execute("PRAGMA page_count").fetchone()[0] * empty.execute("PRAGMA page_size").fetchone()[0]
    recorder = Recorder(db_path, SessionInfo(name="full"), max_db_bytes=empty_bytes + 2_400_000)
    for seq in range(1, 12_001):
        recorder.frame(frame(seq, f"request-{seq:06d}-" + "x" * 200))
        if seq % 1000 == 0:
            time.sleep(0.2)  # several transactions
    assert wait_for(lambda: recorder.statistics().error is not None)
    assert "full" in recorder.statistics().error  # on the status line at once
    stats = recorder.close()
    row = sqlite_utils.Database(db_path)["sessions"].get(recorder.session_id)
    kept = kept_in_the_database(db_path, recorder.session_id)
    assert 0 < kept < 12_000 and row["status"] == "incomplete" and "full" in row["error"]
    assert (stats.frames_seen, stats.frames_recorded, stats.frames_dropped) == (12_000, kept, 12_000 - kept)
    assert stats.frames().balanced()
    assert stats.frames_dropped_by_reason == {"queue_full": 0, "write_failed": 12_000 - kept,
                                              "late_at_stop": 0, "writer_lost": 0}


@pytest.fixture
def small_filesystem(tmp_path):
    """A 4 MB tmpfs of the test's own (root only), unmounted at the end."""
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=True)


def test_when_space_comes_back_recording_resumes_and_the_gap_is_counted(small_filesystem):
    db_path = small_filesystem / "recording.db"
    recorder = Recorder(db_path, SessionInfo(name="resume"))
    filler = small_filesystem / "filler"
    room = os.statvfs(small_filesystem)
    filler.write_bytes(b"x" * (room.f_bavail * room.f_frsize - 700 * 1024))  # 700 KB left
    seq = 0

    def burst(frames):
        nonlocal seq
        for _ in range(frames):
            seq += 1
            recorder.frame(frame(seq, f"request-{seq:06d}-" + "x" * 200))
            if seq % 500 == 0:
                time.sleep(0.1)  # several transactions

    burst(8000)
    assert wait_for(lambda: recorder.statistics().error is not None)
    assert "full" in recorder.statistics().error
    failed_at = seq
    assert wait_for(lambda: recorder.statistics().frames_recorded < seq
                    and recorder.statistics().queue_depth_frames == 0)
    recorded_while_full = recorder.statistics().frames_recorded
    filler.unlink()  # space comes back
    burst(1000)
    assert wait_for(lambda: recorder.statistics().frames_recorded >= recorded_while_full + 1000)
    stats = recorder.close()
    db = sqlite_utils.Database(db_path)
    row = db["sessions"].get(recorder.session_id)
    seqs = {r["seq"] for r in db.query("SELECT seq FROM frames WHERE session_id = ?", [recorder.session_id])}
    kept = kept_in_the_database(db_path, recorder.session_id)
    assert set(range(failed_at + 1, seq + 1)) <= seqs  # everything after the space came back
    assert row["status"] == "incomplete" and "full" in row["error"]
    assert (stats.frames_seen, stats.frames_recorded, stats.frames_dropped) == (9000, kept, 9000 - kept)
    assert (row["frames_seen"], row["frames_recorded"], row["frames_dropped"]) == (9000, kept, 9000 - kept)
    assert 0 < 9000 - kept <= failed_at  # the gap: frames of the full spell only


def test_frames_kept_undecoded_are_decoded_by_decode_and_before_a_replay_loads_them(db_path):
    session_id = open_database(db_path)["sessions"].insert({"name": "kept", "status": "recording"}).last_pk
    writer = Writer(str(db_path), session_id)
    entries = [[RELAY, *relay_entry(frame(seq, f"r{seq}"))] for seq in range(1, 301)]
    writer.keep([(150, encode_entries(entries[:150])), (150, encode_entries(entries[150:]))])
    writer.finish(Stop("complete", None, 300, 0))  # stopped under load: nothing decoded yet
    db = sqlite_utils.Database(db_path)
    row = db["sessions"].get(session_id)
    assert (row["frames_recorded"], row["frames_undecoded"], row["frames_dropped"], db["frames"].count) == (
        300, 300, 0, 0)
    from tests.helpers import cli

    listing = cli("sessions", "--db", str(db_path), "--json")
    assert '"frames_undecoded": 300' in listing.stdout
    query = cli("query", "--db", str(db_path), "SELECT COUNT(*) AS n FROM frames")
    assert "300 frames of session 'kept' are not decoded yet" in query.stderr
    with pytest.raises(SessionError, match="300 frames of session 'kept' are not decoded yet"):
        load_session(db_path, "kept")  # it reads, and says what to run
    # A replay or diff decodes what it needs first.
    assert len(decode_and_load(db_path, "kept").inputs) == 300
    row = db["sessions"].get(session_id)
    assert (row["frames_undecoded"], row["frames_recorded"], db["aborts"].count, db["undecoded"].count) == (
        0, 300, 300, 0)
    assert cli("decode", "--db", str(db_path)).returncode == 0  # nothing left: a no-op


def test_decode_finishes_a_session_left_partly_decoded(db_path, monkeypatch):
    monkeypatch.setattr("replay_proxy.store.writer.DECODE_FRAMES", 100)
    session_id = open_database(db_path)["sessions"].insert({"name": "part", "status": "complete"}).last_pk
    writer = Writer(str(db_path), session_id)
    entries = [[RELAY, *relay_entry(frame(seq, f"r{seq}"))] for seq in range(1, 201)]
    writer.keep([(100, encode_entries(entries[:100])), (100, encode_entries(entries[100:]))])
    writer.decode_some()  # the first message only: it holds DECODE_FRAMES
    writer.finish()
    from tests.helpers import cli

    result = cli("decode", "--db", str(db_path), "--session", "part")
    assert result.returncode == 0 and "decoded 100 frames" in result.stderr, result.stderr
    db = sqlite_utils.Database(db_path)
    assert [r["seq"] for r in db.query("SELECT seq FROM frames ORDER BY seq")] == list(range(1, 201))
    assert db["sessions"].get(session_id)["frames_undecoded"] == 0


def test_a_full_queue_drops_frames_but_never_an_engine_loss(db_path):
    recorder = Recorder(db_path, SessionInfo(name="losses"), queue_size=2)
    with writer_paused(recorder):
        for i in range(1000):
            recorder.frame(frame(2 * i + 1))
            recorder.engine_lost(EngineLoss(2 * i + 2, time.time_ns(), i, "gone"))
        assert wait_for(lambda: recorder.statistics().frames_seen == 1000)
    stats = recorder.close()
    assert stats.frames_dropped >= 998
    db = sqlite_utils.Database(db_path)
    assert db["engine_events"].count == 1000
    assert stats.engines_dead == 1000


def test_the_writer_yields_the_cpu_by_default_and_still_records_everything(db_path):
    import os

    recorder = Recorder(db_path, SessionInfo(name="yielding"))  # forwarding and the peers first
    assert os.sched_getscheduler(recorder.writer.process.pid) == os.SCHED_IDLE
    for seq in range(1, 101):
        recorder.frame(frame(seq))
    assert recorder.close().frames_recorded == 100


def test_the_writer_enters_the_kernel_for_each_frame_and_within_long_sqlite_statements(db_path, monkeypatch):
    """SCHED_IDLE alone left woken forwarders waiting for a tick (store/writer.py): the writer calls
    sched_yield before each frame it tabulates, and SQLite's progress handler calls it within a statement."""
    yields = []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1))
    session_id = open_database(db_path)["sessions"].insert({"name": "yields", "status": "recording"}).last_pk
    writer = Writer(str(db_path), session_id)
    entries = [[RELAY, *relay_entry(frame(seq, f"r{seq}"))] for seq in range(1, 301)]
    writer.write([(300, encode_entries(entries))])
    assert sqlite_utils.Database(db_path)["aborts"].count == 300
    frames_yields = len(yields)
    assert frames_yields >= 300
    writer.connection.execute("SELECT COUNT(*) FROM (SELECT a.seq FROM aborts a, aborts b)").fetchone()  # 90,000 rows
    assert len(yields) - frames_yields >= 90_000 // SQLITE_STEPS_PER_YIELD  # a step a row at least
    writer.finish()


def _late_copies(recorder: Recorder, seqs: list[int]) -> tuple[zmq.Socket, list[bytes]]:
    """A forwarder of the input link's copies, connected, and one batch per seq (sent by the caller)."""
    forwarder = zmq.Context.instance().socket(zmq.DEALER)
    forwarder.setsockopt(zmq.IDENTITY, capture_tag(Channel.INPUT, 0, 0))
    forwarder.connect(recorder.capture)
    batches = []
    for seq in seqs:
        payload = encode([f"req-{seq}"])
        batches.append(struct.pack("<IQ", 1, len(payload)) + struct.pack("<QqII", seq, time.time_ns(), 1,
                                                                          len(payload)) + payload)
    return forwarder, batches


def test_copies_still_coming_after_the_stop_are_waited_for_by_count(db_path):
    """A forwarder's copies come to the tap by another socket than the recorder's STOP, so on a loaded machine
    they may come after it; in block mode a forwarder on a full pipe sends its next batch only once the tap
    has read the last. The relay says how many messages it numbered, and the tap waits for them while they
    come: here one every 0.2 s (well within STOP_COPIES_S of the last), for 0.6 s after STOP (longer than it)."""
    recorder = Recorder(db_path, SessionInfo(name="late copies"))
    recorder.frame(frame(1))
    forwarder, batches = _late_copies(recorder, [2, 3, 4])
    recorder.relay_stopped(4)
    # (NOBLOCK: were the tap gone, a DEALER's send would wait for it forever)
    late = [threading.Timer(0.2 * (i + 1), forwarder.send, [batch, zmq.NOBLOCK]) for i, batch in enumerate(batches)]
    for timer in late:
        timer.start()
    try:
        stats = recorder.close()
    finally:
        for timer in late:
            timer.join()
        forwarder.close(linger=0)
    assert (stats.frames_seen, stats.frames_recorded, stats.frames_dropped) == (4, 4, 0)
    assert kept_in_the_database(db_path, recorder.session_id) == 4


def test_copies_that_never_come_after_the_stop_are_counted_dropped_late(db_path):
    recorder = Recorder(db_path, SessionInfo(name="lost copies"))
    recorder.frame(frame(1))
    forwarder, batches = _late_copies(recorder, [2])
    forwarder.send(batches[0])
    recorder.relay_stopped(5)  # 3 and 4 and 5 were numbered and forwarded; their copies never come
    try:
        stats = recorder.close()
    finally:
        forwarder.close(linger=0)
    assert (stats.frames_seen, stats.frames_recorded, stats.frames_dropped) == (5, 2, 3)
    assert stats.frames().balanced()
    assert stats.frames_dropped_by_reason == {"queue_full": 0, "write_failed": 0, "late_at_stop": 3,
                                              "writer_lost": 0}
    row = sqlite_utils.Database(db_path)["sessions"].get(recorder.session_id)
    assert (row["frames_seen"], row["frames_recorded"], row["frames_dropped"]) == (5, 2, 3)
