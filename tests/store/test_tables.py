"""Opening a recording made by an older release."""

import sqlite_utils

from replay_proxy.store.tables import TABLES, open_database

OLD_UNDECODED = {"session_id": int, "first_seq": int, "entries": int, "batch": bytes}


def test_an_empty_undecoded_table_of_an_older_layout_is_remade(db_path):
    sqlite_utils.Database(db_path)["undecoded"].create(OLD_UNDECODED, pk=["session_id", "first_seq"])
    assert open_database(db_path)["undecoded"].columns_dict == TABLES["undecoded"][0]


def test_an_older_undecoded_table_that_still_holds_frames_is_kept(db_path):
    sqlite_utils.Database(db_path)["undecoded"].insert({"session_id": 1, "first_seq": 1, "entries": 1, "batch": b"x"},
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
         "num_nans_in_logits": 0, "new_logprobs": None, "events": None, "other": None}
        for p, rid in enumerate(["b", "a"])], pk=["session_id", "seq", "position"])
    db = open_database(db_path)
    assert "outputs" in db.view_names() and "outputs" not in db.table_names()
    assert [(r["request_id"], r["position"], r["ts_ns"], r["client_index"], r["engine_time_s"]) for r in db.query(
        "SELECT * FROM outputs ORDER BY position")] == [("b", 0, 99, 1, 12.5), ("a", 1, 99, 1, 12.5)]
    assert [tuple(r.values()) for r in db.query("SELECT request_id, number FROM request_ids ORDER BY number")] == [
        ("b", 1), ("a", 2)]
