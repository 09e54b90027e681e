"""The matrix database: one row per frontend x engine cell, as ``can-i-deploy`` and SQL read it.

``matrix_cells`` keeps the newest judgement of each cell: the verdict, the
prediction and the observation side by side (verdicts as text, evidence as
JSON), each kind of request's verdict (``by_kind``, JSON), and when it was
observed. ``matrix_runs`` says which command filled
it, when, and how long it took. Saving a run replaces the cells it judged
and keeps the others, so several runs build one matrix.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import msgspec
import sqlite_utils

from replay_proxy.clock import utc_now
from replay_proxy.matrix import Cell
from replay_proxy.store.files import open_read_only

CELLS = "matrix_cells"
RUNS = "matrix_runs"


def save(path: Path, cells: list[Cell], command: str, seconds: float) -> None:
    """Keep ``cells`` in the matrix database at ``path`` (``writable``)."""
    writable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite_utils.Database(path)
    db[RUNS].insert({"started_at": utc_now("seconds"),
                     "command": command, "seconds": round(seconds, 1), "cells": len(cells),
                     "observed": sum(c.observed is not None for c in cells)}, pk="id")
    rows = []
    for cell in cells:
        old = _row_cell(db, cell.frontend, cell.engine)
        if cell.observed is None and old is not None and old.observed is not None:
            cell.observed, cell.observed_at = old.observed, old.observed_at  # a prediction run keeps what was seen
        rows.append({"frontend": cell.frontend, "engine": cell.engine, "verdict": cell.verdict.value,
                     "predicted": cell.predicted.verdict.value,
                     "observed": cell.observed and cell.observed.verdict.value,
                     "agrees": cell.agrees, "observed_at": cell.observed_at,
                     "by_kind": {kind: cell.verdict_for([kind]).value for kind in cell.kinds},
                     "seconds": cell.observed and cell.observed.seconds,
                     "cell": msgspec.json.encode(cell).decode()})
    db[CELLS].upsert_all(rows, pk=("frontend", "engine"), column_order=("frontend", "engine", "verdict"),
                         alter=True)  # (a database made before a column was added gains it)
    db.close()


def writable(path: Path) -> None:
    """That cells can be kept at ``path``: a new or empty file, or a matrix database already (never another
    file); what saves there checks it before it starts work."""
    if path.exists() and (path.is_dir() or path.stat().st_size):
        load(path)


def load(path: Path) -> list[Cell]:
    """The cells kept in the matrix database at ``path``, read only (``NotReadable``: it is none)."""
    with contextlib.closing(open_read_only(path, "matrix database", CELLS)) as connection:
        return [msgspec.json.decode(cell, type=Cell) for (cell,) in connection.execute(f"SELECT cell FROM {CELLS}")]


def _row_cell(db: sqlite_utils.Database, frontend: str, engine: str) -> Cell | None:
    if CELLS not in db.table_names():
        return None
    row = next(db.query(f"SELECT cell FROM {CELLS} WHERE frontend = ? AND engine = ?", [frontend, engine]), None)
    return msgspec.json.decode(row["cell"], type=Cell) if row else None

