"""Replay against a frontend, with sim peers: the sim frontend's HTTP API is driven as users did.

The recording is made the same way: HTTP requests to a sim frontend whose
engine traffic goes through the recording relay to a sim engine.
"""

import functools
import json
import shlex
import shutil
import sys

import pytest
import sqlite_utils
import trio

from replay_proxy.compare.findings import Severity, exit_code
from replay_proxy.errors import ExitCode
from replay_proxy.processes import free_port
from replay_proxy.replay.play_engine import completion
from replay_proxy.replay.player import PeerUnderTest, ReplayOptions
from replay_proxy.replay.run import replay_session
from replay_proxy.sim.api import serve_api
from replay_proxy.wire.messages import Side
from tests.helpers import RecordedSession

FRONTEND = [sys.executable, "-m", "replay_proxy", "sim", "frontend"]
REQUESTS = [  # (sampling parameters, stream, disconnect after this many tokens)
    ({"max_tokens": 5, "temperature": 0.0}, False, None),
    ({"max_tokens": 6, "temperature": 0.0}, True, None),
    ({"max_tokens": 4, "temperature": 0.8, "seed": 7}, False, None),
    ({"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}, True, None),
    ({"max_tokens": 10_000, "temperature": 0.0}, True, 3),  # the user gives up: the frontend aborts
]


async def _record(db):
    with trio.fail_after(30):
        await _record_requests(db)


async def _record_requests(db):
    async with trio.open_nursery() as nursery:
        session = await RecordedSession(nursery, db, name="http").start()
        port = await nursery.start(serve_api, session.frontend)
        for k, (params, stream, disconnect_after) in enumerate(REQUESTS):
            body = {"model": "sim", "prompt": [5, 6, k], "return_token_ids": True, **params}
            seen = await trio.to_thread.run_sync(functools.partial(
                completion, f"http://127.0.0.1:{port}/v1/completions", body, stream, disconnect_after, 10))
            assert seen.token_ids and seen.error is None
        await session.frontend.wait_for(lambda: session.frontend.aborted)  # the disconnect seen, the ABORT sent
        while session.frontend.aborted & session.engines[0].running.keys():  # ... and through the relay
            await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    session.recorder.close()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    db = tmp_path_factory.mktemp("recorded") / "http.db"
    trio.run(_record, db)
    return db


def replay(tmp_path, recorded, drift=None):
    db = tmp_path / "replay.db"
    shutil.copy(recorded, db)
    handshake, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    command = [*FRONTEND, "--handshake", handshake, "--http-port", str(port)]
    command += ["--drift", json.dumps(drift)] if drift else []
    peer = PeerUnderTest(side=Side.FRONTEND, address=handshake, http=f"http://127.0.0.1:{port}",
                         command=shlex.join(command))
    options = ReplayOptions(pace="fast", ready_timeout_s=20, finish_timeout_s=5, report_dir=tmp_path)
    report, outcome = replay_session(db, "http", peer, options)
    return report, outcome, db


def test_the_recorded_frontend_itself_gives_no_findings_and_its_users_get_the_recorded_tokens(tmp_path, recorded):
    report, outcome, db = replay(tmp_path, recorded)
    timeless = [f for f in report.findings if f.category != "performance"]  # tests never judge wall time
    assert [f for f in timeless if f.severity >= Severity.WARNING] == []
    recorded_tokens = {row["request_id"]: row["tokens"] for row in sqlite_utils.Database(recorded).query(
        "SELECT request_id, tokens FROM request_timeline WHERE NOT frontend_aborted")}
    assert sorted(len(seen.token_ids) for rid, seen in outcome.http.items() if rid in recorded_tokens) == sorted(
        recorded_tokens.values())
    # The replayed session has the same ADDs, the ABORT after the disconnect and the start-up utility call.
    kinds = {row["kind"]: row["n"] for row in sqlite_utils.Database(db).query(
        "SELECT kind, COUNT(*) AS n FROM frames WHERE session_id = 2 GROUP BY kind")}
    assert (kinds["ADD"], kinds["ABORT"], kinds["UTILITY"], kinds["REGISTRATION"]) == (5, 1, 1, 1)
    # The proxy held the aborted request where the recorded ABORT crossed: this frontend's ABORT lands there too.
    [landed] = [f for f in report.findings if f.code == "abort_landed"]
    assert landed.baseline == landed.candidate >= 3


@pytest.mark.parametrize("drift, code, expected", [
    ({"insert_request_field": 5}, ExitCode.SCHEMA_BREAKING, {("field_inserted", "EngineCoreRequest")}),
    ({"add_sampling_key": "temperature_v2"}, ExitCode.OK, {("sampling_key_unknown", "SamplingParams")}),
    ({"rename_sampling_key": ["max_tokens", "max_tokenz"]}, ExitCode.BEHAVIOUR,
     {("sampling_key_unknown", "SamplingParams"), ("request_unexpected", None)}),
])
def test_each_frontend_drift_is_caught(tmp_path, recorded, drift, code, expected):
    report, _, _ = replay(tmp_path, recorded, drift)
    timeless = [f for f in report.findings if f.category != "performance"]
    assert expected <= {(f.code, f.struct) for f in timeless if f.severity >= Severity.WARNING}
    assert exit_code(timeless) is code


def test_a_frontend_that_rejects_the_recorded_registration_is_named_as_the_schema_break_not_waited_for(
        tmp_path, recorded):
    report, outcome, _ = replay(tmp_path, recorded, {"require_registration_key": "kv_connector"})
    # Its reader's complaint is the finding: a break of the registration, on the key it names (exit 3) ...
    [finding] = report.findings
    assert (finding.code, finding.severity, outcome) == ("reader_rejected", Severity.BREAKING, None)
    assert (finding.struct, finding.field) == ("EngineCoreReadyResponse", "kv_connector")
    assert "missing required field `kv_connector`" in finding.message
    assert exit_code(report.findings) is ExitCode.SCHEMA_BREAKING
    # ... and the replay it stopped is its consequence, saying what the frontend had been sent.
    [stopped] = finding.consequences
    assert stopped.startswith("replay_failed: frontend under test exited")
    assert ("last messages sent to the frontend: HELLO (engine 0), REGISTRATION (engine 0, API server 0), "
            "READY (engine 0)") in stopped
