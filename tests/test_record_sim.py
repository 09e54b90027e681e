"""Sim frontend <-> recording relay <-> sim engines: forwarding and recording are exact."""

import contextlib
import json

import msgspec
import pytest
import sqlite_utils
import trio

from replay_proxy.store.raw import frames_with_bytes
from replay_proxy.wire.handshake import engine_identity
from replay_proxy.wire.messages import RequestType
from tests.helpers import writer_paused


async def run_workload(session, requests=12):
    frontend = session.frontend
    for k in range(requests):
        engine, client = k % session.n_engines, (k // session.n_engines) % session.api_servers
        await frontend.add(f"req-{k}", [1, 2, k], engine=engine, client=client, max_tokens=3 + k % 4,
                           temperature=0.0)
    calls = [await frontend.utility("get_supported_tasks", engine=e, client=c)
             for e in range(session.n_engines) for c in range(session.api_servers)]
    await frontend.wait_for(lambda: len(frontend.finish_reasons) == requests
                            and all(c in frontend.utility_results for c in calls))


@pytest.mark.parametrize("engines, api_servers", [(1, 1), (2, 2), (3, 3), (1, 3), (3, 1)])
async def test_every_frame_is_forwarded_routed_and_recorded(session_factory, db_path, engines, api_servers):
    with trio.fail_after(30):
        session = await session_factory(engines=engines, api_servers=api_servers)
        await run_workload(session)
    stats = session.recorder.close()
    frontend = session.frontend
    received_by_engines = sum(len(e.received) for e in session.engines)
    sent_by_frontend = 12 + engines * api_servers
    assert received_by_engines == sent_by_frontend
    for engine in session.engines:  # every message reached the engine and API-server socket it named
        for client, frames in engine.received:
            if frames[0] == RequestType.ADD.value:
                k = int(msgspec.msgpack.decode(frames[1])[0].split("-")[1])
                assert (engine.index, client) == (k % engines, (k // engines) % api_servers)
    assert all(len(tokens) == 3 + int(r.split("-")[1]) % 4 for r, tokens in frontend.tokens.items())

    db = sqlite_utils.Database(db_path)
    count = lambda sql: db.execute(sql).fetchone()[0]  # noqa: E731
    assert stats.frames_dropped == 0 and stats.frames_recorded == stats.frames_seen
    assert count("SELECT COUNT(*) FROM frames") == stats.frames_seen
    assert count("SELECT COUNT(*) FROM frames WHERE channel='input' AND direction='to_engine'") == sent_by_frontend
    assert count("SELECT COUNT(*) FROM frames WHERE channel='output'") == len(frontend.outputs_received)
    assert count("SELECT COUNT(*) FROM handshakes WHERE kind='REGISTRATION'") == engines * api_servers
    assert count("SELECT COUNT(*) FROM handshakes WHERE kind IN ('HELLO','READY','INIT')") == 3 * engines
    assert count("SELECT COUNT(*) FROM requests") == 12
    assert count("SELECT COUNT(*) FROM utility_calls WHERE result IS NOT NULL") == engines * api_servers
    rows = list(db.query("SELECT request_id, engine_index, client_index, tokens, finish_reason FROM request_timeline"))
    for row in rows:
        k = int(row["request_id"].split("-")[1])
        assert (row["engine_index"], row["client_index"]) == (k % engines, (k // engines) % api_servers)
        assert row["tokens"] == 3 + k % 4 and row["finish_reason"] == "length"
    session_row = db["sessions"].get(session.recorder.session_id)
    assert (session_row["status"], session_row["vllm_version"], session_row["schema_exact"]) == \
        ("complete", "0.32.0", 1)


@pytest.mark.parametrize("record_coordinator", [False, True])
async def test_the_dp_coordinator_is_passed_through_or_relayed_and_recorded(session_factory, db_path,
                                                                           record_coordinator):
    with trio.fail_after(30):
        session = await session_factory(engines=2, api_servers=2, coordinator=True,
                                        record_coordinator=record_coordinator)
        await run_workload(session)
        # the stats of the last step may still be on their way to the coordinator
        while len(session.frontend.coordinator_stats) < sum(e.stats_sent for e in session.engines):
            await trio.sleep(0.01)
    session.recorder.close()
    assert all(e.from_coordinator == [[RequestType.START_DP_WAVE.value, msgspec.msgpack.encode([0, 0])]]
               for e in session.engines)  # the wave reached every engine, relayed or not
    db = sqlite_utils.Database(db_path)
    frames = {(r["channel"], r["direction"], r["kind"]): r["n"] for r in db.query(
        "SELECT channel, direction, kind, COUNT(*) AS n FROM frames WHERE channel LIKE 'coordinator%' "
        "GROUP BY channel, direction, kind")}
    inits = [{k: json.loads(r[k])["addresses"]["coordinator_input"] for k in ("payload", "rewritten")}
             for r in db.query("SELECT payload, rewritten FROM handshakes WHERE kind = 'INIT'")]
    if not record_coordinator:
        assert frames == {} and all(i["payload"] == i["rewritten"] for i in inits)
        return
    assert len(inits) == 2 and all(i["payload"] != i["rewritten"] for i in inits)
    assert frames == {
        ("coordinator_input", "to_frontend", "SUBSCRIBE"): 2,  # one upstream subscriber per engine
        ("coordinator_input", "to_engine", "COORDINATOR_READY"): 2,
        ("coordinator_input", "to_engine", "START_DP_WAVE"): 2,
        ("coordinator_output", "to_frontend", "OUTPUTS"): sum(e.stats_sent for e in session.engines),
    }
    waves = [json.loads(r["decoded"]) for r in db.query("SELECT decoded FROM frames WHERE kind = 'START_DP_WAVE'")]
    assert waves == [{"wave": 0, "exclude_engine_index": 0}] * 2
    running = [r["num_running_reqs"] for r in db.query(
        "SELECT s.num_running_reqs FROM scheduler_stats s JOIN frames f ON f.session_id = s.session_id AND "
        "f.seq = s.seq WHERE f.channel = 'coordinator_output'")]
    assert len(running) == sum(e.stats_sent for e in session.engines)  # a row each
    assert max(running) > 0 and all(isinstance(n, int) for n in running)


async def test_with_a_tiny_queue_block_records_every_forwarded_frame_and_drop_counts_what_it_drops(
        session_factory, db_path):
    for on_full in ("block", "drop"):  # one file, two sessions
        with trio.fail_after(30):
            session = await session_factory(engines=2, api_servers=2, name=on_full, on_full=on_full, queue_size=2)
            # Dropping, the writer takes nothing while the traffic flows, so the queue fills ... and every
            # request still finishes: forwarding never waits.
            with writer_paused(session.recorder) if on_full == "drop" else contextlib.nullcontext():
                await run_workload(session, requests=40)
        stats = session.recorder.close()
        db = sqlite_utils.Database(db_path)
        seqs = [r["seq"] for r in db.query("SELECT seq FROM frames WHERE session_id = ?",
                                           [session.recorder.session_id])]
        assert stats.frames_recorded == len(seqs) and stats.frames_recorded + stats.frames_dropped == stats.frames_seen
        if on_full == "block":
            assert stats.frames_dropped == 0
            outputs = db.execute("SELECT COUNT(*) FROM frames WHERE session_id = ? AND channel = 'output'",
                                 [session.recorder.session_id]).fetchone()[0]
            assert outputs == len(session.frontend.outputs_received)
        else:  # what was dropped is missing from the numbers (never reused), and counted in the session's row
            assert stats.frames_dropped > 40 and len(set(seqs)) == len(seqs) < stats.frames_seen
            assert set(seqs) <= set(range(1, stats.frames_seen + 1))
            assert db["sessions"].get(session.recorder.session_id)["frames_dropped"] == stats.frames_dropped
            assert stats.frames_dropped_by_reason == {"queue_full": stats.frames_dropped, "write_failed": 0,
                                                      "late_at_stop": 0, "writer_lost": 0}


async def test_recorded_columns_are_named_and_typed(session_factory, db_path):
    with trio.fail_after(20):
        session = await session_factory()
        await session.frontend.add("req-a", [4, 5, 6], max_tokens=2, temperature=0.5, seed=7, top_k=3)
        await session.frontend.wait_for(lambda: "req-a" in session.frontend.finish_reasons)
    session.recorder.close()
    db = sqlite_utils.Database(db_path)
    request = next(db.query("SELECT * FROM requests"))
    assert (request["temperature"], request["seed"], request["top_k"], request["max_tokens"]) == (0.5, 7, 3, 2)
    assert request["top_p"] == 1.0  # omitted on the wire, filled from the release's default
    assert json.loads(request["sampling_params"]) == {"temperature": 0.5, "top_k": 3, "seed": 7, "max_tokens": 2}
    assert (request["prompt_len"], json.loads(request["prompt_token_ids"])) == (3, [4, 5, 6])
    outputs = list(db.query("SELECT new_token_ids, finish_reason FROM outputs ORDER BY seq"))
    assert [o["finish_reason"] for o in outputs] == [None, "length"]
    assert sum(len(json.loads(o["new_token_ids"])) for o in outputs) == 2
    init = next(db.query("SELECT payload, rewritten FROM handshakes WHERE kind='INIT'"))
    assert json.loads(init["payload"])["addresses"]["inputs"] != json.loads(init["rewritten"])["addresses"]["inputs"]


async def test_undecodable_frames_are_forwarded_byte_identical_and_recorded(session_factory, db_path):
    garbage_in = [b"\x09", b"\xc1\xff not msgpack"]
    garbage_out = [b"\xc1 also not msgpack", b"aux"]
    with trio.fail_after(20):
        session = await session_factory()
        frontend, engine = session.frontend, session.engines[0]
        await frontend.inputs[0].send([engine_identity(0), *garbage_in])
        await engine.outputs[0].send(garbage_out)
        await frontend.wait_for(lambda: frontend.undecodable == 1)
        while not engine.received:
            await trio.sleep(0.01)
    session.recorder.close()
    assert engine.received == [(0, garbage_in)]
    assert frontend.outputs_received == [(0, garbage_out)]
    db = sqlite_utils.Database(db_path)
    # The two cross the proxy independently, so match them by channel, not by order.
    rows = {r["channel"]: r for r in frames_with_bytes(db.conn, "kind = 'UNKNOWN'")}
    assert {c: r["parts"] for c, r in rows.items()} == {"input": garbage_in, "output": garbage_out}
    assert "unknown request type" in rows["input"]["decode_error"]
    assert "malformed" in rows["output"]["decode_error"]


async def test_a_vanished_engine_is_noticed_and_the_others_keep_serving(session_factory, db_path):
    with trio.fail_after(30):
        session = await session_factory(engines=2)
        frontend = session.frontend
        await frontend.add("before", [1, 2], engine=1, max_tokens=2, temperature=0.0)
        await frontend.wait_for(lambda: "before" in frontend.finish_reasons)
        gone = session.engines[1]
        gone.outputs[0].close()  # what a SIGKILL does to its sockets, without ENGINE_CORE_DEAD
        for sock in gone.inputs:
            sock.close()
        while not session.recorder.statistics().engines_dead:
            await trio.sleep(0.05)
        await frontend.add("after", [3, 4], engine=0, max_tokens=3, temperature=0.0)
        await frontend.wait_for(lambda: "after" in frontend.finish_reasons)
    session.recorder.close()
    db = sqlite_utils.Database(db_path)
    events = list(db.query("SELECT engine_index, event, detail FROM engine_events"))
    assert [(e["engine_index"], e["event"]) for e in events] == [(1, "lost")]
    assert len(frontend.tokens["after"]) == 3
    assert db.execute("SELECT COUNT(*) FROM requests WHERE request_id IN ('before', 'after')").fetchone()[0] == 2


async def test_engine_core_dead_is_forwarded_and_recorded(session_factory, db_path):
    from replay_proxy.sim.drift import EngineDrift

    with trio.fail_after(30):
        session = await session_factory(engine_drift=EngineDrift(die_after_requests=1), api_servers=2)
        await session.frontend.add("fatal", [5], max_tokens=4)
        await session.frontend.wait_for(lambda: session.frontend.dead_sentinels == 2)  # on every output socket
    stats = session.recorder.close()
    assert stats.engines_dead == 1  # one engine, whose death reached both API servers
    db = sqlite_utils.Database(db_path)
    assert db.execute("SELECT COUNT(*) FROM frames WHERE kind = 'ENGINE_CORE_DEAD'").fetchone()[0] == 2
    # then, as a real engine does, it exits: its connection may drop before the recording ends, and on a busy
    # machine before the relay has read the second socket's ENGINE_CORE_DEAD (sockets are read apart)
    events = [r["event"] for r in db.query("SELECT event FROM engine_events ORDER BY seq")]
    assert sorted(events) in (["ENGINE_CORE_DEAD"] * 2, ["ENGINE_CORE_DEAD"] * 2 + ["lost"])


async def test_the_engine_may_start_before_the_frontend(nursery, db_path):
    from replay_proxy.net.relay import Relay
    from replay_proxy.processes import free_port
    from replay_proxy.sim.engine import SimEngine
    from replay_proxy.sim.frontend import SimFrontend
    from replay_proxy.recorder import Recorder, SessionInfo

    upstream = f"tcp://127.0.0.1:{free_port()}"
    recorder = Recorder(db_path, SessionInfo(name="engine-first", upstream=upstream))
    relay = Relay("tcp://127.0.0.1:0", upstream, recorder)
    nursery.start_soon(relay.run)
    await relay.listening.wait()
    nursery.start_soon(SimEngine(relay.listen).run)  # HELLO goes out while nothing listens upstream
    with trio.fail_after(20):
        while not relay.engines:  # the relay has taken the engine's HELLO
            await trio.sleep(0.01)
    frontend = SimFrontend(upstream)
    with trio.fail_after(20):
        await nursery.start(frontend.run)
        await frontend.ready.wait()
        await frontend.add("late", [1], max_tokens=2, temperature=0.0)
        await frontend.wait_for(lambda: "late" in frontend.finish_reasons)
    assert len(frontend.tokens["late"]) == 2
    recorder.close()
    kinds = [r["kind"] for r in sqlite_utils.Database(db_path).query("SELECT kind FROM frames ORDER BY seq")]
    assert kinds[:3] == ["HELLO", "INIT", "READY"] or kinds[:3] == ["HELLO", "INIT", "REGISTRATION"]


@pytest.mark.parametrize("engine_release", ["0.34.0", "0.32.0"])
async def test_a_0_34_frontend_is_recorded_with_its_own_release(session_factory, db_path, engine_release):
    """0.34.0's prompts (an int32 ndarray, a long one in an aux frame) cross byte-identical and are tabulated
    as tokens, named with the frontend's release whichever release its engines are; an engine of 0.32.0
    rejects them, as a real one does (its input thread dies on the typed decode)."""
    prompts = {"short": [5, 6, 7, 8], "long": [(3 * i) % 500 for i in range(200)]}
    with trio.fail_after(30):
        session = await session_factory(frontend_release="0.34.0", engine_release=engine_release)
        for request_id, prompt in prompts.items():
            await session.frontend.add(request_id, prompt, max_tokens=3, temperature=0.0)
        engine = session.engines[0]
        if engine_release == "0.34.0":
            await session.frontend.wait_for(lambda: len(session.frontend.finish_reasons) == 2)
        else:
            while len(engine.rejected) < 2:
                await trio.sleep(0.01)
    session.recorder.close()
    sent = [frames for _, frames in engine.received if frames[0] == RequestType.ADD.value]
    assert [len(frames) for frames in sent] == [2, 3]  # the long prompt's 800 bytes in an aux frame
    db = sqlite_utils.Database(db_path)
    rows = {r["request_id"]: r for r in db.query("SELECT request_id, prompt_len, prompt_token_ids FROM requests")}
    assert {rid: (r["prompt_len"], json.loads(r["prompt_token_ids"])) for rid, r in rows.items()} == {
        rid: (len(prompt), prompt) for rid, prompt in prompts.items()}
    assert [r["parts"] for r in frames_with_bytes(db.conn, "kind = 'ADD'")] == sent  # as the engine received them
    row = db["sessions"].get(session.recorder.session_id)
    assert (row["vllm_version"], row["frontend_release"], row["frontend_source"]) == (
        engine_release, "0.34.0", "engines" if engine_release == "0.34.0" else "newest")
    alarms = {(r["field"], r["issue"], r["schema_release"]) for r in db.query("SELECT * FROM drift_alarms")}
    assert alarms == (set() if engine_release == "0.34.0" else {
        ("prompt_token_ids", "type_mismatch", "0.32.0"), (None, "extra_position", "0.32.0")})
