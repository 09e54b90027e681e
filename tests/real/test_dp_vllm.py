"""Data parallelism through `replay-proxy record` with real vLLM 0.32.0: two engines, several API servers.

Each bring-up needs ~8 GB and ~50 s; every process is stopped by PID.
Engines run one process per rank, rank 1 started first (start order does not
matter). Each engine runs its model on one torch thread, as the single engine
of the recording did, so one greedy request gets the recording's tokens on
either engine: what users see through the proxy is held to what the
recording holds (made through the proxy too, which tests/real/test_record_vllm.py
holds to a run without it).
"""

import contextlib
import json
import os
import re
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlite_utils

from tests.real import peers

pytestmark = pytest.mark.real_vllm
RECORDING = Path(__file__).resolve().parents[2] / "recordings" / "vllm-0.32.0-python.db"


GREEDY = "r.temperature = 0 AND r.request_id NOT IN (SELECT request_id FROM aborts)"


def recorded_prompts():
    """(prompt, max_tokens) of the greedy requests of the recording: the workload for every DP run."""
    rows = sqlite_utils.Database(RECORDING).query(
        f"SELECT prompt_token_ids, max_tokens FROM requests r WHERE {GREEDY} ORDER BY seq")
    return [(json.loads(r["prompt_token_ids"]), r["max_tokens"]) for r in rows]


@pytest.fixture(scope="module")
def recorded():
    """The engine's tokens for each of those requests, as recorded."""
    tokens = {}
    for row in sqlite_utils.Database(RECORDING).query(f"""
            SELECT r.seq, o.new_token_ids FROM requests r
            JOIN outputs o ON o.session_id = r.session_id AND o.request_id = r.request_id
            WHERE {GREEDY} ORDER BY r.seq, o.seq"""):
        tokens.setdefault(row["seq"], []).extend(json.loads(row["new_token_ids"]))
    return list(tokens.values())


def run_pairs(http, prompts):
    """Two requests at a time: one per engine, never batched."""
    with ThreadPoolExecutor(2) as pool:
        return [tokens for i in range(0, len(prompts), 2)
                for tokens in pool.map(lambda e: complete(http, *e), prompts[i:i + 2])]


def complete(http, prompt, max_tokens):
    body = {"model": str(peers.MODEL), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True}
    return peers.post(http, "/v1/completions", body)["choices"][0]["token_ids"]


@contextlib.contextmanager
def holding_engine_0(http):
    """A long streaming request in flight while the block runs; the client drops it at the end."""
    started, release = threading.Event(), threading.Event()

    def hold():
        body = {"model": str(peers.MODEL), "prompt": [1, 2, 3], "max_tokens": 100_000, "ignore_eos": True,
                "temperature": 0.0, "stream": True}
        request = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                started.set()
                if release.is_set():
                    return

    with ThreadPoolExecutor(1) as pool:
        holder = pool.submit(hold)
        assert started.wait(60), "the held request never streamed"
        try:
            yield
        finally:
            release.set()
            holder.result(timeout=60)


def bring_up(logs, frontend, db=None, model=peers.MODEL, *proxy_options):
    """Frontend (DP=2) + the recording proxy (when ``db`` is given) + one engine process per rank, rank 1 first."""
    http, upstream = peers.free_port(), peers.free_port()
    children = [frontend(http, upstream)]
    listen = upstream
    if db is not None:
        listen = peers.free_port()
        children.append(peers.proxy(logs, listen, upstream, db, "dp2", *proxy_options))
    for rank in (1, 0):
        children.append(peers.headless_engine(logs, listen, dp=2, start_rank=rank, name=f"engine-{rank}",
                                              model=model))
    return http, children


def stop(children):
    for child in reversed(children):
        child.stop(timeout=30)
    return children[1].process.returncode  # the proxy's


def check_recording(db, api_servers, coordinator_relayed=False):
    sessions = list(db.query("SELECT status, frames_seen, frames_recorded, frames_dropped FROM sessions"))
    assert sessions == [{"status": "complete", "frames_seen": sessions[0]["frames_seen"],
                         "frames_recorded": sessions[0]["frames_seen"], "frames_dropped": 0}]
    assert list(db.query("SELECT * FROM frames WHERE decode_error IS NOT NULL OR flags IS NOT NULL")) == []
    inits = list(db.query("SELECT engine_index, payload, rewritten FROM handshakes WHERE kind = 'INIT'"))
    assert sorted(i["engine_index"] for i in inits) == [0, 1]
    for init in inits:
        original, rewritten = json.loads(init["payload"])["addresses"], json.loads(init["rewritten"])["addresses"]
        assert len(original["inputs"]) == len(rewritten["inputs"]) == api_servers
        assert len(original["outputs"]) == len(rewritten["outputs"]) == api_servers
        assert set(original["inputs"]).isdisjoint(rewritten["inputs"])
        relayed = ("coordinator_input", "coordinator_output") if coordinator_relayed else ()
        for key in ("coordinator_input", "coordinator_output", "frontend_stats_publish_address"):
            assert (rewritten[key] != original[key]) == (key in relayed)  # passed through unless relayed
    registrations = {(r["engine_index"], r["client_index"]) for r in db.query(
        "SELECT engine_index, client_index FROM handshakes WHERE kind = 'REGISTRATION'")}
    assert registrations == {(e, c) for e in (0, 1) for c in range(api_servers)}


def wait_for_api_servers(log: Path, count: int, timeout: float = peers.READY_TIMEOUT_S) -> None:
    """HTTP answers once one API server is up; wait until each has made its start-up calls and serves."""
    started = re.compile(r"\(ApiServer_(\d+) pid=\d+\).*Starting vLLM server on")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(set(started.findall(log.read_text(errors="replace")))) == count:
            return
        time.sleep(0.5)
    raise AssertionError(f"not all {count} API servers started within {timeout:g} s (see {log})")


def test_python_frontend_two_api_servers_two_engines_and_its_coordinator(tmp_path, recorded):
    db = tmp_path / "dp.db"
    http, children = bring_up(tmp_path, lambda h, u: peers.python_frontend(tmp_path, h, u, dp=2), db,
                              peers.MODEL, "--record-coordinator")
    try:
        peers.wait_http_ready(http, children)
        wait_for_api_servers(tmp_path / "frontend.log", 2)
        got = run_pairs(http, recorded_prompts())
    finally:
        proxy_code = stop(children)
    assert proxy_code == 0
    assert got == recorded
    db = sqlite_utils.Database(db)
    check_recording(db, api_servers=2, coordinator_relayed=True)
    assert {r["engine_index"] for r in db.query("SELECT engine_index FROM requests")} == {0, 1}
    calls = {(r["engine_index"], r["client_index"]) for r in db.query("SELECT * FROM utility_calls")}
    assert calls == {(0, 0), (0, 1), (1, 0), (1, 1)}  # each API server calls each engine at start
    # The coordinator channels, per engine: the subscription, the coordinator's READY, request-count stats.
    coordinator = {(r["engine_index"], r["direction"], r["kind"]) for r in db.query(
        "SELECT engine_index, direction, kind FROM frames WHERE channel LIKE 'coordinator%'")}
    for engine in (0, 1):
        assert {(engine, "to_frontend", "SUBSCRIBE"), (engine, "to_engine", "COORDINATOR_READY"),
                (engine, "to_frontend", "OUTPUTS")} <= coordinator
    running = [r["num_running_reqs"] for r in db.query(
        "SELECT s.num_running_reqs FROM scheduler_stats s JOIN frames f ON f.session_id = s.session_id AND "
        "f.seq = s.seq WHERE f.channel = 'coordinator_output'")]
    assert max(running) >= 1


def test_vllm_rs_two_engines_and_a_vanished_one(tmp_path, recorded):
    db_path = tmp_path / "dp.db"
    prompts = recorded_prompts()
    http, children = bring_up(tmp_path, lambda h, u: peers.rust_frontend(tmp_path, h, u, dp=2), db_path)
    try:
        peers.wait_http_ready(http, children)
        # vllm-rs routes to the engine with the fewest requests in flight (ties: engine 0). A request
        # held open on engine 0 sends the first one to engine 1, every time; then engine 0 is free.
        with holding_engine_0(http):
            got = [complete(http, *prompts[0])]
        got.append(complete(http, *prompts[1]))
        os.killpg(children[2].pid, signal.SIGKILL)  # engine rank 1 vanishes: no ENGINE_CORE_DEAD
        db = sqlite_utils.Database(db_path)
        deadline = time.monotonic() + 30
        while not list(db.query("SELECT * FROM engine_events")) and time.monotonic() < deadline:
            time.sleep(0.5)
        after = complete(http, *prompts[0])  # idle: routed to engine 0
    finally:
        proxy_code = stop(children)
    assert proxy_code == 0
    # Greedy tokens are the same across the Python and Rust frontends (docs/real-vllm.md), and on
    # either engine.
    assert got == recorded[:2] and after == recorded[0]
    db = sqlite_utils.Database(db_path)
    check_recording(db, api_servers=1)
    assert {r["engine_index"] for r in db.query("SELECT engine_index FROM requests")} == {0, 1}
    events = list(db.query("SELECT seq, engine_index, event FROM engine_events ORDER BY seq"))
    last_request = db.execute("SELECT MAX(seq) FROM requests").fetchone()[0]
    # Engine 1 is lost before the last request; engine 0 only when the test stops it, at the end.
    assert (events[0]["engine_index"], events[0]["event"]) == (1, "lost") and events[0]["seq"] < last_request
    assert all(e["seq"] > last_request for e in events[1:])
    assert db.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 4  # the held one, the two, the last


def test_a_fatal_engine_error_is_recorded_and_the_proxy_exits_cleanly(tmp_path):
    db_path = tmp_path / "moe.db"
    http, children = bring_up(tmp_path, lambda h, u: peers.python_frontend(tmp_path, h, u, dp=2,
                                                                            model=peers.MOE_MODEL),
                              db_path, model=peers.MOE_MODEL)
    try:
        peers.wait_http_ready(http, children)
        body = {"model": str(peers.MOE_MODEL), "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0}
        with pytest.raises(OSError):  # the frontend answers 500, or drops the connection
            peers.post(http, "/v1/completions", body)
        db = sqlite_utils.Database(db_path)
        deadline = time.monotonic() + 60
        while db.execute("SELECT COUNT(*) FROM frames WHERE kind = 'ENGINE_CORE_DEAD'").fetchone()[0] < 4 \
                and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        proxy_code = stop(children)
    assert proxy_code == 0
    db = sqlite_utils.Database(db_path)
    dead = {(r["engine_index"], r["client_index"]) for r in db.query(
        "SELECT engine_index, client_index FROM frames WHERE kind = 'ENGINE_CORE_DEAD'")}
    assert dead == {(0, 0), (0, 1), (1, 0), (1, 1)}  # every engine, on every API server's socket
    assert db["sessions"].get(1)["status"] == "complete"
    for init in db.query("SELECT payload, rewritten FROM handshakes WHERE kind = 'INIT'"):
        original, rewritten = (json.loads(init[k])["addresses"] for k in ("payload", "rewritten"))
        assert original["coordinator_input"] and rewritten["coordinator_input"] == original["coordinator_input"]
    assert db.execute("SELECT COUNT(*) FROM frames WHERE channel LIKE 'coordinator%'").fetchone()[0] == 0
