"""Parquet export: every table of every session, partitioned by session, read across recordings by DuckDB."""

import sqlite3
from pathlib import Path

import duckdb

from tests.helpers import cli

ROOT = Path(__file__).resolve().parents[2]
RECORDINGS = [ROOT / "recordings" / "demo.db", ROOT / "recordings" / "vllm-0.32.0-python.db"]


def test_two_proxies_recordings_exported_into_one_folder_are_one_table_to_duckdb(tmp_path):
    lake = tmp_path / "lake"
    for db in RECORDINGS:  # as two proxies' files would be
        result = cli("export", "--db", str(db), "--parquet", str(lake))
        assert result.returncode == 0 and "wrote 10 Parquet files" in result.stderr, result.stderr
    # docs/database.md's query: outputs and tokens per session, with each session's release.
    rows = duckdb.sql(f"""
        SELECT s.session, s.vllm_version, COUNT(*) AS outputs, SUM(o.num_new_tokens) AS tokens
        FROM read_parquet('{lake}/outputs/*/*.parquet', hive_partitioning = true) o
        JOIN read_parquet('{lake}/sessions/*/*.parquet', hive_partitioning = true) s USING (session)
        GROUP BY ALL ORDER BY s.session""").fetchall()
    expected = []
    for db in RECORDINGS:
        connection = sqlite3.connect(db)
        expected += connection.execute("""SELECT s.name, s.vllm_version, COUNT(*), SUM(o.num_new_tokens)
                                          FROM outputs o JOIN sessions s ON s.id = o.session_id
                                          GROUP BY s.id""").fetchall()
    assert rows == sorted(expected) and len(rows) == 2
    # Every column keeps its type, bytes included: the raw frames are the recorded bytes.
    [(raw,)] = duckdb.sql(f"SELECT raw FROM read_parquet('{lake}/frames/session=demo/*.parquet') ORDER BY seq "
                          "LIMIT 1").fetchall()
    first = sqlite3.connect(RECORDINGS[0]).execute("SELECT raw FROM frames ORDER BY session_id, seq LIMIT 1")
    assert raw == first.fetchone()[0]


def test_a_bad_session_is_one_line(tmp_path):
    result = cli("export", "--db", str(RECORDINGS[0]), "--parquet", str(tmp_path), "--session", "nope")
    assert result.returncode == 1 and "no session 'nope'" in result.stderr and "Traceback" not in result.stderr
