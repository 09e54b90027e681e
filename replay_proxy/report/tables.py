"""Rows for the terminal: query results (table, JSON or CSV) and a struct's schema history."""

from __future__ import annotations

import csv
import json
import sys
from typing import Any, Literal

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from replay_proxy.compare.schema_history import FieldHistory

Form = Literal["table", "json", "csv"]


def print_rows(rows: list[dict[str, Any]], form: Form, console: Console, title: str | None = None) -> None:
    """JSON and CSV go to standard output as they are; a table to ``console``."""
    if form == "json":
        sys.stdout.write(json.dumps(rows, indent=1, default=_bytes_hex) + "\n")
    elif form == "csv":
        if rows:
            writer = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows({k: _bytes_hex(v) if isinstance(v, bytes) else v for k, v in r.items()}
                             for r in rows)
    else:
        table = Table(title=title)
        for column in (rows[0] if rows else {}):
            table.add_column(column, overflow="fold")
        for row in rows:  # Text, not str: a cell like [null] is data, not rich markup
            table.add_row(*(Text("" if v is None else _bytes_hex(v) if isinstance(v, bytes) else str(v))
                            for v in row.values()))
        console.print(table)
        console.print(f"{len(rows)} row{'s' if len(rows) != 1 else ''}", style="dim")


def _bytes_hex(value: Any) -> str:
    if isinstance(value, bytes):
        return value.hex() if len(value) <= 64 else f"<{len(value)} bytes>"
    raise TypeError(type(value).__name__)


def print_history(history: list[FieldHistory], title: str, console: Console, *, as_json: bool = False) -> None:
    if as_json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(history)).decode() + "\n")
        return
    table = Table(title=title)
    for column in ("field", "first", "last", "position", "type", "changes"):
        table.add_column(column)
    for h in history:
        changes = "; ".join(f"{c.release}: {c.what} {c.before!r} -> {c.after!r}" for c in h.changes)
        table.add_row(h.field, h.first, h.last, "" if h.position is None else str(h.position), h.type, changes)
    console.print(table)
