"""Parquet export: every table of every session, partitioned by day and proxy, read across recordings by DuckDB
(tests/store/test_fleet.py: the fleet's queries in SQLite, DuckDB and Spark)."""

import contextlib
import sqlite3
from pathlib import Path

import duckdb
import msgspec

from replay_proxy.store.raw import frames_with_bytes
from replay_proxy.store.tables import open_database
from tests.helpers import cli

ROOT = Path(__file__).resolve().parents[2]
RECORDINGS = [ROOT / "recordings" / "demo.db", ROOT / "recordings" / "vllm-0.32.0-python.db"]


def test_two_proxies_recordings_exported_into_one_folder_are_one_table_to_duckdb(tmp_path):
    lake = tmp_path / "lake"
    for db in RECORDINGS:  # as two proxies' files would be
        result = cli("export", "--db", str(db), "--parquet", str(lake))
        assert result.returncode == 0 and "wrote 11 Parquet files" in result.stderr, result.stderr
    # docs/database.md's query: outputs and tokens per session, with each session's release.
    rows = duckdb.sql(f"""
        SELECT s.name, s.vllm_version, COUNT(*) AS outputs, SUM(o.num_new_tokens) AS tokens
        FROM read_parquet('{lake}/outputs/**/*.parquet', hive_partitioning = true) o
        JOIN read_parquet('{lake}/sessions/**/*.parquet', hive_partitioning = true) s USING (recording)
        GROUP BY ALL ORDER BY s.name""").fetchall()
    expected = []
    for db in RECORDINGS:
        connection = sqlite3.connect(db)
        expected += connection.execute("""SELECT s.name, s.vllm_version, COUNT(*), SUM(o.num_new_tokens)
                                          FROM outputs o JOIN sessions s ON s.id = o.session_id
                                          GROUP BY s.id""").fetchall()
    assert rows == sorted(expected) and len(rows) == 2
    # Every column keeps its type, bytes included: the raw frames are the recorded bytes.
    [(raw,)] = duckdb.sql(f"SELECT raw FROM read_parquet('{lake}/frames/**/demo-*.parquet') ORDER BY seq "
                          "LIMIT 1").fetchall()
    first = frames_with_bytes(sqlite3.connect(RECORDINGS[0]))[0]
    assert msgspec.msgpack.decode(raw) == first["parts"]


def test_a_bad_file_among_several_is_one_line_and_adds_nothing(tmp_path):
    result = cli("export", "--db", str(RECORDINGS[0]), "--db", str(tmp_path / "missing.db"), "--parquet",
                 str(tmp_path / "lake"))
    assert result.returncode == 1 and "missing.db" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "lake").exists()


def test_a_bad_session_is_one_line(tmp_path):
    result = cli("export", "--db", str(RECORDINGS[0]), "--parquet", str(tmp_path), "--session", "nope")
    assert result.returncode == 1 and "no session 'nope'" in result.stderr and "Traceback" not in result.stderr


def test_two_proxies_files_of_one_name_with_sessions_of_one_name_land_side_by_side(tmp_path):
    """Monday's staging.db of two proxies on one host, each with a session 'staging-monday (cut)': every request of
    both is in the dataset, each under its own proxy's partition."""
    lake, files = tmp_path / "lake", []
    for proxy, source in (("a", RECORDINGS[1]), ("b", ROOT / "recordings" / "vllm-0.32.0-vllm-rs.db")):
        (tmp_path / proxy).mkdir()
        files.append(tmp_path / proxy / "staging.db")
        files[-1].write_bytes(source.read_bytes())
        with contextlib.closing(open_database(files[-1])) as db, db.conn:
            db.execute("UPDATE sessions SET name = 'staging-monday (cut)', proxy_host = 'stg/1', "
                       "proxy_instance = ?", [proxy])
    assert cli("export", "--db", str(files[0]), "--db", str(files[1]), "--parquet", str(lake)).returncode == 0
    [(requests, recordings, names)] = duckdb.sql(f"""
        SELECT COUNT(*), COUNT(DISTINCT recording),
               list(DISTINCT host || ' ' || instance ORDER BY host || ' ' || instance)
        FROM read_parquet('{lake}/requests/**/*.parquet', hive_partitioning = true)""").fetchall()
    expected = sum(sqlite3.connect(f).execute("SELECT COUNT(*) FROM requests").fetchone()[0] for f in files)
    assert (requests, recordings, names) == (expected, 2, ["stg/1 a", "stg/1 b"])
    assert sorted(p.relative_to(lake).parts[1:4] for p in lake.glob("sessions/**/*.parquet")) == [
        ("day=2026-12-01", "host=stg%2F1", "instance=a"), ("day=2026-12-01", "host=stg%2F1", "instance=b")]
