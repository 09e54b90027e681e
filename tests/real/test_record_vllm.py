"""`replay-proxy record` between real vLLM 0.32.0 peers: users see the same, the recording has it all.

Bring-ups run one after another (each ~40 s and ~3.5 GB); every process is
stopped by PID at the end of its fixture.
"""

import json

import pytest
import sqlite_utils

from tests.real import peers

pytestmark = pytest.mark.real_vllm


@pytest.fixture(scope="module")
def direct(tmp_path_factory):
    return peers.run_pair(tmp_path_factory.mktemp("direct"), peers.python_frontend)


@pytest.fixture(scope="module")
def python_recorded(tmp_path_factory):
    logs = tmp_path_factory.mktemp("python")
    seen = peers.run_pair(logs, peers.python_frontend, logs / "rec.db", "python")
    return seen, sqlite_utils.Database(logs / "rec.db")


@pytest.fixture(scope="module")
def rust_recorded(tmp_path_factory):
    logs = tmp_path_factory.mktemp("rust")
    seen = peers.run_pair(logs, peers.rust_frontend, logs / "rec.db", "rust")
    return seen, sqlite_utils.Database(logs / "rec.db")


DETERMINISTIC = ("completion", "chat", "stream", "seeded", "logprobs")


def test_python_frontend_sees_the_same_through_the_proxy(direct, python_recorded):
    seen, _ = python_recorded
    assert {k: seen[k] for k in DETERMINISTIC} == {k: direct[k] for k in DETERMINISTIC}


def greedy_tokens(db):
    """Engine token ids of the three greedy requests, in the order they were sent."""
    rows = db.query("""SELECT r.seq, o.new_token_ids FROM requests r
                       JOIN outputs o ON o.session_id = r.session_id AND o.request_id = r.request_id
                       ORDER BY r.seq, o.seq""")
    tokens = {}
    for row in rows:
        tokens.setdefault(row["seq"], []).extend(json.loads(row["new_token_ids"]))
    return list(tokens.values())[:3]


def test_rust_frontend_gets_the_same_greedy_tokens_through_the_proxy(direct, python_recorded, rust_recorded):
    seen, rust_db = rust_recorded
    # Greedy output is identical across the Python and Rust frontends (docs/real-vllm.md) ...
    assert greedy_tokens(rust_db) == greedy_tokens(python_recorded[1])
    assert [len(t) for t in greedy_tokens(rust_db)] == [8, 6, 6]
    # ... and so is the text, where no partial UTF-8 sequence ends a stream (vllm-rs
    # shows one as U+FFFD where the Python frontend holds the bytes back).
    for name in ("completion", "chat"):
        assert seen[name] == direct[name], name


@pytest.mark.parametrize("which", ["python", "rust"])
def test_recording_has_every_message_decoded_without_unknowns(which, python_recorded, rust_recorded):
    seen, db = python_recorded if which == "python" else rust_recorded
    kinds = {r["kind"]: r["n"] for r in db.query("SELECT kind, COUNT(*) AS n FROM frames GROUP BY kind")}
    assert {"HELLO", "INIT", "READY", "REGISTRATION", "ADD", "OUTPUTS"} <= set(kinds)
    assert "UNKNOWN" not in kinds
    problems = list(db.query("SELECT kind, decode_error, flags FROM frames "
                             "WHERE decode_error IS NOT NULL OR flags IS NOT NULL"))
    assert problems == []
    assert db["drift_alarms"].count == 0  # real same-release traffic: the live alarm stays silent
    session = next(db.query("SELECT * FROM sessions"))
    assert (session["status"], session["vllm_version"], session["schema_exact"]) == ("complete", "0.32.0", 1)
    assert session["frames_seen"] == session["frames_recorded"] > 0 and session["frames_dropped"] == 0
    registration = json.loads(next(db.query("SELECT payload FROM handshakes WHERE kind='REGISTRATION'"))["payload"])
    assert registration["vllm_version"] == "0.32.0" and registration["max_model_len"] == 256
    requests = list(db.query("SELECT * FROM requests ORDER BY seq"))
    # completion, chat, stream, seeded, logprobs, then the stream(s) the client closed early (workload.py)
    assert len(requests) == 5 + seen["abort_attempts"]
    assert [r["temperature"] for r in requests][:3] == [0.0, 0.0, 0.0]
    assert requests[3]["seed"] == 1234 and requests[0]["max_tokens"] == 8 and requests[4]["logprobs"] == 2
    timeline = {r["request_id"]: r for r in db.query("SELECT * FROM request_timeline")}
    finished = [r for r in timeline.values() if r["finish_reason"]]
    assert len(finished) >= 5 and all(r["tokens"] > 0 and r["ttft_ms"] > 0 for r in finished)
    # The client closed its last stream with the engine held still, so the frontend surely aborted it
    # (workload.py): exactly one ABORT, naming that request, and every other request finished.
    aborted = {r["request_id"] for r in db.query("SELECT request_id FROM aborts")}
    assert kinds["ABORT"] == len(aborted) == 1
    assert aborted == {requests[-1]["request_id"]}
    for request_id, row in timeline.items():
        assert row["frontend_aborted"] == (request_id in aborted)
        assert row["finish_reason"] or row["frontend_aborted"], request_id


def test_python_frontend_startup_utility_calls_are_recorded_with_results(python_recorded):
    _, db = python_recorded
    calls = {r["method"]: r for r in db.query("SELECT * FROM utility_calls")}
    assert {"reset_mm_cache", "get_supported_tasks"} <= set(calls)
    assert "generate" in calls["get_supported_tasks"]["result"]
    assert all(r["failure_message"] is None and r["answered_ns"] for r in calls.values())


def test_rust_frontend_sends_its_own_sampling_key_set(python_recorded, rust_recorded):
    keys = {}
    for which, (_, db) in (("python", python_recorded), ("rust", rust_recorded)):
        first = next(db.query("SELECT sampling_params FROM requests ORDER BY seq"))
        keys[which] = set(json.loads(first["sampling_params"]))
    # docs/real-vllm.md: the Rust frontend writes default keys Python omits.
    assert {"top_p", "top_k", "max_tokens", "min_p"} <= keys["rust"]
    assert keys["rust"] != keys["python"]
