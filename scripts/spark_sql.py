"""SQL over an exported dataset (``replay-proxy export``) in Apache Spark, in local mode: the code a cluster runs.

Each table folder of the dataset is a view of its name, read in place with
its partitions (day, host, instance) as text columns: a partition value that
looks like a number (an instance named by its port) stays what the
``sessions`` table says. Each query's rows are printed as one JSON list a
line. Needs ``pyspark`` (scripts/setup-vllm.sh puts it in the cache's
``spark`` venv) and a Java runtime, 17 or newer.

    $REPLAY_PROXY_CACHE/spark/bin/python scripts/spark_sql.py lake/ "SELECT host, COUNT(*) FROM outputs GROUP BY host"
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pyspark.sql import SparkSession


def main(lake: Path, queries: list[str]) -> None:
    spark = (SparkSession.builder.master("local[2]").appName("replay-proxy")
             .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        for table in sorted(p for p in lake.iterdir() if p.is_dir()):
            spark.read.parquet(str(table)).createOrReplaceTempView(table.name)
        for sql in queries:
            print(json.dumps([list(row) for row in spark.sql(sql).collect()], default=str), flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), sys.argv[2:])
