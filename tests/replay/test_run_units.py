"""The parts of one replay run (replay/run.py), each on its own: the order of the runs, a run's recording, the
engine kept between replays, and a failure's classification (the replay tests drive them together)."""

import contextlib
import shutil
import sqlite3
import sys

from replay_proxy.compare.findings import Finding, Severity
from replay_proxy.compare.rules import load_rules
from replay_proxy.processes import Child, free_port
from replay_proxy.replay.player import PeerUnderTest, ReplayError
from replay_proxy.replay.run import KeptEngine, RecordedRun, _schedule, classify_failure
from replay_proxy.store.session import load_session
from replay_proxy.wire.messages import Side
from tests.helpers import ROOT, frame, wait_for

RULES = load_rules()


def test_runs_are_counterbalanced_and_each_build_runs_as_often():
    assert _schedule(0) == [(1, True)]
    assert _schedule(1) == [(1, False), (1, True)]
    assert _schedule(3) == [(1, False), (1, True), (2, True), (2, False), (3, False), (3, True)]
    assert sum(candidate for _, candidate in _schedule(4)) == 4


def recorded_run(tmp_path, name="run-1"):
    db = tmp_path / "demo.db"
    if not db.exists():
        shutil.copy(ROOT / "recordings" / "demo.db", db)
    peer = PeerUnderTest(side=Side.ENGINE, address=f"tcp://127.0.0.1:{free_port()}")
    return db, RecordedRun(load_session(db, "demo"), name, peer)


def session_row(db, session_id):
    with contextlib.closing(sqlite3.connect(db)) as connection:
        return connection.execute("SELECT name, mode, baseline_session_id, status, error FROM sessions WHERE id = ?",
                                  [session_id]).fetchone()


def test_a_recorded_run_is_a_replay_session_of_the_recording_ended_as_the_run_ended(tmp_path):
    db, run = recorded_run(tmp_path)
    recording_id = load_session(db, "demo").id
    assert session_row(db, run.close(None)) == ("run-1", "replay", recording_id, "complete", None)
    _, failed = recorded_run(tmp_path, name="run-2")
    session_id = failed.close(Finding("replay", Severity.REGRESSION, "replay_failed", "the engine died"))
    assert session_row(db, session_id) == ("run-2", "replay", recording_id, "failed", "the engine died")


def test_a_failure_before_anything_was_sent_is_peer_not_reached_with_the_log_line_that_says_why(tmp_path):
    _, run = recorded_run(tmp_path)
    log = tmp_path / "engine.log"
    child = Child([sys.executable, "-c", "print('ModuleNotFoundError: No module named vllm')"], log)
    assert child.wait(30) == 0
    try:
        finding = classify_failure(ReplayError("the engine exited"), run.observer, Side.ENGINE, child, log, None,
                                   RULES)
    finally:
        run.close(None)
    assert finding.code == "peer_not_reached"
    assert "nothing had been sent to the engine" in finding.message
    assert "its log says: ModuleNotFoundError" in finding.message and str(log) in finding.message


def test_a_failure_after_a_message_was_sent_is_replay_failed_and_names_it(tmp_path):
    _, run = recorded_run(tmp_path)
    run.observer.frame(frame(1))  # an ABORT, sent to the engine
    try:
        finding = classify_failure(ReplayError("no answer"), run.observer, Side.ENGINE, None, tmp_path / "x.log",
                                   None, RULES)
    finally:
        run.close(None)
    assert finding.code == "replay_failed"
    assert "last messages sent to the engine: ABORT (engine 0, API server 0)" in finding.message


def test_a_kept_engine_is_handed_back_only_after_a_clean_run_and_while_it_runs(tmp_path):
    kept = KeptEngine()
    assert not kept.take(load_session(ROOT / "recordings" / "demo.db", "demo"), 1)  # nothing kept yet
    child = Child(["sleep", "60"], tmp_path / "engine.log")
    try:
        kept.hand_back(child, None, clean=True)
        assert kept.child is child and child.running()
        kept.hand_back(child, None, clean=False)
        assert kept.child is None and wait_for(lambda: not child.running(), 30)
    finally:
        child.stop(timeout=10)
