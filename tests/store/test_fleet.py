"""A fleet's recordings as one dataset: docs/database.md's fleet queries give the same rows from SQLite over the
files, and from DuckDB and Spark over the exported Parquet."""

import contextlib
import json
import re
import shutil
import sqlite3
import subprocess
from pathlib import Path

import duckdb
import pytest
import sqlite_utils

from replay_proxy.releases import cache_dir
from replay_proxy.store.tables import open_database, read_recording
from tests.helpers import cli

ROOT = Path(__file__).resolve().parents[2]
RECORDINGS = ROOT / "recordings"
QUERIED = ("sessions", "outputs", "requests")  # the tables the queries read
PARTITIONS = ("day", "host", "instance")
SPARK_PYTHON = cache_dir() / "spark" / "bin" / "python"


def fleet_queries() -> list[str]:
    """The ```sql blocks between docs/database.md's fleet-queries markers."""
    page = (ROOT / "docs" / "database.md").read_text()
    section = page.split("<!-- fleet queries -->")[1].split("<!-- /fleet queries -->")[0]
    return re.findall(r"```sql\n(.*?)```", section, re.S)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> tuple[list[Path], Path]:
    """Two hosts' proxies, each file a ``staging.db`` whose session is named ``staging``, over two days, and an
    older proxy's file (layout 3, no host kept), exported into one folder; the files and the dataset."""
    folder = tmp_path_factory.mktemp("fleet")
    proxies = [("stg-1", "8001", "2026-12-06", "vllm-0.32.0-bench-serve.db"),
               ("stg-1", "8002", "2026-12-06", "vllm-0.32.0-bench-serve-flat.db"),
               ("stg-2", "8001", "2026-12-06", "vllm-0.31.0-python-varied.db"),
               ("stg-2", "8001", "2026-12-07", "vllm-0.28.0-python-fan-out.db")]
    files = []
    for number, (host, instance, day, source) in enumerate(proxies):
        path = folder / f"{host}-{instance}-{number}" / "staging.db"
        path.parent.mkdir()
        shutil.copyfile(RECORDINGS / source, path)
        with contextlib.closing(open_database(path)) as db, db.conn:
            db.execute("UPDATE sessions SET name = 'staging', proxy_host = ?, proxy_instance = ?, "
                       "started_at = ? || substr(started_at, 11)", [host, instance, day])
        files.append(path)
    files.append(folder / "demo.db")
    shutil.copyfile(RECORDINGS / "demo.db", files[-1])
    lake = folder / "lake"
    done = cli("export", *[arg for f in files for arg in ("--db", str(f))], "--parquet", str(lake))
    assert done.returncode == 0, done.stderr
    return files, lake


def sqlite_fleet(files: list[Path]) -> sqlite3.Connection:
    """The files' queried tables in one SQLite database, each row with its session's recording and partition
    columns as the dataset has them (a session's own label: the queries only join and count on it)."""
    fleet = sqlite_utils.Database(memory=True)
    for number, path in enumerate(files):
        with contextlib.closing(read_recording(path)) as connection:
            connection.row_factory = sqlite3.Row
            for session in map(dict, connection.execute("SELECT * FROM sessions")):
                added = {"recording": f"{number}-{session['id']}", "day": session["started_at"][:10],
                         "host": session["proxy_host"] or "unknown", "instance": session["proxy_instance"] or "unknown"}
                for table in QUERIED:
                    key = "id" if table == "sessions" else "session_id"
                    rows = connection.execute(f"SELECT * FROM [{table}] WHERE [{key}] = ?", [session["id"]])
                    fleet[table].insert_all(({**dict(row), **added} for row in rows), alter=True)
    return fleet.conn


def duckdb_fleet(lake: Path) -> duckdb.DuckDBPyConnection:
    connection = duckdb.connect()
    for table in QUERIED:
        connection.execute(f"""CREATE VIEW {table} AS SELECT * FROM read_parquet('{lake}/{table}/**/*.parquet',
            hive_partitioning = true, hive_types = {{'day': VARCHAR, 'host': VARCHAR, 'instance': VARCHAR}})""")
    return connection


def rows(result) -> list[tuple]:
    """A query's rows in one order, whatever the engine's order of rows and of nulls."""
    return sorted((tuple(row) for row in result), key=repr)


def test_the_fleet_queries_give_sqlites_rows_from_duckdb(fleet):
    files, lake = fleet
    queries = fleet_queries()
    assert len(queries) == 4
    sqlite, duck = sqlite_fleet(files), duckdb_fleet(lake)
    for sql in queries:
        expected = rows(sqlite.execute(sql))
        assert expected and rows(duck.sql(sql).fetchall()) == expected, sql
    # The first query's rows: each proxy's days, the older file's under 'unknown', every output of every file.
    by_proxy = rows(duck.sql(queries[0]).fetchall())
    assert [row[:4] for row in by_proxy] == [
        ("2026-11-29", "unknown", "unknown", 1), ("2026-12-06", "stg-1", "8001", 1), ("2026-12-06", "stg-1", "8002", 1),
        ("2026-12-06", "stg-2", "8001", 1), ("2026-12-07", "stg-2", "8001", 1)]
    outputs = sum(sqlite3.connect(f).execute("SELECT COUNT(*) FROM outputs").fetchone()[0] for f in files)
    assert sum(row[4] for row in by_proxy) == outputs


def test_every_rows_partition_is_its_sessions(fleet):
    """The partition values are what the session's row says: its day, its proxy's host and instance."""
    _, lake = fleet
    duck = duckdb_fleet(lake)
    [(sessions, wrong)] = duck.sql("""
        SELECT COUNT(*), COUNT(*) FILTER (WHERE day <> left(started_at, 10)
            OR host <> COALESCE(proxy_host, 'unknown') OR instance <> COALESCE(proxy_instance, 'unknown'))
        FROM sessions""").fetchall()
    assert (sessions, wrong) == (5, 0)
    [(outputs, unmatched)] = duck.sql("""
        SELECT COUNT(*), COUNT(*) FILTER (WHERE s.recording IS NULL OR (o.day, o.host, o.instance)
                                                 <> (s.day, s.host, s.instance))
        FROM outputs o LEFT JOIN sessions s USING (recording)""").fetchall()
    assert outputs > 0 and unmatched == 0


def test_the_dataset_grows_by_appending(fleet, tmp_path):
    """Another file adds its own files and changes none; the same session exported again replaces only its own."""
    files, shared = fleet
    lake = Path(shutil.copytree(shared, tmp_path / "lake"))  # (the other tests' dataset stays as exported)
    before = {p: p.read_bytes() for p in lake.rglob("*.parquet")}
    assert not [p for p in lake.rglob(".*")]  # (no file left half-written)
    again = cli("export", "--db", str(files[0]), "--parquet", str(lake))
    assert again.returncode == 0 and {p: p.read_bytes() for p in lake.rglob("*.parquet")} == before
    another = tmp_path / "staging.db"
    shutil.copyfile(RECORDINGS / "vllm-0.32.0-python.db", another)
    assert cli("export", "--db", str(another), "--parquet", str(lake)).returncode == 0
    after = {p: p.read_bytes() for p in lake.rglob("*.parquet")}
    assert {p: after[p] for p in before} == before and len(after) == len(before) + 11


@pytest.mark.real_vllm
def test_the_fleet_queries_give_sqlites_rows_from_spark(fleet):
    """Spark in local mode (the code a cluster runs), reading the dataset in place: scripts/setup-vllm.sh installs
    it in the cache's spark venv; Spark 4 needs a Java runtime, 17 or newer."""
    if shutil.which("java") is None:
        pytest.skip("no Java runtime (java) on the PATH: Spark cannot run here")
    if not SPARK_PYTHON.exists():
        pytest.skip(f"no Spark venv at {SPARK_PYTHON.parent.parent}: scripts/setup-vllm.sh installs it")
    files, lake = fleet
    queries = fleet_queries()
    done = subprocess.run([str(SPARK_PYTHON), str(ROOT / "scripts" / "spark_sql.py"), str(lake), *queries],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    sqlite = sqlite_fleet(files)
    assert [rows(answer) for answer in answers] == [rows(sqlite.execute(sql)) for sql in queries]
