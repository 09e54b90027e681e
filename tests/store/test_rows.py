"""What the writer's rows hold, value by value."""

import sqlite3

import duckdb

from replay_proxy.store.tables import open_database
from replay_proxy.store.writer import Writer
from replay_proxy.wire.capture import CapturedFrame
from replay_proxy.wire.encode import encode, struct_value
from replay_proxy.wire.messages import Channel, Direction
from replay_proxy.wire.schema import load_schema
from tests.test_cli import cli


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
    parquet = duckdb.sql(f"SELECT stop_reason FROM read_parquet('{tmp_path}/lake/outputs/*/*.parquet') ORDER BY seq, "
                         "position").fetchall()
    assert parquet == [("852",)] * 4
