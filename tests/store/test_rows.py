"""What the writer's rows hold, value by value."""

import sqlite3
import tempfile
from pathlib import Path

import duckdb
import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_proxy.store.tables import open_database
from replay_proxy.store.writer import Writer
from replay_proxy.wire.capture import CapturedFrame
from replay_proxy.wire.encode import encode, struct_value
from replay_proxy.wire.messages import Channel, Direction
from replay_proxy.wire.registry import load_schema
from tests.helpers import cli
from tests.strategies import msgpack_values


def test_a_stop_token_and_a_stop_string_keep_their_types(db_path, tmp_path):
    """vLLM's stop_reason is an int (a stop token) or a str (a stop string): token 852 and the string "852" must
    stay two things, in SQL and through the outputs view, for both of the writer's paths (typed, and the
    generic namer, which an unknown key sends it through); Parquet, with no such union, has them as text."""
    schema = load_schema("0.32.0")

    def outputs(seq, extra=None):
        value = struct_value(schema, "EngineCoreOutputs", {"timestamp": 1.0, "outputs": [
            {"request_id": f"token-{seq}", "new_token_ids": [852], "finish_reason": 0, "stop_reason": 852},
            {"request_id": f"string-{seq}", "new_token_ids": [7], "finish_reason": 0, "stop_reason": "852"}]})
        if extra:  # a trailing position 0.32.0 does not have: the generic namer's path
            value = [*value, extra]
        return CapturedFrame(seq, seq, Channel.OUTPUT, Direction.TO_FRONTEND, 0, 0, [encode(value)])

    session_id = open_database(db_path)["sessions"].insert({"name": "stops", "status": "recording"}).last_pk
    writer = Writer(str(db_path), session_id)
    writer.write_frames([outputs(1), outputs(2, extra="drift")])
    writer.finish()
    flags = sqlite3.connect(db_path).execute("SELECT flags FROM frames ORDER BY seq").fetchall()
    assert flags[0] == (None,) and "extra_position" in flags[1][0]  # the second took the generic path
    rows = sqlite3.connect(db_path).execute(
        "SELECT request_id, stop_reason, typeof(stop_reason) FROM outputs ORDER BY seq, position").fetchall()
    assert rows == [("token-1", 852, "integer"), ("string-1", "852", "text"),
                    ("token-2", 852, "integer"), ("string-2", "852", "text")]
    result = cli("export", "--db", str(db_path), "--parquet", str(tmp_path / "lake"))
    assert result.returncode == 0, result.stderr
    parquet = duckdb.sql(f"SELECT stop_reason FROM read_parquet('{tmp_path}/lake/outputs/**/*.parquet') ORDER BY seq, "
                         "position").fetchall()
    assert parquet == [("852",)] * 4


def test_a_drifted_value_where_a_column_wants_a_scalar_never_fails_its_batch(db_path):
    """A drifted frontend's ADD whose request_id is an array and priority text, and a drifted engine's output
    whose NaN count is an array (the generic namer's path, flagged): their rows hold them as JSON and text,
    and no frame of their batch is lost (a list bound to a column failed the whole transaction)."""
    schema = load_schema("0.32.0")

    def add(seq, **fields):
        value = struct_value(schema, "EngineCoreRequest", {
            "request_id": f"r-{seq}", "prompt_token_ids": [1, 2], "mm_features": None, "pooling_params": None,
            "arrival_time": 1.0, "lora_request": None, "cache_salt": None, "data_parallel_rank": None,
            "sampling_params": {"temperature": 0.5, "seed": 7, "stop": ["x"]}, **fields})
        return CapturedFrame(seq, seq, Channel.INPUT, Direction.TO_ENGINE, 0, 0, [b"\x00", encode(value)])

    def outputs(seq, **fields):
        value = struct_value(schema, "EngineCoreOutputs", {"outputs": [
            {"request_id": "r-1", "new_token_ids": [5], **fields}]})
        return CapturedFrame(seq, seq, Channel.OUTPUT, Direction.TO_FRONTEND, 0, 0, [encode(value)])

    session_id = open_database(db_path)["sessions"].insert({"name": "drift", "status": "recording"}).last_pk
    writer = Writer(str(db_path), session_id)
    writer.write_frames([add(1), add(2, request_id=["a", 1], priority="high"), add(3),
                         outputs(4), outputs(5, num_nans_in_logits=[1, 2])])
    writer.finish()
    assert (writer.counts.frames_recorded, writer.counts.frames_failed) == (5, 0)
    db = sqlite3.connect(db_path)
    rows = db.execute("SELECT seq, request_id, priority, temperature, seed, sampling_params ->> '$.stop' "
                      "FROM requests ORDER BY seq").fetchall()
    assert rows == [(1, "r-1", 0, 0.5, 7, '["x"]'), (2, '["a",1]', "high", 0.5, 7, '["x"]'),
                    (3, "r-3", 0, 0.5, 7, '["x"]')]
    assert db.execute("SELECT seq, num_nans_in_logits FROM outputs ORDER BY seq").fetchall() == [(4, 0), (5, "[1,2]")]
    flags = db.execute("SELECT seq FROM frames WHERE flags IS NOT NULL").fetchall()
    assert flags == [(2,), (5,)]


def test_a_u64_call_id_is_kept_exactly_in_sql_and_in_parquet(db_path, tmp_path):
    """Python's frontend draws utility call ids from 64 bits: half are past SQLite's integers. Such an id is
    text, digit for digit (an INTEGER column made it a REAL: 1.8446744073709552e+19), and the call still
    meets its answer in ``utility_calls``; Parquet has the session's ids as text."""
    schema = load_schema("0.32.0")
    big = 2**64 - 1

    def call(seq, call_id):
        return CapturedFrame(seq, seq, Channel.INPUT, Direction.TO_ENGINE, 0, 0,
                             [b"\x03", encode([0, call_id, "get_supported_tasks", []])])

    def answer(seq, call_id):
        value = struct_value(schema, "EngineCoreOutputs", {"utility_output": {"call_id": call_id}})
        return CapturedFrame(seq, seq, Channel.OUTPUT, Direction.TO_FRONTEND, 0, 0, [encode(value)])

    session_id = open_database(db_path)["sessions"].insert({"name": "calls", "status": "recording"}).last_pk
    writer = Writer(str(db_path), session_id)
    writer.write_frames([call(1, big), call(2, 7), answer(3, 7), answer(4, big)])
    writer.finish()
    rows = sqlite3.connect(db_path).execute(
        "SELECT call_id, typeof(call_id), answered_ns FROM utility_calls ORDER BY called_ns").fetchall()
    assert rows == [(str(big), "text", 4), (7, "integer", 3)]
    result = cli("export", "--db", str(db_path), "--parquet", str(tmp_path / "lake"))
    assert result.returncode == 0, result.stderr
    parquet = duckdb.sql(f"SELECT call_id FROM read_parquet('{tmp_path}/lake/utility_requests/**/*.parquet') "
                         "ORDER BY seq").fetchall()
    assert parquet == [(str(big),), ("7",)]


_SCHEMA = load_schema("0.32.0")
_REAL_SHAPES = [  # (channel, direction, request type or None, the body), as a 0.32.0 frontend and engine send them
    (Channel.INPUT, Direction.TO_ENGINE, b"\x00", struct_value(_SCHEMA, "EngineCoreRequest", {
        "request_id": "r-1", "prompt_token_ids": [1, 2], "mm_features": None, "pooling_params": None,
        "arrival_time": 1.0, "lora_request": None, "cache_salt": None, "data_parallel_rank": None,
        "sampling_params": {"temperature": 0.5, "max_tokens": 4}})),
    (Channel.INPUT, Direction.TO_ENGINE, b"\x01", ["r-1"]),
    (Channel.INPUT, Direction.TO_ENGINE, b"\x03", [0, 2**64 - 1, "get_supported_tasks", []]),
    (Channel.OUTPUT, Direction.TO_FRONTEND, None, struct_value(_SCHEMA, "EngineCoreOutputs", {"outputs": [
        struct_value(_SCHEMA, "EngineCoreOutput", {"request_id": "r-1", "new_token_ids": [5], "finish_reason": 0,
                                                  "stop_reason": 852})]})),
    (Channel.OUTPUT, Direction.TO_FRONTEND, None, struct_value(_SCHEMA, "EngineCoreOutputs", {
        "utility_output": {"call_id": 2**64 - 1, "result": None}})),
]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(_REAL_SHAPES), st.data(), msgpack_values)
def test_any_value_in_any_field_of_a_real_frame_is_written_with_its_batch(shape, data, value):
    """The writer's half of "bad input loses nothing": whatever value stands in one field of a real frame's
    shape (or of its output), the frame gets its rows, and the good frame beside it is written too."""
    channel, direction, request_type, body = shape
    body = msgspec.msgpack.decode(encode(body))  # a copy to change
    target, outputs = body, _SCHEMA.position("EngineCoreOutputs", "outputs")
    if channel is Channel.OUTPUT and body[outputs] and data.draw(st.booleans()):
        target = body[outputs][0]  # a field of the output itself
    if isinstance(target, list) and target:
        target[data.draw(st.integers(0, len(target) - 1))] = value
    parts = [encode(body)] if request_type is None else [request_type, encode(body)]
    good = _REAL_SHAPES[0]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fuzz.db"
        session_id = open_database(path)["sessions"].insert({"name": "fuzz", "status": "recording"}).last_pk
        writer = Writer(str(path), session_id)
        writer.write_frames([CapturedFrame(1, 1, channel, direction, 0, 0, parts),
                             CapturedFrame(2, 2, good[0], good[1], 0, 0, [good[2], encode(good[3])])])
        writer.finish()
        assert (writer.counts.frames_recorded, writer.counts.frames_failed, writer.write_error) == (2, 0, None)
        assert sqlite3.connect(path).execute("SELECT COUNT(*) FROM frames").fetchone() == (2,)


def test_a_steps_counts_by_stage_keep_what_is_not_zero(db_path):
    """A step's scheduler stats carry counts by stage, mostly zeros (0.32.0's num_kv_fetch_reqs_by_stage, each
    step's): scheduler_stats.other keeps the counts that are not, and nothing where none is; the frame's bytes keep
    every one as sent."""
    schema = load_schema("0.32.0")

    def step(seq, by_stage):
        stats = struct_value(schema, "SchedulerStats", {"num_running_reqs": 1, "num_kv_fetch_reqs_by_stage": by_stage})
        value = struct_value(schema, "EngineCoreOutputs", {"timestamp": 1.0, "scheduler_stats": stats, "outputs": []})
        return CapturedFrame(seq, seq, Channel.OUTPUT, Direction.TO_FRONTEND, 0, 0, [encode(value)])

    session_id = open_database(db_path)["sessions"].insert({"name": "stats", "status": "recording"}).last_pk
    writer = Writer(str(db_path), session_id)
    writer.write_frames([step(1, {"waiting_to_start": 0, "in_progress": 0}),
                         step(2, {"waiting_to_start": 0, "in_progress": 3})])
    writer.finish()
    rows = sqlite3.connect(db_path).execute(
        "SELECT num_running_reqs, other FROM scheduler_stats ORDER BY seq").fetchall()
    assert rows == [(1, None), (1, '{"num_kv_fetch_reqs_by_stage":{"in_progress":3}}')]
