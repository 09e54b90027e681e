"""LoRA through the proxy, against real vLLM 0.32.0 and 0.31.0.

A user loads an adapter through the frontend's API (an ``add_lora`` utility call whose argument is a
LoRARequest) and names it in a request (an ADD carrying that LoRARequest). Recorded, every value is what
vLLM 0.32.0's own decoder reads from the same frames; replayed against a 0.32.0 engine, nothing differs;
played to a 0.32.0 frontend, it loads the adapter through its API and names it, as the recorded user did.
And the cells whose verdict changes by kind: vLLM 0.32.0 removed ``LoRARequest.tensorizer_config_dict``
(position 4), so a 0.32.0 frontend with a 0.31.0 engine serves completions and breaks every LoRA
request, live and as the matrix observes it, and so does a 0.31.0 frontend with a 0.32.0 engine, live:
each where the matrix predicts it from the shipped LoRA recordings (recordings/vllm-X-python-lora.db).
"""

import functools
import json
import sqlite3
import subprocess
import sys

import pytest
import sqlite_utils

from replay_proxy.matrix import RECORDINGS, Frontend, Verdict
from replay_proxy.matrix.predict import predict
from replay_proxy.processes import free_port
from tests.real import peers, workload
from tests.real.vllm_reads import read_as_vllm_does

pytestmark = pytest.mark.real_vllm

LORA_FRONTEND = functools.partial(peers.python_frontend, serving=peers.LORA)
CLI = [sys.executable, "-m", "replay_proxy"]
COMPLAINT = "Expected `object | null`, got `bool` - at `$[4]`"  # a 0.31.0 engine, of 0.32.0's LoRARequest


@pytest.fixture(scope="module")
def lora_recorded(tmp_path_factory):
    logs = tmp_path_factory.mktemp("lora")
    seen = peers.run_pair(logs, LORA_FRONTEND, logs / "lora.db", "lora", work=workload.lora,
                          serving=peers.LORA)
    return seen, logs / "lora.db"


def rows(db, sql):
    connection = sqlite3.connect(db)
    try:
        return connection.execute(sql).fetchall()
    finally:
        connection.close()


def test_the_adapter_is_loaded_through_the_api_named_in_a_request_and_recorded_by_name(lora_recorded):
    seen, db = lora_recorded
    assert seen["load"].startswith("Success") and isinstance(seen["adapter"], str), seen
    assert seen["adapter"] != seen["base"], seen  # the adapter's random weights change the greedy text
    assert rows(db, "SELECT COUNT(*) FROM frames WHERE decode_error IS NOT NULL OR flags IS NOT NULL") == [(0,)]
    [(args,)] = rows(db, "SELECT args FROM utility_requests WHERE method = 'add_lora'")
    adapter = {"lora_name": "tiny-lora", "lora_int_id": 1, "lora_path": "tiny-lora"}  # relative: any machine's
    assert json.loads(args)[0].items() >= adapter.items(), args
    named = [json.loads(d)["lora_request"] for (d,) in rows(db, "SELECT decoded FROM frames WHERE kind = 'ADD'")
             if d and "lora_request" in json.loads(d)]  # (null: every field of the ADD is in requests)
    assert len(named) == 1 and named[0].items() >= adapter.items(), named
    [(failure,)] = rows(db, "SELECT failure_message FROM utility_calls WHERE method = 'add_lora'")
    assert failure is None


def test_every_value_recorded_is_what_vllm_0_32_0s_own_decoder_reads(lora_recorded):
    _, db = lora_recorded
    assert {kind for kind, _ in read_as_vllm_does(db)} == {"ADD", "UTILITY", "OUTPUTS"}


def test_the_lora_session_replays_against_a_0_32_0_engine_with_nothing_changed(lora_recorded, tmp_path):
    _, db = lora_recorded
    port = free_port()
    result, report = peers.replay_cli(tmp_path, "--against", "engine", "--listen", f"tcp://127.0.0.1:{port}",
                                      "--engine-cmd", peers.engine_command(port, "0.32.0", serving=peers.LORA),
                                      recording=db, session="lora")
    # Nothing of the link: tokens may diverge (vLLM's CPU build does not reproduce batched greedy requests, seen
    # here once at position 5 of 6), and timing is never judged here.
    schema = [f for f in report["findings"] if f["category"] == "schema" or f["severity"] == "breaking"]
    assert result.returncode in (0, 4, 5) and schema == [], result.stdout[-3000:]


def test_a_0_32_0_frontend_loads_the_adapter_and_names_it_as_the_recorded_user_did(tmp_path):
    # The engine's side of the shipped LoRA session played to a real frontend: the recorded load goes through
    # the frontend's API (its add_lora call answered from the recording), then the request names the adapter.
    http, rpc = free_port(), free_port()
    frontend = peers.command(peers.python_frontend_argv(http, rpc), serving=peers.LORA)
    result, report = peers.replay_cli(tmp_path, "--against", "frontend", "--upstream", f"tcp://127.0.0.1:{rpc}",
                                      "--http", f"http://127.0.0.1:{http}", "--frontend-cmd", frontend,
                                      recording=RECORDINGS / "vllm-0.32.0-python-lora.db")
    findings = [f for f in report["findings"] if f["severity"] != "info" and f["category"] != "performance"]
    assert findings == [] and result.returncode in (0, 5), result.stdout[-3000:]
    replayed = "FROM frames f JOIN sessions s ON s.id = f.session_id WHERE s.name != 'python-frontend' AND "
    [(args,)] = rows(tmp_path / "replay.db", f"SELECT json_extract(f.decoded, '$.args') {replayed} "
                                             "json_extract(f.decoded, '$.method') = 'add_lora'")
    assert json.loads(args)[0]["lora_path"] == "tiny-lora", args
    named = [json.loads(d or "{}").get("lora_request") for (d,) in rows(tmp_path / "replay.db",
                                                                        f"SELECT f.decoded {replayed} f.kind = 'ADD'")]
    assert [n and n["lora_name"] for n in named] == [None, "tiny-lora"], named


def test_a_0_31_0_engine_serves_0_32_0s_completions_and_breaks_its_lora_requests(lora_recorded, tmp_path):
    # Live, through the recorder: the completion is served, the adapter cannot be loaded.
    logs = tmp_path / "live"
    logs.mkdir()
    seen = peers.run_pair(logs, LORA_FRONTEND, logs / "cross.db", "cross", engine_release="0.31.0",
                          work=workload.lora, serving=peers.LORA)
    assert isinstance(seen["base"], str) and not seen["base"].startswith("HTTP"), seen
    assert seen["load"].startswith("HTTP 500") and COMPLAINT in seen["load"], seen
    [(failure,)] = rows(logs / "cross.db", "SELECT failure_message FROM utility_calls WHERE method = 'add_lora'")
    assert COMPLAINT in failure  # the evidence is on the wire: the engine's answer to the call
    # Observed by the matrix, each kind by two replays of its own shipped recordings (its LoRA adapter named
    # by a path relative to the peers' folder: this cache is not the recording machine's): the LoRA
    # session's call and ADD break the reader on LoRARequest where predicted; completions do not break.
    out = tmp_path / "matrix"
    result = subprocess.run([*CLI, "matrix", "--frontends", "vllm:0.32.0", "--engines", "0.31.0", "--db",
                             str(out / "m.db"), "--report-dir", str(out), "--ready-timeout",
                             str(peers.READY_TIMEOUT_S)], capture_output=True, text=True, timeout=4 * peers.REPLAY_S)
    assert result.returncode == 0, result.stdout + result.stderr
    [cell] = json.loads((out / "matrix.json").read_text())
    rejected = {(e.get("kind", "completion"), e["direction"], e["struct"], e["field"])
                for e in cell["observed"]["evidence"] if e.get("rule") == "reader_rejected"}
    assert rejected == {("lora", "to_engine", "LoRARequest", "load_inplace")}, cell["observed"]["evidence"]
    by_kind = json.loads(sqlite_utils.Database(out / "m.db")["matrix_cells"].get(("vllm:0.32.0", "0.31.0"))["by_kind"])
    assert by_kind["lora"] == "breaks" and by_kind["completion"] != "breaks" and cell["agrees"] is True, by_kind


def predicted_lora_breaks(frontend: str, engine: str) -> set[tuple[str, str, int | None]]:
    """The matrix's predicted breaks of a cell's LoRA requests, from the shipped recordings, and that it
    predicts its completions work."""
    judgement = predict(Frontend("vllm", frontend), engine, RECORDINGS)
    assert judgement.verdict_for("completion") is Verdict.WORKS
    return {(e.struct, e.field, e.position) for e in judgement.evidence
            if e.kind == "lora" and e.verdict is Verdict.BREAKS and e.rule == "changed_type"}


def test_the_matrix_predicts_both_lora_breaks_where_the_engines_refuse(tmp_path):
    # 0.32.0 -> 0.31.0 is observed above; here 0.31.0 -> 0.32.0, live: its LoRARequest's position 4 is
    # tensorizer_config_dict (None), which a 0.32.0 engine reads as load_inplace (a bool).
    assert predicted_lora_breaks("0.32.0", "0.31.0") == {("LoRARequest", "tensorizer_config_dict", 4)}
    assert predicted_lora_breaks("0.31.0", "0.32.0") == {("LoRARequest", "load_inplace", 4)}
    seen = peers.run_pair(tmp_path, functools.partial(LORA_FRONTEND, release="0.31.0"), tmp_path / "old.db", "old",
                          engine_release="0.32.0", work=workload.lora, serving=peers.LORA)
    assert isinstance(seen["base"], str) and not seen["base"].startswith("HTTP"), seen
    assert seen["load"].startswith("HTTP 500") and "Expected `bool`, got `null` - at `$[4]`" in seen["load"], seen
