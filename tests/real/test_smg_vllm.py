"""smg 1.13.0, a third-party frontend (PyPI smg, in its EngineCore mode): through ``replay-proxy record`` to a real
0.32.0 engine its users get every answer, the session names smg, and ``readers`` says what a 0.32.0 engine
fills in of what smg sends, and which floats smg rounded; as the frontend under test of a replay, it is sent
the recorded prompts as text."""

import json
import shlex

import pytest
import sqlite_utils

from replay_proxy import peers as real
from replay_proxy.peers import SMG, SMG_READY
from replay_proxy.processes import free_port
from tests.helpers import cli
from tests.real import peers, workload

pytestmark = pytest.mark.real_vllm


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    logs = tmp_path_factory.mktemp("smg")
    seen = peers.run_pair(logs, peers.smg_frontend, logs / "rec.db", "smg", work=workload.clients,
                          upstream=real.handshake_port(peers.SMG_FRONTEND), proxy_flags=("--frontend", f"smg=={SMG}"),
                          ready_path=SMG_READY)
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


def test_replaying_the_python_frontends_engine_to_smg_sends_prompts_as_text_and_names_what_smg_does_otherwise(
        tmp_path):
    """smg takes no token-id prompts: the player sends the recorded ones as text, matches smg's requests token
    for token, and compares what users got as text (smg returns no token ids). What is left is smg's own: it
    does not abort a request whose client left while the engine sends nothing (it notices a client gone when it
    next writes to it), and compatible differences (EOS among the stop ids, float32 values, 21 elements)."""
    rpc, http = real.handshake_port(peers.SMG_FRONTEND), free_port()
    done = cli("replay", "--db", str(peers.RECORDING), "--session", "python-frontend", "--against", "frontend",
               "--upstream", f"tcp://127.0.0.1:{rpc}", "--http", f"http://127.0.0.1:{http}", "--frontend-cmd",
               shlex.join(real.frontend_argv(peers.SMG_FRONTEND, http, rpc)), "--pace", "fast", "--report-dir",
               str(tmp_path), "--json", timeout=peers.REPLAY_S)
    report = json.loads(done.stdout)
    regressions = [(f["code"], f.get("request_id")) for f in report["findings"] if f["severity"] == "regression"]
    assert regressions == [("abort_mismatch", "cmpl-b310a13e995da053-0-9d95c780")], done.stderr
    assert done.returncode == 4
    codes = {f["code"]: f["severity"] for f in report["findings"]}
    assert codes["prompt_as_text"] == "info" and codes["sampling_key_eos_named"] == "info"
    assert [v["passed"] for v in report["verdicts"] if v["tier"] == "exact"] == [True] * 5


def test_can_i_deploy_verifies_smg_with_a_0_32_0_engine_both_ways(tmp_path):
    """The cell observed: smg's recording replayed against a real 0.32.0 engine, and that engine's recording
    replayed against smg (its prompts as text)."""
    done = cli("can-i-deploy", "--frontend", f"smg=={SMG}", "--engine", "vllm==0.32.0", "--verify", "--report-dir",
               str(tmp_path), "--json", timeout=2 * peers.REPLAY_S)
    answer = json.loads(done.stdout)
    assert (done.returncode, answer["verdict"]) == (0, "works"), done.stdout + done.stderr
    [kind] = answer["kinds"]
    assert kind["source"] == "verified now: observed by real peers"
    assert {e["direction"] for e in kind["evidence"]} == {"to_engine", "to_frontend"}
