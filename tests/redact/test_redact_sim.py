"""Redaction with sim peers: at record time and after the fact, nothing of the traffic stays but its shape."""

import json
import os
import signal
import sqlite3
import subprocess
import sys

import pytest
import sqlite_utils
import trio

from replay_proxy.compare.findings import Severity
from replay_proxy.processes import free_port
from replay_proxy.redact.settings import Redaction, RedactionSettings
from replay_proxy.replay.player import PeerUnderTest, ReplayOptions
from replay_proxy.replay.run import replay_session
from replay_proxy.sim.drift import EngineDrift
from replay_proxy.sim.engine import VOCAB, token_at
from replay_proxy.store.copy import redact_database
from replay_proxy.store.raw import frames_with_bytes
from replay_proxy.wire.handshake import engine_identity
from replay_proxy.wire.messages import Side
from tests.helpers import RecordedSession
from tests.redact.leaks import common_prefix, leaks, shape, tokens_of
from tests.helpers import engines_command

STOP = "a secret stop string"
SCHEMA = '{"type": "object", "properties": {"acme_secret_field": {"type": "string"}}}'
LORA = {"lora_name": "acme-customer-adapter", "lora_int_id": 1, "lora_path": "/srv/acme/adapters/customer"}
SALT, TRACE, UTILITY_ARG = "acme-cache-salt", "00-acme-trace-parent-01", "acme-utility-argument"
SYSTEM = list(range(100, 140))  # a system prompt every chat request starts with
SECRETS = [STOP, SCHEMA, "acme_secret_field", LORA["lora_name"], LORA["lora_path"], SALT, TRACE, UTILITY_ARG]
REQUEST_IDS = ["acme-chat-turn-1", "acme-chat-turn-2", "acme-seeded", "acme-to-abort"]


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "redaction.key"  # the name the CLI test uses too
    path.write_bytes(os.urandom(32))
    return path


def settings(key_file) -> RedactionSettings:
    return RedactionSettings(str(key_file), VOCAB)


async def rich_workload(frontend) -> list[list[int]]:
    """A two-turn chat sharing its prefix, stop strings, a schema, a LoRA, a seeded request, a client abort,
    a utility call with a string: the prompts sent."""
    turn_1 = SYSTEM + list(range(500, 510))
    await frontend.add(REQUEST_IDS[0], turn_1, max_tokens=6, temperature=0.0, stop=[STOP],
                       structured_outputs={"json": SCHEMA},
                       request={"cache_salt": SALT, "trace_headers": {"traceparent": TRACE}, "lora_request": LORA})
    await frontend.wait_for(lambda: REQUEST_IDS[0] in frontend.finish_reasons)
    turn_2 = turn_1 + frontend.tokens[REQUEST_IDS[0]] + list(range(600, 610))
    seeded = list(range(700, 731))
    aborted = SYSTEM + list(range(800, 811))
    await frontend.add(REQUEST_IDS[1], turn_2, max_tokens=6, temperature=0.0)
    await frontend.add(REQUEST_IDS[2], seeded, max_tokens=5, seed=3, stop_token_ids=[777], logit_bias={5: 1.0})
    await frontend.add(REQUEST_IDS[3], aborted, max_tokens=10_000, temperature=0.0)
    await frontend.wait_for(lambda: len(frontend.tokens[REQUEST_IDS[3]]) >= 3)
    await frontend.abort([REQUEST_IDS[3]])
    call = await frontend.utility("collective_rpc", UTILITY_ARG)
    await frontend.wait_for(lambda: len(frontend.finish_reasons) == 3 and call in frontend.utility_results)
    return [turn_1, turn_2, seeded, aborted]


async def record(db, name="test", **options):
    """The rich workload through the recording relay: (the prompts, the tokens the frontend received, the
    recorded session)."""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            session = await RecordedSession(nursery, db, name=name, **options).start()
            prompts = await rich_workload(session.frontend)
            nursery.cancel_scope.cancel()
    session.recorder.close()
    return prompts, [session.frontend.tokens[rid] for rid in REQUEST_IDS], session


def assert_nothing_leaks(db, prompts, outputs, addresses=()):
    assert leaks(db, prompts + [o for o in outputs if len(o) >= 8], [*SECRETS, *REQUEST_IDS, *addresses]) == []


def assert_redacted_like(redacted_db, session_id, source_db, source_id, outputs):
    """Same shape (lengths, finish reasons, shared prefixes), nothing equal beyond chance, turn 2 still
    starting with turn 1 and its answer."""
    assert shape(redacted_db, session_id) == shape(source_db, source_id)
    assert shape(redacted_db, session_id)["decode_errors"] == 0
    prompts, redacted_outputs = tokens_of(redacted_db, session_id)
    turn_1 = prompts[0] + redacted_outputs[0]
    assert prompts[1][:len(turn_1)] == turn_1
    originals = [t for o in outputs for t in o]
    same = sum(a == b for a, b in zip(originals, [t for o in redacted_outputs for t in o]))
    assert same <= 2  # ~20 tokens of a 900-token vocabulary: one in 45 by chance


RELEASES = pytest.mark.parametrize("release", ["0.32.0", "0.34.0"])  # a prompt array from 0.34.0 on


def both(release: str) -> dict:
    return {"frontend_release": release, "engine_release": release}


@RELEASES
def test_record_time_redaction_writes_nothing_unredacted_and_forwards_untouched(tmp_path, key_file, release):
    db = tmp_path / "recording.db"
    prompts, outputs, session = trio.run(lambda: record(db, redaction=settings(key_file), **both(release)))
    recorder = session.recorder
    assert outputs[0] == [token_at(prompts[0], None, i) for i in range(6)]  # the frontend got the real tokens
    row = sqlite_utils.Database(db)["sessions"].get(recorder.session_id)
    redaction = Redaction(settings(key_file))
    assert (row["redaction_key"], row["redaction_policy"]) == (redaction.key.fingerprint, redaction.policy.digest)
    dropped = json.loads(row["redaction_counts"])["dropped"]
    assert {"SamplingParams.stop", "SamplingParams.structured_outputs", "EngineCoreRequest.trace_headers"} <= \
        dropped.keys()
    assert row["status"] == "complete" and row["frames_dropped"] == 0
    assert_nothing_leaks(db, prompts, outputs, [session.relay.upstream, session.relay.listen])
    prompts_seen, outputs_seen = tokens_of(db, recorder.session_id)
    assert [len(p) for p in prompts_seen] == [len(p) for p in prompts]
    assert prompts_seen[1][:len(prompts_seen[0]) + 6] == prompts_seen[0] + outputs_seen[0]


@RELEASES
def test_redacting_after_the_fact_keeps_the_shape_and_nothing_else(tmp_path, key_file, release):
    source, out = tmp_path / "staging.db", tmp_path / "ci.db"
    prompts, outputs, session = trio.run(lambda: record(source, **both(release)))
    assert len(leaks(source, prompts, SECRETS)) == len(prompts) + len(SECRETS)  # the scan finds what is there
    [(name, session_id, frames)] = redact_database(source, out, Redaction(settings(key_file)))
    assert (name, frames) == ("test", sqlite_utils.Database(source)["sessions"].get(1)["frames_recorded"])
    assert_nothing_leaks(out, prompts, outputs)
    assert_redacted_like(out, session_id, source, session.recorder.session_id, outputs)
    [call] = sqlite_utils.Database(out).query(
        "SELECT method, args FROM utility_requests WHERE method = 'collective_rpc'")
    assert json.loads(call["args"])[0].startswith("h-")


def test_one_key_gives_the_same_pseudonyms_across_sessions_and_another_key_others(tmp_path, key_file):
    source = tmp_path / "staging.db"
    trio.run(lambda: record(source, name="monday"))
    trio.run(lambda: record(source, name="tuesday"))
    other_key = tmp_path / "other.key"
    other_key.write_bytes(os.urandom(32))
    redact_database(source, tmp_path / "a.db", Redaction(settings(key_file)))
    redact_database(source, tmp_path / "b.db", Redaction(settings(other_key)))
    monday, tuesday = tokens_of(tmp_path / "a.db", 1), tokens_of(tmp_path / "a.db", 2)
    assert monday[0] == tuesday[0] and monday[1][:3] == tuesday[1][:3]  # the aborted request's length varies
    other = tokens_of(tmp_path / "b.db", 1)
    assert all(common_prefix(a, b) < 3 for a, b in zip(monday[0], other[0]))


@pytest.mark.parametrize("at_record_time", [True, False])
def test_default_deny_blanks_a_field_no_release_has_and_its_value_reaches_no_byte(tmp_path, key_file,
                                                                                  at_record_time):
    marker = "MARKER-of-a-drifted-engine"
    source = tmp_path / "staging.db"
    options = {"engine_drift": EngineDrift(append_outputs_field=True, appended_value=marker)}
    trio.run(lambda: record(source, **options, **(
        {"redaction": settings(key_file)} if at_record_time else {})))
    db = source
    if not at_record_time:
        assert leaks(source, [], [marker]) == [marker]
        db = tmp_path / "ci.db"
        redact_database(source, db, Redaction(settings(key_file)))
    assert leaks(db, [], [marker]) == []
    database = sqlite_utils.Database(db)
    blanked = json.loads(database["sessions"].get(1)["redaction_counts"])["blanked"]
    assert blanked["EngineCoreOutputs[9]"] > 0
    # The drift itself stays visible: a trailing position, now nil.
    [alarm] = database.query("SELECT struct, issue, position, got FROM drift_alarms")
    assert alarm == {"struct": "EngineCoreOutputs", "issue": "extra_position", "position": 9, "got": "nil"}


def test_a_frame_that_does_not_decode_is_forwarded_as_it_was_and_recorded_blank(tmp_path, key_file):
    db = tmp_path / "recording.db"
    garbage = [b"\x09", b"\xc1 acme-secret-in-garbage"]

    async def main():
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                session = await RecordedSession(nursery, db, redaction=settings(key_file)).start()
                await session.frontend.inputs[0].send([engine_identity(0), *garbage])
                while not session.engines[0].received:
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
        session.recorder.close()
        return session.engines[0].received

    assert trio.run(main) == [(0, garbage)]
    assert leaks(db, [], ["acme-secret-in-garbage"]) == []
    database = sqlite_utils.Database(db)
    [frame] = frames_with_bytes(database.conn, "kind = 'UNKNOWN'")
    assert frame["parts"] == [b"", b""]
    assert json.loads(database["sessions"].get(1)["redaction_counts"])["blanked"] == {"frame (ValueError)": 1}


@RELEASES
def test_a_redacted_session_replays_against_an_engine_with_its_lengths_held(tmp_path, key_file, release):
    source, db = tmp_path / "staging.db", tmp_path / "ci.db"
    trio.run(lambda: record(source, name="baseline", **both(release)))
    redact_database(source, db, Redaction(settings(key_file)))
    listen = f"tcp://127.0.0.1:{free_port()}"
    peer = PeerUnderTest(side=Side.ENGINE, address=listen, command=engines_command(listen, release=release))
    options = ReplayOptions(pace="fast", ready_timeout_s=20, finish_timeout_s=10, report_dir=tmp_path,
                            hold_lengths=True)
    report, outcome = replay_session(db, "baseline", peer, options)
    codes = {f.code for f in report.findings}
    assert {"redacted_recording", "lengths_held"} <= codes
    assert [f for f in report.findings if f.severity >= Severity.WARNING and f.category != "performance"] == []
    recorded, replayed = (shape(db, 1)["outputs"], shape(db, 2)["outputs"])
    # Each asked for its own length; the aborted one (last) has its ABORT land where it did in the recording (what
    # the engine made after it, before it read the ABORT, is its timing's: under load, more).
    assert [tokens for tokens, _ in replayed[:2]] == [tokens for tokens, _ in recorded[:2]]
    landed = [sqlite3.connect(db).execute("SELECT tokens_before_abort FROM abort_progress WHERE session_id = ?",
                                          [session_id]).fetchall() for session_id in (1, 2)]
    assert landed[0] == landed[1] and landed[0] != []


@pytest.mark.parametrize("arguments, error, code", [  # 1: a key file that cannot be used; 2: the arguments
    (["--vocab-size", "900", "--key-file", "short.key"], "needs 16 or more", 1),
    (["--key-file", "redaction.key"], "Missing option '--vocab-size'", 2),
    (["--vocab-size", "900", "--key-file", "redaction.key", "--out", "in.db"], "never in place", 2),
    (["--vocab-size", "900", "--key-file", "missing.key"], "cannot read the redaction key", 1),
])
def test_redact_refuses_what_it_cannot_do_in_one_line(tmp_path, key_file, arguments, error, code):
    (tmp_path / "short.key").write_bytes(b"0123")
    sqlite_utils.Database(tmp_path / "in.db")["sessions"].insert({"id": 1, "name": "x"})
    arguments = [str(tmp_path / a) if a.endswith((".key", ".db")) else a for a in arguments]
    if "--out" not in arguments:
        arguments += ["--out", str(tmp_path / "out.db")]
    done = subprocess.run([sys.executable, "-m", "replay_proxy", "redact", "--db", str(tmp_path / "in.db"),
                           *arguments], capture_output=True, text=True, timeout=60)
    assert done.returncode == code and error in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out.db").exists()


def test_a_redactor_that_dies_is_reported_and_counted_and_forwarding_goes_on(tmp_path, key_file):
    db = tmp_path / "recording.db"

    async def run():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                session = await RecordedSession(nursery, db, redaction=settings(key_file)).start()
                frontend = session.frontend
                await frontend.add("before", [1, 2, 3], max_tokens=4, temperature=0.0)
                await frontend.wait_for(lambda: "before" in frontend.finish_reasons)
                while session.recorder.statistics().frames_recorded == 0:  # (within the fail_after)
                    await trio.sleep(0.05)
                redactor = session.recorder.writer.redactor
                os.kill(redactor.pid, signal.SIGKILL)
                await trio.to_thread.run_sync(redactor.wait, 10)
                await frontend.add("after", [4, 5, 6], max_tokens=4, temperature=0.0)
                await frontend.wait_for(lambda: "after" in frontend.finish_reasons)
                nursery.cancel_scope.cancel()
        return session

    session = trio.run(run)
    stats = session.recorder.close()
    assert session.frontend.tokens["after"] == [token_at([4, 5, 6], None, i) for i in range(4)]  # forwarded
    assert stats.final and stats.error == "the redactor process exited with -9 while recording"
    assert stats.frames_dropped > 0 and stats.frames_seen == stats.frames_recorded + stats.frames_dropped
    row = sqlite_utils.Database(db)["sessions"].get(session.recorder.session_id)
    assert (row["status"], row["error"]) == ("incomplete", stats.error)  # the writer ended it, with what came
    assert row["frames_recorded"] > 0 and row["frames_dropped"] == stats.frames_dropped
