"""The minimal recording pipeline: the floor the benchmarks hold the writer to.

msgspec decodes each EngineCoreOutputs into typed array-like Structs (the
fields it does not tabulate left encoded), a tuple is made per output row,
and ``executemany`` inserts them into a keyless table of ``output_rows``'
columns; with ``frames``, every message's raw bytes go into a keyless table
as well. No checks, no other tables: what any recorder must at least do.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from replay_proxy.store.tables import PAGE_BYTES, TABLES  # noqa: E402


class Output(msgspec.Struct, array_like=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: msgspec.Raw = msgspec.Raw()  # left encoded: the floor names only what it tabulates
    new_prompt_logprobs_tensors: msgspec.Raw = msgspec.Raw()
    pooling_output: msgspec.Raw = msgspec.Raw()
    finish_reason: int | None = None
    stop_reason: int | str | None = None
    events: msgspec.Raw = msgspec.Raw()
    kv_transfer_params: msgspec.Raw = msgspec.Raw()
    ec_transfer_params: msgspec.Raw = msgspec.Raw()
    trace_headers: msgspec.Raw = msgspec.Raw()
    prefill_stats: msgspec.Raw = msgspec.Raw()
    routed_experts: msgspec.Raw = msgspec.Raw()
    num_nans_in_logits: int = 0


class Outputs(msgspec.Struct, array_like=True):
    engine_index: int
    outputs: list[Output]
    scheduler_stats: msgspec.Raw = msgspec.Raw()  # left encoded: the floor names only what it tabulates
    timestamp: float = 0.0


class MinimalPipeline:
    """Decode, a tuple a row, ``executemany``; one transaction a ``write`` call."""

    def __init__(self, db_path: Path, *, frames: bool):
        self.connection = sqlite3.connect(db_path)
        self.connection.execute(f"PRAGMA page_size={PAGE_BYTES}")
        self.connection.execute("PRAGMA journal_mode=WAL")
        self.connection.execute("PRAGMA synchronous=NORMAL")
        columns = TABLES["output_rows"][0]
        self.connection.execute(f"CREATE TABLE output_rows ({', '.join(columns)})")
        self.insert = f"INSERT INTO output_rows VALUES ({', '.join('?' for _ in columns)})"
        self.frames = frames
        if frames:
            self.connection.execute("CREATE TABLE frames (seq, raw)")
        self.numbers: dict[str, int] = {}
        self.decode = msgspec.msgpack.Decoder(Outputs).decode
        self.tokens_json = msgspec.json.Encoder().encode

    def write(self, messages: list[tuple[int, list[bytes]]]) -> None:
        """Messages as (seq, parts); those that are not one EngineCoreOutputs add only their frame."""
        rows, frames = [], []
        numbers, tokens_json = self.numbers, self.tokens_json
        for seq, parts in messages:
            if self.frames:
                frames.append((seq, b"".join(parts)))
            try:
                message = self.decode(parts[-1])
            except msgspec.DecodeError:
                continue
            for position, o in enumerate(message.outputs):
                number = numbers.setdefault(o.request_id, len(numbers) + 1)
                rows.append((1, number, seq, position, tokens_json(o.new_token_ids).decode(), len(o.new_token_ids),
                             o.finish_reason, o.stop_reason, o.num_nans_in_logits, None))
        with self.connection:
            self.connection.executemany(self.insert, rows)
            if frames:
                self.connection.executemany("INSERT INTO frames VALUES (?, ?)", frames)

    def close(self) -> None:
        self.connection.close()
