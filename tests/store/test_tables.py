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
