"""A recording in a series of files (recorder/rotation/): exact counts over the files, every request whole in the
file of its ADD, each file replaying alone, --keep, and SIGHUP through the command line."""

import json
import signal
import socket
import subprocess
import sqlite3
import sys
import time
from pathlib import Path

import trio

from replay_proxy.compare.findings import Severity
from replay_proxy.processes import Child, free_port
from replay_proxy.replay.player import PeerUnderTest, ReplayOptions
from replay_proxy.replay.run import replay_session
from replay_proxy.recorder.rotation import RotationSettings
from replay_proxy.recorder.rotation.rotator import ABORT_GRACE_NS, Finishing
from replay_proxy.wire.messages import Side
from tests.helpers import RecordedSession
from tests.helpers import engines_command
from tests.helpers import wait_for
from tests.helpers import CLI, cli

ROUNDS = 3


def rows(path: Path, sql: str, *args) -> list[tuple]:
    connection = sqlite3.connect(path)
    try:
        return connection.execute(sql, args).fetchall()
    finally:
        connection.close()


async def until(condition, timeout_s: float = 30.0) -> None:
    with trio.fail_after(timeout_s):
        while not condition():
            await trio.sleep(0.02)


async def record_rotating(db: Path, rotation: RotationSettings) -> tuple:
    """Three rounds of requests on two engines and two API servers, a rotation after each. A few long requests
    of each round run on into the next round's file until they are aborted there (the last round's, after the
    last rotation); then a utility call on each engine and API server, answered after those outputs, and the
    recorder closed. (The session, its final statistics, every request id, the aborted ones.)"""
    async with trio.open_nursery() as nursery:
        session = await RecordedSession(nursery, db, engines=2, api_servers=2, name="rotating",
                                        rotation=rotation).start()
        frontend, recorder = session.frontend, session.recorder
        calls = [await frontend.utility("get_supported_tasks", engine=e, client=c) for e in range(2) for c in range(2)]
        ids, long = [], {}

        async def abort(round_):
            for rid, (engine, client) in long.items():
                if rid.startswith(f"r{round_}-"):
                    await frontend.abort([rid], engine=engine, client=client)

        for round_ in range(ROUNDS):
            for k in range(12):
                rid, engine, client = f"r{round_}-{k}", k % 2, (k // 2) % 2
                ids.append(rid)
                if k % 4 == 0:  # never finishes by itself
                    long[rid] = (engine, client)
                await frontend.add(rid, [3, round_, k], engine=engine, client=client,
                                   max_tokens=10**6 if rid in long else 3, temperature=0.0)
            await frontend.wait_for(lambda r=round_: all(f"r{r}-{k}" in frontend.finish_reasons
                                                         for k in range(12) if k % 4))
            await abort(round_ - 1)  # its outputs went on after this round's ADDs, in the file before
            # A rotation falls where the writer has got to, which may be behind the wire: after this round's ADDs.
            await until(lambda: recorder.statistics().requests == len(ids))
            recorder.rotate()  # SIGHUP to the writer, by its PID
            await until(lambda r=round_: recorder.statistics().rotations > r)
        await abort(ROUNDS - 1)
        # Each engine answers a call after the outputs it sent before: those have all crossed by then.
        calls += [await frontend.utility("get_supported_tasks", engine=e, client=c) for e in range(2) for c in range(2)]
        await frontend.wait_for(lambda: all(r in frontend.finish_reasons for r in ids if r not in long)
                                and all(c in frontend.utility_results for c in calls))
        nursery.cancel_scope.cancel()
    stats = recorder.close(writer_wait_s=60)  # (its final counts, however busy this machine is)
    assert stats.final, stats.error
    return session, stats, ids, set(long)


def test_rotations_count_every_frame_once_keep_every_request_whole_and_each_file_replays_alone(tmp_path):
    db = tmp_path / "staging.db"
    session, stats, ids, aborted = trio.run(record_rotating, db, RotationSettings(str(db)))
    files = [db, *(tmp_path / f"staging-{n}.db" for n in range(1, ROUNDS + 1))]
    assert sorted(tmp_path.glob("staging*.db")) == sorted(files) and stats.rotations == ROUNDS
    sessions = [dict(zip(("status", "seen", "recorded", "dropped", "copied", "continues", "continued_in"), rows(
        path, "SELECT status, frames_seen, frames_recorded, frames_dropped, frames_copied, continues, continued_in "
              "FROM sessions")[0])) for path in files]
    # A chain of files, each ended complete.
    assert [s["continues"] for s in sessions] == [None, *(f.name for f in files[:-1])]
    assert [s["continued_in"] for s in sessions] == [*(f.name for f in files[1:]), None]
    assert {s["status"] for s in sessions} == {"complete"}
    # Every frame that crossed is counted once, in one file: the files add up to what the tap saw.
    assert sum(s["seen"] for s in sessions) == stats.frames_seen == stats.frames_recorded > 0
    assert sum(s["recorded"] for s in sessions) == stats.frames_recorded and stats.frames_dropped == 0
    assert stats.frames().balanced()
    assert all(s["seen"] == s["recorded"] and s["dropped"] == 0 for s in sessions)
    for path, s in zip(files, sessions):  # what is not counted there is a copy, and marked as one
        assert rows(path, "SELECT COUNT(*) FROM frames")[0][0] == s["recorded"] + (s["copied"] or 0)
        assert rows(path, "SELECT COUNT(*) FROM frames WHERE copied = 1")[0][0] == (s["copied"] or 0)
    assert all(s["copied"] for s in sessions[1:])  # each later file begins with the session's start
    # Summed where not copied, the series holds each frame, handshake and output once (docs/database.md).
    for table, key in (("frames", "seq"), ("handshakes", "seq"), ("outputs", "seq, request_id"),
                       ("utility_calls", "call_id")):
        held = [r for f in files for r in rows(f, f"SELECT {key} FROM {table} WHERE copied IS NULL"
                                               if table != "utility_calls" else
                                               "SELECT q.call_id FROM utility_requests q WHERE copied IS NULL")]
        assert len(held) == len(set(held)) > 0, table
    assert len([r for f in files for r in rows(f, "SELECT seq FROM frames WHERE copied IS NULL")]) == \
        stats.frames_recorded
    # Every request is whole in the file of its ADD: its tokens there are all the frontend got.
    where = {}
    for path in files:
        for rid, tokens in rows(path, "SELECT request_id, new_token_ids FROM outputs ORDER BY seq, position"):
            where.setdefault(rid, {}).setdefault(path, []).extend(json.loads(tokens))
        for (rid,) in rows(path, "SELECT request_id FROM requests"):
            assert where.get(rid, {path: []}).keys() == {path}, rid
    assert {rid: list(paths.values())[0] for rid, paths in where.items()} == {
        rid: session.frontend.tokens[rid] for rid in ids}
    # The long requests went on in their file after the next had begun (its first ADD is older), and were
    # aborted there.
    last_output = [rows(f, "SELECT MAX(seq) FROM outputs")[0][0] for f in files]
    first_add = [rows(f, "SELECT MIN(seq) FROM requests")[0][0] for f in files]
    assert all(last_output[k] > first_add[k + 1] for k in range(ROUNDS - 1)), (last_output, first_add)
    assert {r for f in files for (r,) in rows(f, "SELECT request_id FROM aborts")} == aborted
    # Each file cuts and exports alone ...
    for path in files[1:3]:
        cut = cli("cut", "--db", str(path), "--session", "rotating", "--out", str(path.with_suffix(".cut")),
                  "--sample", "2")
        assert cut.returncode == 0 and "2 requests" in cut.stderr, cut.stderr
        exported = cli("export", "--db", str(path), "--parquet", str(tmp_path / "lake"))
        assert exported.returncode == 0, exported.stderr
    # ... and replays alone against a faithful engine.
    for path in files:
        listen = f"tcp://127.0.0.1:{free_port()}"
        peer = PeerUnderTest(side=Side.ENGINE, address=listen, command=engines_command(listen, engines=2))
        report, outcome = replay_session(path, "rotating", peer, ReplayOptions(
            pace="fast", ready_timeout_s=20, finish_timeout_s=10, report_dir=tmp_path / path.stem))
        timeless = [f for f in report.findings if f.category != "performance"]
        assert [f for f in timeless if f.severity >= Severity.WARNING] == [], path
        [(added, aborted_here)] = rows(path, "SELECT COUNT(*), COUNT(*) FILTER (WHERE request_id IN "
                                             "(SELECT request_id FROM aborts)) FROM requests WHERE session_id = 1")
        assert (outcome.requests, outcome.finished) == (added, added - aborted_here), path


def test_keep_leaves_that_many_files_the_newest(tmp_path):
    db = tmp_path / "kept.db"
    _, stats, _, _ = trio.run(record_rotating, db, RotationSettings(str(db), keep=2))
    assert sorted(p.name for p in tmp_path.glob("kept*.db")) == ["kept-2.db", "kept-3.db"]
    assert (stats.rotations, stats.files_deleted) == (ROUNDS, ROUNDS + 1 - 2), stats


def test_sighup_to_the_proxy_begins_the_next_file_named_by_the_pattern(tmp_path):
    pattern = tmp_path / "hup-%Y.db"
    upstream, listen = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proxy = Child([*CLI, "record", "--listen", listen, "--upstream", upstream, "--db", str(pattern), "--session", "s",
                   "--instance", "api-0", "--frontend", "smg==1.13.0", "--log-format", "json"], tmp_path / "proxy.log")
    peers = []
    try:
        proxy.wait_for_log('"event":"listening"', timeout=30)
        peers.append(Child([*CLI, "sim", "frontend", "--handshake", upstream, "--http-port", str(free_port())],
                           tmp_path / "frontend.log"))
        peers.append(Child([sys.executable, "-m", "replay_proxy", "sim", "engine", "--handshake", listen],
                           tmp_path / "engine.log"))
        proxy.wait_for_log('"event":"engine_connected"', timeout=30)
        first = tmp_path / time.strftime("hup-%Y.db")
        # The proxy sees the handshake before its writer has it: a rotation before that is no start to copy.
        assert wait_for(lambda: rows(first, "SELECT count(*) FROM handshakes")[0][0] > 0), proxy.log_tail()
        proxy.process.send_signal(signal.SIGHUP)  # by its PID
        proxy.wait_for_log('"event":"rotated"', timeout=30)
    finally:
        for peer in reversed(peers):
            peer.stop(timeout=20)
        code = proxy.stop(timeout=30)
    year = time.strftime("%Y")
    files = sorted(p.name for p in tmp_path.glob("hup-*.db"))
    assert code == 0 and files == [f"hup-{year}-1.db", f"hup-{year}.db"], proxy.log_tail()
    [second] = rows(tmp_path / f"hup-{year}-1.db", "SELECT continues, status, frames_copied FROM sessions")
    assert second[:2] == (f"hup-{year}.db", "complete") and second[2] > 0  # it begins with the handshake
    # Each file says which proxy of the fleet recorded it (export's partitions), and which frontend.
    assert {rows(tmp_path / f, "SELECT proxy_host, proxy_instance, frontend_name, frontend_version FROM sessions")[0]
            for f in files} == {(socket.gethostname(), "api-0", "smg", "1.13.0")}


def test_an_aborted_request_stays_in_its_file_for_the_grace_by_the_frames_own_times(tmp_path):
    """vLLM's engine sends nothing for an aborted request, but outputs it had sent may cross after the ABORT:
    those belong to the request's file for ABORT_GRACE_NS of frame time, however late the writer reads them."""
    path = tmp_path / "old.db"
    finishing = Finishing({"aborted", "running"}, "0.32.0", RotationSettings(str(path)), now=0.0, file_bytes=0)
    aborted_at = 10**18
    finishing.end([], ["aborted"], aborted_at)
    finishing.expire(aborted_at + ABORT_GRACE_NS)  # an output in flight, at the edge of the grace
    assert finishing.pending == {"aborted", "running"}
    finishing.end(["running"], [], aborted_at + 1)
    assert finishing.pending == {"aborted"} and not finishing.over(1.0, 0)
    finishing.expire(aborted_at + ABORT_GRACE_NS + 1)
    assert finishing.pending == set() and finishing.over(1.0, 0)


def test_rotate_mb_begins_a_file_at_that_size_and_max_total_gb_deletes_the_oldest(tmp_path):
    """Through record itself, between busy peers: --rotate-mb rotates by size alone (no clock, no SIGHUP), and
    --max-total-gb deletes this run's oldest files, so that those left before the last stay under it."""
    db = tmp_path / "sized.db"
    run = subprocess.run([sys.executable, "scripts/bench/busy.py", "--seconds", "4", "--rate", "1000", "--outputs",
                          "32", "--json", "--db", str(db), "--rotate-mb", "1", "--max-total-gb", "0.004"],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])["summary"]
    assert summary["frames_seen"] == summary["frames_recorded"] == 8004, summary
    assert summary["rotations"] >= 3 and summary["files_deleted"] >= 1, summary
    left = sorted(tmp_path.glob("sized*.db"), key=lambda p: (len(p.name), p.name))
    assert len(left) == summary["rotations"] + 1 - summary["files_deleted"]
    # (a writer behind its traffic rotates late, into larger files: on a loaded machine only the last may be left)
    assert sum(path.stat().st_size for path in left[:-1]) <= 0.004e9
    # The newest are left, a chain of complete sessions: each continues the one before it.
    chain = [rows(path, "SELECT continues, continued_in, status FROM sessions")[0] for path in left]
    assert [c[1] for c in chain] == [*(path.name for path in left[1:]), None]
    assert [c[0] for c in chain[1:]] == [path.name for path in left[:-1]]
    assert {c[2] for c in chain} == {"complete"}
