"""`replay-proxy shrink` against a real frontend: a staging session down to the one request that breaks it.

The session (recordings/vllm-0.32.0-staging.db, `scripts/make_recordings.py --staging`) is 30 users
recorded by our recorder between the Python frontend and a real 0.32.0 engine. vllm-rs 0.31.0 reads an
EngineCoreOutputs of 8 elements; 0.32.0 sends 9 (weight_version), so every request it serves from that
engine fails with its reader's decode error.
"""

import json
import shutil
import sqlite3
import subprocess
import sys

import pytest

from tests.real import peers

pytestmark = pytest.mark.real_vllm
STAGING = peers.RECORDINGS / "vllm-0.32.0-staging.db"
FRONTEND = peers.command(peers.rust_frontend_argv("{http}", "{rpc}", "0.31.0"))  # (shrink fills in free ports)
TIMEOUTS = ("--ready-timeout", str(peers.READY_TIMEOUT_S), "--finish-timeout", "60")


def test_a_staging_session_shrinks_to_one_request_that_breaks_vllm_rs_0_31_0_again(tmp_path):
    source = tmp_path / "staging.db"
    shutil.copy(STAGING, source)
    requests = sqlite3.connect(source).execute("SELECT COUNT(DISTINCT request_id) FROM requests").fetchone()[0]
    assert requests == 30
    out = tmp_path / "shrunk"
    result = subprocess.run([sys.executable, "-m", "replay_proxy", "shrink", "--db", str(source), "--session",
                             "staging", "--out", str(out), "--against", "frontend", "--frontend-cmd", FRONTEND,
                             "--pace", "10", "--jobs", "2", *TIMEOUTS], capture_output=True, text=True,
                            timeout=40 * peers.REPLAY_S)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "shrink.json").read_text())
    # It chased the cause, the reader's rejection, not the HTTP failures that follow from it ...
    finding = summary["finding"]
    assert (finding["code"], finding["struct"], finding["field"], finding["position"]) == (
        "reader_rejected", "EngineCoreOutputs", "weight_version", 8)
    assert summary["requests"] == {"before": 30, "after": 1} and summary["minimal"], summary
    assert summary["replays"] <= 40
    # ... and the one-request session it wrote breaks the same reader again, alone.
    [kept] = summary["kept"]
    shrunk = sqlite3.connect(out / "shrunk.db")
    assert shrunk.execute("SELECT request_id FROM requests").fetchall() == [(kept,)]
    http, rpc = peers.free_port(), peers.free_port()
    again, report = peers.replay_cli(
        tmp_path / "again", "--against", "frontend", "--pace", "10", "--upstream", f"tcp://127.0.0.1:{rpc}",
        "--http", f"http://127.0.0.1:{http}", "--frontend-cmd",
        peers.command(peers.rust_frontend_argv(http, rpc, "0.31.0")), recording=out / "shrunk.db", session="staging")
    assert again.returncode == 3, again.stdout + again.stderr
    [rejected] = [f for f in report["findings"] if f["severity"] == "breaking"]
    assert (rejected["code"], rejected["struct"], rejected["position"]) == ("reader_rejected", "EngineCoreOutputs", 8)
