"""Opening a recording made by an older release: read as it is (through the version-aware view, not a byte
changed), and migrated by the commands that write."""

import hashlib

import pytest
import sqlite_utils

from replay_proxy.store.queries import open_recording
from replay_proxy.store.tables import SCHEMA_VERSION, TABLES, open_database


def read_then_migrated(db_path):
    """The file read as it is, then the same file after a writer's migration: each test's query must give the
    same answer on both; the read changed no byte and made no file beside it."""
    older_file(db_path)
    before = hashlib.sha256(db_path.read_bytes()).digest()
    beside = set(db_path.parent.iterdir())
    yield open_recording(db_path)
    assert hashlib.sha256(db_path.read_bytes()).digest() == before and set(db_path.parent.iterdir()) == beside
    migrated = open_database(db_path)
    assert migrated.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    yield migrated

OLD_UNDECODED = {"session_id": int, "first_seq": int, "entries": int, "batch": bytes}


def older_file(db_path):
    """A recording of an older release: a sessions table, and what a test puts beside it."""
    db = sqlite_utils.Database(db_path)
    db["sessions"].insert({"id": 1, "name": "old"}, pk="id")
    return db


def test_an_empty_undecoded_table_of_an_older_layout_is_remade(db_path):
    older_file(db_path)["undecoded"].create(OLD_UNDECODED, pk=["session_id", "first_seq"])
    assert open_database(db_path)["undecoded"].columns_dict == TABLES["undecoded"][0]


def test_an_older_undecoded_table_that_still_holds_frames_is_kept(db_path):
    older_file(db_path)["undecoded"].insert({"session_id": 1, "first_seq": 1, "entries": 1, "batch": b"x"},
                                                       pk=["session_id", "first_seq"])
    table = open_database(db_path)["undecoded"]
    assert table.count == 1 and set(OLD_UNDECODED) | set(TABLES["undecoded"][0]) == set(table.columns_dict)


def test_the_wide_outputs_table_of_an_older_layout_moves_into_output_rows(db_path):
    old = sqlite_utils.Database(db_path)
    old["frames"].insert({"session_id": 1, "seq": 5, "ts_ns": 99, "engine_index": 0, "client_index": 1,
                          "kind": "OUTPUTS", "decoded": '{"timestamp": 12.5, "outputs": []}'}, pk=["session_id", "seq"])
    old["outputs"].insert_all([
        {"session_id": 1, "seq": 5, "position": p, "ts_ns": 99, "engine_index": 0, "client_index": 1,
         "request_id": rid, "new_token_ids": "[7]", "num_new_tokens": 1, "finish_reason": None, "stop_reason": None,
         "num_nans_in_logits": 0, "new_logprobs": None if rid == "a" else '{"logprobs": [[-0.5]]}', "events": None,
         "other": None}
        for p, rid in enumerate(["b", "a"])], pk=["session_id", "seq", "position"])
    for db in read_then_migrated(db_path):
        assert_wide_outputs_moved(db)
    assert "outputs" in migrated_db(db_path).view_names() and "outputs" not in migrated_db(db_path).table_names()


def migrated_db(db_path):
    return sqlite_utils.Database(db_path)


def assert_wide_outputs_moved(db):
    assert [(r["request_id"], r["position"], r["ts_ns"], r["client_index"], r["engine_time_s"], r["new_logprobs"])
            for r in db.query("SELECT * FROM outputs ORDER BY position")] == [
        ("b", 0, 99, 1, 12.5, '{"logprobs":[[-0.5]]}'), ("a", 1, 99, 1, 12.5, None)]
    assert [tuple(r.values()) for r in db.query("SELECT request_id, number FROM request_ids ORDER BY number")] == [
        ("b", 1), ("a", 2)]


OLD_OUTPUT_ROWS = {"session_id": int, "request": int, "seq": int, "position": int, "new_token_ids": str,
                   "num_new_tokens": int, "finish_reason": str, "stop_reason": str, "num_nans_in_logits": int,
                   "new_logprobs": str, "events": str, "other": str}


def test_output_rows_with_logprobs_and_events_columns_fold_them_into_other(db_path):
    old = sqlite_utils.Database(db_path)
    old["frames"].insert({"session_id": 1, "seq": 5, "ts_ns": 99, "kind": "OUTPUTS"}, pk=["session_id", "seq"])
    old["request_ids"].insert_all([{"session_id": 1, "number": n, "request_id": r} for n, r in [(1, "a"), (2, "b"),
                                                                                                (3, "c")]])
    old["output_rows"].insert_all([
        {"session_id": 1, "request": 1, "seq": 5, "position": 0, "new_token_ids": "[7]", "num_new_tokens": 1,
         "num_nans_in_logits": 0, "new_logprobs": '{"logprobs": [[-0.5]]}', "events": '[[1, 2.0]]',
         "other": '{"kv_transfer_params": {"x": 1}}'},
        {"session_id": 1, "request": 2, "seq": 5, "position": 1, "new_token_ids": "[8]", "num_new_tokens": 1,
         "num_nans_in_logits": 0},
        {"session_id": 1, "request": 3, "seq": 5, "position": 2, "new_token_ids": "[9]", "num_new_tokens": 1,
         "num_nans_in_logits": 0, "events": '[[0, 1.5]]'}], pk=["session_id", "request", "seq", "position"])
    for db in read_then_migrated(db_path):
        assert_output_columns_folded(db)
    assert migrated_db(db_path)["output_rows"].columns_dict == TABLES["output_rows"][0]


def assert_output_columns_folded(db):
    assert [(r["request_id"], r["new_token_ids"], r["new_logprobs"], r["events"], r["other"]) for r in db.query(
        "SELECT * FROM outputs ORDER BY position")] == [
        ("a", "[7]", '{"logprobs":[[-0.5]]}', "[[1,2.0]]", '{"kv_transfer_params":{"x":1}}'),
        ("b", "[8]", None, None, None), ("c", "[9]", None, "[[0,1.5]]", None)]
    assert db.execute("SELECT COUNT(*) FROM output_rows WHERE other IS NULL").fetchone()[0] == 1


def test_a_file_missing_this_versions_columns_and_tables_reads_them_as_null(db_path):
    old = sqlite_utils.Database(db_path)
    old["frames"].insert({"session_id": 1, "seq": 1, "kind": "ADD"}, pk=["session_id", "seq"])
    for db in read_then_migrated(db_path):
        assert [tuple(r.values()) for r in db.query("SELECT seq, kind, flags, engine_time_s FROM frames")] == [
            (1, "ADD", None, None)]
        assert list(db.query("SELECT * FROM drift_alarms")) == []
        assert [r["frontend_release"] for r in db.query("SELECT frontend_release FROM sessions")] == [None]


@pytest.mark.parametrize("query", ["ATTACH 'other.db' AS other", "PRAGMA journal_mode = delete"])
def test_a_read_only_query_can_neither_attach_nor_set(recording_copy, query):
    from replay_proxy.store.queries import QueryError, run_query

    with pytest.raises(QueryError, match="read-only"):
        run_query(recording_copy, query)
    assert not (recording_copy.parent / "other.db").exists()


def test_a_new_files_keyed_tables_are_stored_by_their_key(tmp_path):
    """A table keyed by (session, seq) is one b-tree in its key's order, without a rowid and an index beside it:
    every table and index takes a page at least, and a small recording was a third such pages."""
    db = open_database(tmp_path / "new.db")
    keyed = {name for name, (_, pk) in TABLES.items() if isinstance(pk, list)}
    tables = {row["name"]: row["sql"] for row in db.query("SELECT name, sql FROM sqlite_master WHERE type = 'table'")}
    assert keyed and all(tables[name].endswith("WITHOUT ROWID") for name in keyed)
    assert not db.execute("SELECT name FROM sqlite_master WHERE name LIKE 'sqlite_autoindex%'").fetchall()
