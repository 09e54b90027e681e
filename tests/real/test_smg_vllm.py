"""smg 1.13.0, a third-party frontend (PyPI smg, in its EngineCore mode), through ``replay-proxy record`` to a real
0.32.0 engine: its users get every answer, the session names smg, and ``readers`` says what a 0.32.0 engine
fills in of what smg sends, and which floats smg rounded."""

import json

import pytest
import sqlite_utils

from replay_proxy.peers import SMG, SMG_READY
from tests.helpers import cli
from tests.real import peers, workload

pytestmark = pytest.mark.real_vllm


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    logs = tmp_path_factory.mktemp("smg")
    seen = peers.run_pair(logs, peers.smg_frontend, logs / "rec.db", "smg", work=workload.clients,
                          upstream=peers.smg_port(), proxy_flags=("--frontend", f"smg=={SMG}"), ready_path=SMG_READY)
    return seen, logs / "rec.db"


def test_every_request_is_answered_and_recorded_whole(recorded):
    seen, db = recorded
    assert {k: v for k, v in seen.items() if isinstance(v, str) and v.startswith("HTTP")} == {}, seen
    assert len(seen["n2"]) == 2 and seen["abort"], seen
    [session] = sqlite_utils.Database(db)["sessions"].rows
    assert (session["frontend_name"], session["frontend_version"], session["vllm_version"]) == ("smg", SMG, "0.32.0")
    assert (session["frames_dropped"], session["frames_undecoded"], session["drift_alarms"]) == (0, 0, 0)
    kinds = dict(sqlite_utils.Database(db).execute("SELECT kind, COUNT(*) FROM frames GROUP BY kind").fetchall())
    assert kinds["ADD"] == 8 and kinds["ABORT"] >= 1, kinds  # (n=2 is two requests: smg fans it out)


def test_readers_names_what_a_0_32_0_engine_fills_in_and_what_smg_rounded(recorded):
    _, db = recorded
    done = cli("readers", "--db", str(db), "--session", "smg", "--json")
    assert done.returncode == 0, done.stderr
    reading = json.loads(done.stdout)
    assert reading["frontend"] == f"smg=={SMG}" and reading["verdict"] == "works"
    own = next(r for r in reading["readings"] if r["engine"] == "0.32.0")
    assert [f["field"] for f in own["filled"]] == ["kv_hints"]
    assert {(r["field"], r["meant"]) for r in reading["rounded"]} >= {("top_p", "0.9"), ("temperature", "0.8")}
