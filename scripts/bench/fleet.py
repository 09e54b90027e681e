"""What a fleet's week costs as one dataset: a generated week, scaled down, exported and queried in place.

The week is ``--days`` days of ``--proxies`` proxies on ``--hosts`` hosts,
each rotating ``--files`` files a day; every file is a copy of a real
client's recording (recordings/vllm-0.32.0-bench-serve.db: ``vllm bench
serve``, sampled and greedy, top-20 logprobs) with its session's day and
proxy set, as the proxies would have written it. All are exported into one
dataset (``replay-proxy export``, a file at a time, as each proxy ships its
closed files), then docs/database.md's fleet queries run over it in DuckDB
and, where scripts/setup-vllm.sh installed it, in Spark (local mode, two
cores). Printed: the dataset's files and bytes against the recordings'
bytes; each query's wall time, and its ratio to the floor, a plain scan of
the same files (``SELECT COUNT(*)`` of each table the query reads) in the same
engine and run.

    .venv/bin/python scripts/bench/fleet.py [--days 7] [--hosts 2] [--proxies 4] [--files 6] [--spark]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from replay_proxy.releases import cache_dir  # noqa: E402
from replay_proxy.store.tables import open_database  # noqa: E402
from tests.store.test_fleet import PARTITIONS, fleet_queries  # noqa: E402

SOURCE = ROOT / "recordings" / "vllm-0.32.0-bench-serve.db"
SPARK_PYTHON = cache_dir() / "spark" / "bin" / "python"


def week(folder: Path, days: int, hosts: int, proxies: int, files: int) -> list[Path]:
    """The fleet's files: ``proxies`` proxies spread over ``hosts`` hosts, ``files`` rotated files a day each."""
    made = []
    for day in range(days):
        for proxy in range(proxies):
            host, instance = f"stg-{proxy % hosts}", str(8000 + proxy)
            for hour in range(files):
                path = folder / f"{host}-{instance}" / f"staging-2026120{day + 1}-{hour:02d}00.db"
                path.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(SOURCE, path)
                with contextlib.closing(open_database(path)) as db, db.conn:
                    db.execute("UPDATE sessions SET proxy_host = ?, proxy_instance = ?, started_at = ?",
                               [host, instance, f"2026-12-0{day + 1}T{hour:02d}:00:00.000+00:00"])
                made.append(path)
    return made


def floor_sql(sql: str) -> str:
    """The floor of a query: a count of every row of each table it reads."""
    tables = sorted(set(re.findall(r"\b(?:FROM|JOIN) (\w+)", sql)))
    return " UNION ALL ".join(f"SELECT COUNT(*) FROM {table}" for table in tables)


def timed(run, sql: str) -> float:
    started = time.perf_counter()
    run(sql)
    return time.perf_counter() - started


def duckdb_times(lake: Path, queries: list[str]) -> list[tuple[float, float]]:
    connection = duckdb.connect()
    types = ", ".join(f"'{p}': VARCHAR" for p in PARTITIONS)
    for table in sorted(p.name for p in lake.iterdir()):
        connection.execute(f"CREATE VIEW {table} AS SELECT * FROM read_parquet('{lake}/{table}/**/*.parquet', "
                           f"hive_partitioning = true, hive_types = {{{types}}})")
    run = lambda sql: connection.sql(sql).fetchall()  # noqa: E731
    return [(timed(run, sql), timed(run, floor_sql(sql))) for sql in queries]


def spark_times(lake: Path, queries: list[str]) -> list[tuple[float, float]]:
    """Each query and its floor in one Spark session (scripts/spark_sql.py prints a line as each one ends), after a
    first statement that takes Spark's start and the dataset's listing."""
    statements = ["SELECT 1", *(s for sql in queries for s in (sql, floor_sql(sql)))]
    spark = subprocess.Popen([str(SPARK_PYTHON), str(ROOT / "scripts" / "spark_sql.py"), str(lake), *statements],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ends, last = [], time.perf_counter()
    assert spark.stdout is not None
    for line in spark.stdout:
        json.loads(line)
        ends.append(time.perf_counter() - last)
        last = time.perf_counter()
    if spark.wait(timeout=600) != 0 or len(ends) != len(statements):
        sys.exit("Spark failed")
    return list(zip(ends[1::2], ends[2::2]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--proxies", type=int, default=4)
    parser.add_argument("--files", type=int, default=6, help="rotated files a proxy writes a day")
    parser.add_argument("--spark", action="store_true", help="also in Spark (the cache's spark venv)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        files = week(folder / "fleet", args.days, args.hosts, args.proxies, args.files)
        lake = folder / "lake"
        started = time.perf_counter()
        for path in files:
            subprocess.run([sys.executable, "-m", "replay_proxy", "export", "--db", str(path), "--parquet", str(lake)],
                           check=True, capture_output=True)
        export_s = time.perf_counter() - started
        recorded = sum(p.stat().st_size for p in files)
        parquet = list(lake.rglob("*.parquet"))
        size = sum(p.stat().st_size for p in parquet)
        print(f"a week scaled down: {len(files)} recordings ({args.days} days, {args.proxies} proxies on "
              f"{args.hosts} hosts, {args.files} files a day each), {recorded / 1e6:.1f} MB")
        print(f"exported a file at a time in {export_s:.1f} s ({export_s / len(files):.2f} s a file): "
              f"{len(parquet)} Parquet files, {size / 1e6:.1f} MB, {size / recorded:.2f}x the recordings")
        queries = fleet_queries()
        engines = {"DuckDB": duckdb_times(lake, queries)}
        if args.spark:
            engines["Spark"] = spark_times(lake, queries)
        for engine, times in engines.items():
            for number, (query_s, floor_s) in enumerate(times, 1):
                print(f"{engine} query {number}: {query_s:.3f} s, {query_s / floor_s:.2f}x the floor's "
                      f"{floor_s:.3f} s (a count of the tables it reads)")


if __name__ == "__main__":
    main()
