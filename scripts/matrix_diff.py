"""Two matrix databases cell by cell: whether a change to how the matrix is observed kept its verdicts.

    .venv/bin/python scripts/matrix_diff.py BEFORE.db AFTER.db

A cell is the same when its verdict, its verdict for each kind of request, its observed verdict and
its evidence are: each item that is not "works", by kind of request, direction, verdict, rule, struct
and field (messages hold ports, paths and times, which differ from run to run). Prints the cells that
differ and exits 1 if any does; a cell in only one of them is listed too.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replay_proxy.store.files import open_read_only


def cells(path: str) -> dict[tuple[str, str], tuple]:
    with contextlib.closing(open_read_only(Path(path), "matrix database", "matrix_cells")) as db:
        rows = db.execute("SELECT frontend, engine, verdict, by_kind, cell FROM matrix_cells").fetchall()
    found = {}
    for frontend, engine, verdict, by_kind, cell in rows:
        observed = json.loads(cell).get("observed") or {}
        evidence = sorted({(e.get("kind", "completion"), e.get("direction"), e["verdict"], e.get("rule"),
                            e.get("struct"), e.get("field"))
                           for e in observed.get("evidence", []) if e["verdict"] != "works"}, key=str)
        found[(frontend, engine)] = (verdict, json.loads(by_kind), observed.get("verdict"), evidence)
    return found


def main() -> int:
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n\n")[1].strip())
    before, after = cells(sys.argv[1]), cells(sys.argv[2])
    differ = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    for frontend, engine in differ:
        print(f"{frontend} x engine {engine}:\n  before {before.get((frontend, engine))}\n"
              f"  after  {after.get((frontend, engine))}")
    print(f"{len(before.keys() & after.keys())} cells in both, {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
