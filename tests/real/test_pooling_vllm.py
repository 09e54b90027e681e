"""Pooling through the proxy, against real vLLM 0.32.0: the tiny model served as an embedding model.

Embedding and score requests go through PoolingParams in the ADD and come back as pooling_output tensors
in aux frames. Recorded, each tensor is the embedding the user got, value by value, and every value is
what vLLM's own decoder reads from the same frames; replayed against a same-release engine, every request
is served again; replayed against a same-release frontend, each user gets the recorded embedding, and an
embedding the frontend is sent otherwise is found.
"""

import functools
import json
import sqlite3

import pytest

from replay_proxy.processes import free_port
from tests.real import peers, workload
from tests.real.vllm_reads import read_as_vllm_does

pytestmark = pytest.mark.real_vllm

POOLING_FRONTEND = functools.partial(peers.python_frontend, serving=peers.POOLING)


@pytest.fixture(scope="module")
def pooling_recorded(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pooling")
    seen = peers.run_pair(logs, POOLING_FRONTEND, logs / "pooling.db", "pooling", work=workload.pooling,
                          serving=peers.POOLING)
    return seen, logs / "pooling.db"


def test_each_embedding_the_user_got_is_the_recorded_pooling_output_as_vllm_reads_it(pooling_recorded):
    seen, db = pooling_recorded
    assert [d["index"] for d in seen["score"]["data"]] == [0, 1], seen["score"]
    named = read_as_vllm_does(db)  # every ADD, utility call and output equal to vLLM 0.32.0's reading
    adds = [fields for kind, fields in named if kind == "ADD"]
    assert len(adds) == 5 and {a["pooling_params"]["task"] for a in adds} == {"embed"}
    assert all(a["sampling_params"] is None for a in adds)
    tensors = {o["request_id"]: o["pooling_output"] for kind, fields in named if kind == "OUTPUTS"
               for o in fields.get("outputs") or []}
    got = [d["embedding"] for d in seen["embeddings"]["data"]]
    order = [a["request_id"] for a in adds[:2]]  # the embeddings request's two texts, in order
    assert [tensors[rid].values for rid in order] == got  # float32 on the wire, the same floats in the JSON
    assert {t.dtype for t in tensors.values()} == {"float32"} and all(t.aux_frame for t in tensors.values())
    connection = sqlite3.connect(db)
    errors = connection.execute("SELECT COUNT(*) FROM frames WHERE decode_error IS NOT NULL OR flags IS NOT NULL")
    assert errors.fetchone() == (0,)


def test_the_pooling_session_replays_against_a_0_32_0_pooling_engine(pooling_recorded, tmp_path):
    _, db = pooling_recorded
    port = free_port()
    result, report = peers.replay_cli(tmp_path, "--against", "engine", "--listen", f"tcp://127.0.0.1:{port}",
                                      "--engine-cmd", peers.engine_command(port, "0.32.0", serving=peers.POOLING),
                                      recording=db, session="pooling")
    findings = [f for f in report["findings"] if f["severity"] != "info" and f["category"] != "performance"]
    assert result.returncode in (0, 5) and findings == [], result.stdout[-3000:]  # 5: timing, never judged here


def test_a_0_32_0_pooling_frontend_gives_its_users_the_recorded_embeddings(pooling_recorded, tmp_path):
    _, db = pooling_recorded
    http, rpc = free_port(), free_port()
    frontend = peers.command(peers.python_frontend_argv(http, rpc), serving=peers.POOLING)
    result, report = peers.replay_cli(tmp_path, "--against", "frontend", "--upstream", f"tcp://127.0.0.1:{rpc}",
                                      "--http", f"http://127.0.0.1:{http}", "--frontend-cmd", frontend,
                                      recording=db, session="pooling")
    # Every pooling request asked again as an embedding of its prompt, each value compared with the recording
    # (tests/replay/test_pooling_replay.py: a value that differs is found).
    findings = [f for f in report["findings"] if f["severity"] != "info" and f["category"] != "performance"]
    assert findings == [] and result.returncode in (0, 5), result.stdout[-3000:]
    connection = sqlite3.connect(tmp_path / "replay.db")
    sent = [json.loads(d) for (d,) in connection.execute(
        "SELECT f.decoded FROM frames f JOIN sessions s ON s.id = f.session_id WHERE s.name != 'pooling' AND "
        "f.kind = 'ADD'")]
    connection.close()
    assert len(sent) == 5 and all(a["pooling_params"]["task"] == "embed" for a in sent), sent
