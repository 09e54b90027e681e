"""Replay against an engine, with sim peers: a faithful engine gives nothing, each drift its finding."""

import json
import re
import shlex
import shutil
import sys

import pytest
import sqlite_utils
import trio

from replay_proxy.compare.findings import Severity, exit_code
from replay_proxy.compare.report import diff_sessions
from replay_proxy.compare.rules import load_rules
from replay_proxy.errors import ExitCode
from replay_proxy.processes import free_port
from replay_proxy.replay.player import PeerUnderTest, ReplayOptions
from replay_proxy.replay.run import KeptEngine, replay_session
from replay_proxy.store.session import load_session
from replay_proxy.wire.messages import Side
from tests.helpers import engines_command
from tests.replay.sim_sessions import record_baseline, replay_baseline



@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    db = tmp_path_factory.mktemp("recorded") / "baseline.db"
    trio.run(record_baseline, db, 1, 1)
    return db




def landings(db):
    """(recorded, replayed) tokens before the ABORT of the aborted request, from the database."""
    rows = sqlite_utils.Database(db).execute(
        "SELECT session_id, tokens_before_abort FROM abort_progress WHERE request_id = 'long' ORDER BY session_id")
    return tuple(tokens for _, tokens in rows.fetchall())


def test_a_faithful_engine_gives_no_findings_and_the_replay_is_a_session(tmp_path, recorded):
    report, outcome, db = replay_baseline(tmp_path, recorded)
    assert [f for f in report.findings if f.severity >= Severity.WARNING] == []
    assert exit_code(report.findings) is ExitCode.OK
    # With no run of the baseline build, timing is not compared with the recording as if it were one.
    assert [f.code for f in report.findings if f.category == "performance"] == ["timing_not_judged"]
    # Every generated token's logprobs were asked for, and the candidate's own obey each request's parameters.
    verdicts = {v.request_id: v for v in report.verdicts}
    assert all(v.passed for v in verdicts.values()) and verdicts["r0"].tier == "exact"
    assert (outcome.sent, outcome.requests, outcome.finished) == (11, 9, 8)  # the aborted one never finishes
    sessions = list(sqlite_utils.Database(db).query("SELECT id, mode, baseline_session_id, status FROM sessions"))
    assert sessions[1] == {"id": 2, "mode": "replay", "baseline_session_id": 1, "status": "complete"}
    # The ABORT went at the recorded progress. (Where it was recorded is the sim frontend's race: it
    # aborts once it has 3 tokens, and one or two more are usually in flight by then.)
    recorded_at, replayed_at = landings(db)
    assert replayed_at == recorded_at >= 3
    [landed] = [f for f in report.findings if f.code == "abort_landed"]
    assert (landed.request_id, landed.baseline, landed.candidate) == ("long", recorded_at, recorded_at)
    # `diff` of the recording and the replay pairs every request, though the replay asked each for logprobs.
    same = diff_sessions(db, "1", db, "2", load_rules())
    assert [f for f in same.findings if f.severity >= Severity.WARNING and f.category != "performance"] == []
    assert len(same.verdicts) == 9


def test_an_abort_lands_at_its_recorded_progress_on_an_engine_faster_than_the_recorded_one(tmp_path, recorded):
    # As if the recorded engine had been slow: the ABORT crossed 3 s after the request had its tokens.
    # At the recorded time the sim engine has long finished all 500, so the clock must not decide.
    def later_abort(db):
        db.execute("UPDATE frames SET ts_ns = ts_ns + 3000000000 WHERE kind = 'ABORT'")
        db.execute("UPDATE aborts SET ts_ns = ts_ns + 3000000000")
        db.conn.commit()
    report, outcome, db = replay_baseline(tmp_path, recorded, pace="original", edit=later_abort)
    recorded_at, replayed_at = landings(db)
    assert replayed_at == recorded_at >= 3
    assert "abort_progress" not in {f.code for f in report.findings}
    assert outcome.finished == 8  # the aborted request never finished: the ABORT came before its 500 tokens


def test_an_abort_that_cannot_land_where_it_was_recorded_is_a_warning_with_both_numbers(tmp_path, recorded):
    # The recording says the frontend aborted after 4 tokens or so (its race); say 150 times as many: the
    # request (500 tokens) finishes first, so the ABORT goes after the finish, short of the recorded point.
    [recorded_at] = landings(recorded)
    def abort_later(db):
        [(long,)] = db.execute("SELECT number FROM request_ids WHERE request_id = 'long'").fetchall()
        for session_id, seq, packed in db.execute("SELECT session_id, seq, outputs FROM frame_outputs").fetchall():
            outputs = [o if o is None or o[0] != long else [long, o[1] * 150, *o[2:]] for o in json.loads(packed)]
            db.execute("UPDATE frame_outputs SET outputs = ? WHERE session_id = ? AND seq = ?",
                       [json.dumps(outputs), session_id, seq])
        db.conn.commit()
    report, _, db = replay_baseline(tmp_path, recorded, edit=abort_later)
    later = 150 * recorded_at  # at least 600
    [off] = [f for f in report.findings if f.code == "abort_progress"]
    assert off.severity == Severity.WARNING and (off.baseline, off.candidate) == (later, 500)
    assert str(later) in off.message and "500" in off.message
    stored = sqlite_utils.Database(db).execute(
        "SELECT severity, baseline, candidate FROM findings WHERE code = 'abort_progress'").fetchall()
    assert stored == [("warning", str(later), "500")]


@pytest.mark.parametrize("drift, code, expected", [
    ({"drop_registration_key": "block_size"}, ExitCode.SCHEMA_BREAKING, "registration_key_missing"),
    ({"insert_output_field": 5}, ExitCode.SCHEMA_BREAKING, "field_inserted"),
    ({"append_outputs_field": True}, ExitCode.SCHEMA_BREAKING, "array_longer"),
    ({"finish_reason": "stop"}, ExitCode.BEHAVIOUR, "finish_reason_changed"),
    ({"token_offset": 3}, ExitCode.BEHAVIOUR, "token_mismatch"),
    ({"die_after_requests": 2}, ExitCode.BEHAVIOUR, "engine_dead"),
])
def test_each_engine_drift_is_caught(tmp_path, recorded, drift, code, expected):
    report, _, _ = replay_baseline(tmp_path, recorded, drift, pace="original")  # fast would batch every request
    assert expected in {f.code for f in report.findings if f.severity >= Severity.WARNING}
    assert exit_code(report.findings) is code
    if expected == "engine_dead":  # the replay ended when the engine died, not after --finish-timeout
        assert "finish_timeout" not in {f.code for f in report.findings}


def test_changed_tokens_of_batched_requests_are_judged_at_their_first_divergence(tmp_path, recorded):
    """Batched requests do not reproduce on vLLM's CPU build: they are not held to every token, but where their
    tokens first differ each side's token must be among the other's top logprobs, and a shifted token is not."""
    report, _, _ = replay_baseline(tmp_path, recorded, {"token_offset": 3}, pace="original")
    found = {f.request_id: (f.severity, f.code, f.tier) for f in report.findings
             if f.code in ("token_mismatch", "divergence_not_close")}
    assert {found[f"r{k}"] for k in range(3)} == {(Severity.REGRESSION, "token_mismatch", "exact")}  # ran alone
    assert {found[f"r{k}"] for k in range(3, 8)} == {(Severity.REGRESSION, "divergence_not_close",
                                                      "first_divergence")}
    verdicts = {v.request_id: v.tier for v in report.verdicts}
    assert {verdicts[f"r{k}"] for k in range(3, 8)} == {"first_divergence"}


def test_requests_a_fast_replay_batched_are_judged_at_their_first_divergence(tmp_path, recorded):
    report, _, _ = replay_baseline(tmp_path, recorded, {"token_offset": 3}, pace="fast")
    found = {f.request_id: f.tier for f in report.findings if f.code in ("token_mismatch", "divergence_not_close")}
    assert set(found) == {f"r{k}" for k in range(8)} and set(found.values()) == {"first_divergence"}


def test_noise_runs_of_a_stable_baseline_make_batched_mismatches_regressions(tmp_path, recorded):
    report, _, db = replay_baseline(tmp_path, recorded, {"token_offset": 3}, noise_runs=2)
    severity = {f.request_id: f.severity for f in report.findings if f.code == "token_mismatch"}
    assert {severity[f"r{k}"] for k in range(8)} == {Severity.REGRESSION}  # the baseline runs agreed
    names = [r["name"] for r in sqlite_utils.Database(db).query(
        "SELECT name FROM sessions WHERE mode = 'replay' AND status = 'complete' ORDER BY id")]
    # The baseline build's runs and the candidate's, interleaved and counterbalanced.
    assert len(report.noise) == 2 and [n.split("-")[1] for n in names] == ["noise", "replay", "replay", "noise"]


def test_a_session_recorded_with_its_coordinator_replays_without_it(tmp_path):
    recorded = tmp_path / "dp.db"
    trio.run(record_baseline, recorded, 2, 1, True)
    assert sqlite_utils.Database(recorded).execute(
        "SELECT COUNT(*) FROM frames WHERE channel = 'coordinator_output'").fetchone()[0] > 0
    report, outcome, _ = replay_baseline(tmp_path, recorded, engines=2)
    timeless = [f for f in report.findings if f.category != "performance"]
    assert [f for f in timeless if f.severity >= Severity.WARNING] == []
    assert (outcome.requests, outcome.finished) == (9, 8)


def test_a_different_number_of_engines_fails_before_anything_is_sent(tmp_path, recorded):
    report, outcome, db = replay_baseline(tmp_path, recorded, engines=2, ready_timeout=10)
    [finding] = report.findings
    assert "engine 1 connected" in finding.message
    assert exit_code(report.findings) is ExitCode.REPLAY_FAILED
    sent = dict(sqlite_utils.Database(db).execute(
        "SELECT channel, COUNT(*) FROM frames WHERE session_id = 2 AND direction = 'to_engine' GROUP BY channel"))
    assert "input" not in sent
    # Whichever engine says HELLO first: engine 0 is sent its INIT (the link reached the peer), engine 1
    # is refused before anything is sent (seen both ways on a busy machine).
    assert finding.code == ("replay_failed" if sent.get("handshake") else "peer_not_reached")



def kept_replays(tmp_path, recorded, drifts):
    """Replay ``recorded`` once per drift, an engine kept from one replay to the next: (the report, the PID of
    the kept engine after it or None, its database, its folder) each. Each replay's command would start an
    engine with its drift; a replay that reuses the kept engine runs none."""
    kept, results = KeptEngine(), []
    listen = f"tcp://127.0.0.1:{free_port()}"
    try:
        for i, drift in enumerate(drifts):
            db, folder = tmp_path / f"replay-{i}.db", tmp_path / f"replay-{i}"
            shutil.copy(recorded, db)
            peer = PeerUnderTest(side=Side.ENGINE, address=listen, command=engines_command(listen, drift))
            options = ReplayOptions(pace="original", ready_timeout_s=20, finish_timeout_s=10, report_dir=folder)
            report, _ = replay_session(db, "baseline", peer, options, kept=kept)
            results.append((report, kept.child.pid if kept.child else None, db, folder))
    finally:
        kept.stop()
    return results


def warnings(report):
    return [f for f in report.findings if f.severity >= Severity.WARNING and f.category != "performance"]


def test_a_kept_engine_serves_replay_after_replay_as_a_fresh_one(tmp_path, recorded):
    results = kept_replays(tmp_path, recorded, [None, None, None])
    assert [warnings(report) for report, *_ in results] == [[], [], []]
    [pid] = {pid for _, pid, _, _ in results}  # one engine, started by the first replay
    assert pid is not None
    for _, _, db, folder in results:
        crossed = sqlite_utils.Database(db).execute(
            "SELECT channel, COUNT(*) FROM frames WHERE session_id = 2 GROUP BY channel").fetchall()
        assert dict(crossed)["handshake"] == 3  # HELLO, INIT, READY: the engine's, reported by every replay
        calls = sqlite_utils.Database(db).execute(
            "SELECT method FROM utility_calls WHERE session_id = 2").fetchall()
        assert calls == [("get_supported_tasks",)]  # the reset between replays is part of none
    assert (results[1][3] / "engine.log").read_text().startswith(f"# engine under test (pid {pid}), started")


def test_an_engine_that_died_is_not_kept_and_the_next_replay_starts_its_own(tmp_path, recorded):
    (died, kept_after, _, _), (report, pid, _, _) = kept_replays(tmp_path, recorded,
                                                                 [{"die_after_requests": 2}, None])
    assert "engine_dead" in {f.code for f in died.findings} and kept_after is None
    assert warnings(report) == [] and pid is not None


def test_teacher_forced_scoring_finds_distributions_that_moved_under_unchanged_tokens(tmp_path, recorded):
    """The baseline's run is scored twice and the candidate's once (recorded as scoring requests beside the
    session's); an engine whose every logprob is 5% sharper generates every token as before, and is found."""
    (tmp_path / "same").mkdir()
    (tmp_path / "sharper").mkdir()
    same, _, db = replay_baseline(tmp_path / "same", recorded, noise_runs=1)
    codes = {f.code: f for f in same.findings}
    assert "scoring_same" in codes and exit_code(same.findings) is ExitCode.OK, codes["scoring_same"].message
    scoring = sqlite_utils.Database(db).execute(
        "SELECT s.name, COUNT(*) FROM requests r JOIN sessions s ON s.id = r.session_id "
        "WHERE r.request_id LIKE 'replay-proxy-score-%' GROUP BY s.id ORDER BY s.id").fetchall()
    scored = sum(1 for r in load_session(recorded, "baseline").requests if r.tokens)
    assert [n for _, n in scoring] == [2 * scored, scored]  # the baseline's run twice, the candidate's once
    sharper, _, _ = replay_baseline(tmp_path / "sharper", recorded, {"logprob_scale": 0.05}, noise_runs=1)
    regressions = {f.code for f in sharper.findings if f.severity is Severity.REGRESSION}
    assert {"scoring_kl", "scores_diverge"} <= regressions and "token_mismatch" not in regressions, regressions


def test_a_replay_whose_recording_cannot_be_closed_leaves_no_engine_running(tmp_path, recorded, monkeypatch):
    """An exception closing the replay's recording (a database that went bad) still stops the peer it started."""
    from replay_proxy.replay import run
    from replay_proxy.recorder import Recorder

    started, unclosed, close = [], [], Recorder.close

    class Watched(run.Child):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    def broken_close(self, *args, **kwargs):
        unclosed.append(self)
        raise RuntimeError("database disk image is malformed")

    monkeypatch.setattr(run, "Child", Watched)
    monkeypatch.setattr(Recorder, "close", broken_close)
    with pytest.raises(RuntimeError, match="malformed"):
        replay_baseline(tmp_path, recorded)
    assert started and not any(child.running() for child in started)
    for recorder in unclosed:  # (its writer process, which the broken close left waiting)
        close(recorder, "failed", "closed by the test")


SILENT_ENGINE = """
import sys, time, zmq
from replay_proxy.wire.encode import encode
from replay_proxy.wire.handshake import parse_init
context = zmq.Context()
handshake = context.socket(zmq.DEALER)
handshake.setsockopt(zmq.IDENTITY, b"\\x00\\x00")
handshake.connect(sys.argv[1])
handshake.send(encode({"status": "HELLO", "local": False, "headless": True}))
_, addresses = parse_init(handshake.recv())
if sys.argv[2] == "connects":  # to its input socket, and says nothing there
    silent = context.socket(zmq.DEALER)
    silent.setsockopt(zmq.IDENTITY, b"\\x00\\x00")
    silent.connect(addresses.inputs[0])
handshake.send(encode({"status": "READY", "local": False, "headless": True}))
time.sleep(60)
"""


@pytest.mark.parametrize("connects, events", [("connects", "ACCEPTED, HANDSHAKE_SUCCEEDED"), ("never", "none")])
def test_an_engine_ready_without_its_registration_is_named_with_what_reached_its_input_socket(
        tmp_path, recorded, connects, events):
    script = tmp_path / "silent_engine.py"
    script.write_text(SILENT_ENGINE)
    listen = f"tcp://127.0.0.1:{free_port()}"
    peer = PeerUnderTest(side=Side.ENGINE, address=listen, command=shlex.join([sys.executable, str(script), listen,
                                                                              connects]))
    report, _ = replay_session(recorded, "baseline", peer, ReplayOptions(ready_timeout_s=3, report_dir=tmp_path))
    [failure] = report.findings
    assert "handshake states {0: 'READY'}, registrations {0: 0}" in failure.message, failure.message
    assert re.search(rf"connections to the input socket\n  tcp://127\.0\.0\.1:\d+: {events}\n", failure.message)
