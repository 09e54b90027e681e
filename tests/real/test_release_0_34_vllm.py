"""vLLM 0.34.0's Rust frontend (from its wheel) through `replay-proxy record`: its prompts, int arrays of
=u4, inline when short and in an aux frame when long, are recorded as the tokens of the HTTP prompt, against
a real 0.32.0 engine (which cannot read them: its input thread dies on the decode, and it keeps running)
and against a sim engine speaking 0.34.0 (which answers). No 0.34.0 engine runs here (no CPU build).
"""

import concurrent.futures
import json
import time
import urllib.error

import pytest
import sqlite_utils

from replay_proxy.processes import Child, free_port
from replay_proxy.store.raw import frames_with_bytes
from replay_proxy.wire.messages import Channel, Direction, WireDecoder
from replay_proxy.wire.registry import load_schema
from tests.real import peers

pytestmark = pytest.mark.real_vllm

# The tiny model's vocabulary is 407 tokens; 200 tokens (800 bytes) travel in an aux frame.
PROMPTS = {"short": [11, 12, 13, 14], "long": [(3 * i) % 400 + 5 for i in range(200)]}


def record_vllm_rs_0_34(logs, engine, wait_s: float) -> tuple[dict, sqlite_utils.Database, Child]:
    """vllm-rs 0.34.0, the recording proxy and ``engine``; the prompts sent at once (a request with no answer
    in ``wait_s`` is given up; vllm-rs holds a second request back while one is unanswered, so they are
    concurrent, as a user's are). What the client got, the recording, and the engine (stopped)."""
    http, upstream, listen, db = free_port(), free_port(), free_port(), logs / "rec.db"
    children = [peers.rust_frontend(logs, http, upstream, "0.34.0")]

    def complete(prompt: list[int]) -> dict | Exception:
        try:
            return peers.post(http, "/v1/completions", {
                "model": str(peers.MODEL), "prompt": prompt, "max_tokens": 4, "temperature": 0.0}, timeout=wait_s)
        except (TimeoutError, urllib.error.URLError) as exc:
            return exc

    try:
        children.append(peers.proxy(logs, listen, upstream, db, "vllm-rs-0.34.0"))
        children.append(engine(logs, listen))
        peers.wait_http_ready(http, children)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = dict(zip(PROMPTS, pool.map(complete, PROMPTS.values())))
        answers["engine_running"] = children[-1].running()
    finally:
        for child in reversed(children):
            child.stop()
    return answers, sqlite_utils.Database(db), children[-1]


def assert_prompts_recorded_as_sent(db: sqlite_utils.Database) -> None:
    requests = db.query("SELECT prompt_len, prompt_token_ids FROM requests")
    assert sorted((r["prompt_len"], json.loads(r["prompt_token_ids"])) for r in requests) == [
        (len(p), p) for p in PROMPTS.values()]
    adds = sorted((r["parts"] for r in frames_with_bytes(db.conn, "kind = 'ADD'")), key=len)
    assert [len(parts) for parts in adds] == [2, 3]  # the long prompt in an aux frame
    decoder = WireDecoder(load_schema("0.34.0"))
    prompts = [decoder.decode(Channel.INPUT, Direction.TO_ENGINE, parts).fields["prompt_token_ids"] for parts in adds]
    assert [(p.dtype, p.aux_frame) for p in prompts] == [("=u4", None), ("=u4", 1)]
    assert db.execute("SELECT COUNT(*) FROM frames WHERE decode_error IS NOT NULL").fetchone()[0] == 0


def test_vllm_rs_0_34_against_a_0_32_engine_is_recorded_as_written_and_the_break_named(tmp_path):
    # No answer ever comes (the engine's log below says why), so the wait is no guess at this machine's speed.
    answers, db, engine = record_vllm_rs_0_34(tmp_path, peers.headless_engine, wait_s=10)
    assert all(isinstance(answers[name], Exception) for name in PROMPTS)  # no answer ever comes
    assert answers["engine_running"]  # ... though the engine process lives on
    assert_prompts_recorded_as_sent(db)
    session = next(db.query("SELECT * FROM sessions"))
    assert (session["vllm_version"], session["frontend_release"], session["frontend_source"], session["status"]) \
        == ("0.32.0", "0.34.0", "newest", "complete")
    alarms = {(r["field"], r["position"], r["issue"], r["schema_release"])
              for r in db.query("SELECT * FROM drift_alarms")}
    assert alarms == {("prompt_token_ids", 1, "type_mismatch", "0.32.0"), (None, 22, "extra_position", "0.32.0")}
    # The engine's input thread died on the first ADD's typed decode (where our flag points: $[1]).
    deadline = time.monotonic() + 30
    while "Expected `int`, got `str` - at `$[1][0]`" not in engine.log_tail(200) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "Expected `int`, got `str` - at `$[1][0]`" in engine.log_tail(200)


def test_vllm_rs_0_34_against_a_sim_engine_of_0_34_is_answered_and_recorded(tmp_path):
    answers, db, _ = record_vllm_rs_0_34(tmp_path, lambda logs, port: peers.sim_engine(logs, port, "0.34.0"),
                                         wait_s=120)
    assert [(answers[n]["usage"]["prompt_tokens"], answers[n]["usage"]["completion_tokens"]) for n in PROMPTS] == [
        (len(p), 4) for p in PROMPTS.values()]
    assert_prompts_recorded_as_sent(db)
    session = next(db.query("SELECT * FROM sessions"))
    assert (session["vllm_version"], session["frontend_release"], session["frontend_source"]) == (
        "0.34.0", "0.34.0", "engines")
    assert db["drift_alarms"].count == 0
