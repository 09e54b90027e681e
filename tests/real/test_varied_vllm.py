"""The other shapes of request through the proxy, on each engine release the suite installs (0.32.0, 0.31.0).

A three-turn chat whose turns share their prefix, structured outputs in each of their four forms (a JSON
schema, a regex, a choice, a grammar) and a request of prompt embeds, all through the release's own
Python frontend (tests/real/workload.py ``varied``). Recorded, every frame decodes with no flag, every value
is what that release's own decoder reads from the same frames (the prompt embeds tensor value by value),
and the recording replays clean against a fresh engine of the same release. Played to a fresh frontend of the
same release, each structured-output request is asked for again as it was.
"""

import array
import functools
import json
import re
import sqlite3

import pytest

from tests.real import peers, workload
from tests.real.vllm_reads import read_as_vllm_does

pytestmark = pytest.mark.real_vllm

RELEASES = ("0.32.0", "0.31.0")


@pytest.fixture(scope="module", params=RELEASES)
def varied(request, tmp_path_factory):
    """(release, what the user saw, the recording, the prompt embeds' raw bytes as sent)."""
    release = request.param
    logs = tmp_path_factory.mktemp(f"varied-{release}")
    embeds, raw = workload.prompt_embeds(release)
    frontend = functools.partial(peers.python_frontend, release=release, flags=workload.PROMPT_EMBEDS)
    seen = peers.run_pair(logs, frontend, logs / "varied.db", "varied", engine_release=release,
                          work=functools.partial(workload.varied, embeds=embeds),
                          engine_flags=workload.PROMPT_EMBEDS)
    return release, seen, logs / "varied.db", raw


def test_each_shape_is_served_and_recorded_as_that_releases_decoder_reads_it(varied):
    release, seen, db, raw = varied
    for form, (_, allowed) in workload.STRUCTURED.items():
        text, finish = seen[form]
        assert finish == "stop" and re.fullmatch(allowed, text), (form, seen[form])
    assert len(seen["turns"]) == 3 and seen["embeds"][1] == "length", seen
    connection = sqlite3.connect(db)
    assert connection.execute("SELECT COUNT(*) FROM frames WHERE decode_error IS NOT NULL OR flags IS NOT NULL"
                              ).fetchone() == (0,)
    connection.close()
    adds = [fields for kind, fields in read_as_vllm_does(db, release) if kind == "ADD"]
    forms = workload.structured_forms(adds)
    assert forms == workload.STRUCTURED_ON_THE_WIRE, forms
    [embeds] = [a["prompt_embeds"] for a in adds if a.get("prompt_embeds") is not None]
    assert (embeds.dtype, embeds.values) == ("float32", array.array("f", raw).tolist())


def test_the_chats_later_turns_are_served_from_the_prefix_cache(varied):
    _, _, db, _ = varied
    connection = sqlite3.connect(db)
    hits = connection.execute("SELECT SUM(prefix_cache_hits) FROM scheduler_stats").fetchone()[0]
    connection.close()
    assert hits >= 2 * 128  # turns 2 and 3 each find at least the opening's first 128-token block


def test_the_varied_session_replays_clean_against_a_same_release_engine(varied, tmp_path):
    release, _, db, _ = varied
    port = peers.free_port()
    result, report = peers.replay_cli(tmp_path, "--against", "engine", "--listen", f"tcp://127.0.0.1:{port}",
                                      "--engine-cmd", peers.engine_command(port, release, workload.PROMPT_EMBEDS),
                                      recording=db, session="varied")
    findings = [f for f in report["findings"] if f["severity"] != "info" and f["category"] != "performance"]
    assert result.returncode in (0, 5) and findings == [], result.stdout[-3000:]  # 5: timing, never judged here


def test_a_same_release_frontend_asks_for_the_same_structured_outputs_and_its_users_get_the_recorded_text(
        varied, tmp_path):
    release, _, db, _ = varied
    http, rpc = peers.free_port(), peers.free_port()
    frontend = peers.command([*peers.python_frontend_argv(http, rpc, release=release), *workload.PROMPT_EMBEDS])
    result, report = peers.replay_cli(tmp_path, "--against", "frontend", "--upstream", f"tcp://127.0.0.1:{rpc}",
                                      "--http", f"http://127.0.0.1:{http}", "--frontend-cmd", frontend,
                                      recording=db, session="varied")
    connection = sqlite3.connect(tmp_path / "replay.db")
    asked = {"recorded": [], "replayed": []}
    for session, structured in connection.execute(
            "SELECT s.name, json_extract(r.sampling_params, '$.structured_outputs') FROM requests r "
            "JOIN sessions s ON s.id = r.session_id ORDER BY r.seq"):
        if structured is None:
            continue
        asked["recorded" if session == "varied" else "replayed"].append(json.loads(structured))
    [(embeds_id,)] = connection.execute("SELECT r.request_id FROM requests r JOIN sessions s ON s.id = r.session_id "
                                        "WHERE s.name = 'varied' AND r.prompt_len IS NULL").fetchall()
    connection.close()
    assert len(asked["recorded"]) == 4 and asked["replayed"] == asked["recorded"], asked
    # A prompt of embeddings goes through the API only as torch.save bytes, which the replay does not make:
    # that request alone fails; every other user gets the recorded tokens.
    serious = {(f["code"], f.get("request_id")) for f in report["findings"]
               if f["severity"] in ("breaking", "regression") and f["category"] != "performance"}
    assert {rid for _, rid in serious} <= {embeds_id}, (result.stdout[-3000:], serious)
