"""Rows for the terminal: query results (table, JSON or CSV) and a struct's schema history."""

from __future__ import annotations

import csv
import json
import sys
from typing import Any, Literal

import msgspec
from rich.console import Console
from rich.measure import Measurement
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
        cells = [{k: _cell(v) for k, v in row.items()} for row in rows]
        table = Table(title=title)
        for column in (rows[0] if rows else {}):
            table.add_column(column, overflow="fold")
        for row in cells:
            table.add_row(*row.values())
        if fits(table, console):
            console.print(table)
        else:  # too wide to read as columns: a row at a time, a line per column (as psql's \x)
            if title:
                console.print(title, style="italic")
            for number, row in enumerate(cells, 1):
                record = Table.grid(padding=(0, 2))
                record.add_column(style="bold", no_wrap=True)
                record.add_column(overflow="fold")
                for column, value in row.items():
                    record.add_row(column, value)
                console.rule(f"row {number}", align="left", style="dim")
                console.print(record)
        console.print(f"{len(rows)} row{'s' if len(rows) != 1 else ''}", style="dim")


def fits(table: Table, console: Console) -> bool:
    """Whether ``table`` shows every cell whole on one line at the console's width (a narrower one folds
    each name and value into slivers: the caller shows it another way)."""
    return Measurement.get(console, console.options.update(max_width=10**6), table).maximum <= console.width


def _cell(value: Any) -> Text:
    """Text, not str: a cell like [null] is data, not rich markup."""
    return Text("" if value is None else _bytes_hex(value) if isinstance(value, bytes) else str(value))


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
