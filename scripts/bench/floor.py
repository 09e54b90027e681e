"""The minimal recording pipeline: the floor the benchmarks hold the writer to.

msgspec decodes each EngineCoreOutputs into typed array-like Structs (the
fields it does not tabulate left encoded), a tuple is made per output row,
and ``executemany`` inserts them into a keyless table of ``output_rows``'
columns; with ``frames``, every message's raw bytes go into a keyless table
as well. No checks, no other tables: what any recorder must at least do.

``MinimalRequests`` is the same for ADDs: each EngineCoreRequest decoded
into a typed Struct, a tuple a request with ``requests``' columns (the
sampling columns as sent, JSON where the table keeps JSON), inserted into a
table of those columns with its key and index (a request is looked up by
its id), and each message's raw bytes into a keyless table.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from replay_proxy.store.tables import INDEXES, PAGE_BYTES, TABLES, sampling_columns, written


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


class Request(msgspec.Struct, array_like=True):
    """An EngineCoreRequest up to the last field the requests table holds (msgspec ignores what follows)."""

    request_id: str
    prompt_token_ids: list[int] | None
    mm_features: msgspec.Raw
    sampling_params: dict | None
    pooling_params: msgspec.Raw
    arrival_time: float
    lora_request: msgspec.Raw
    cache_salt: msgspec.Raw
    data_parallel_rank: int | None
    prompt_embeds: msgspec.Raw
    prompt_is_token_ids: msgspec.Raw
    client_index: msgspec.Raw
    current_wave: msgspec.Raw
    priority: int
    trace_headers: msgspec.Raw
    resumable: msgspec.Raw
    external_req_id: str | None


def _connect(db_path: Path) -> sqlite3.Connection:
    connection = sqlite3.connect(db_path)
    connection.execute(f"PRAGMA page_size={PAGE_BYTES}")
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=NORMAL")
    return connection


class MinimalRequests:
    """Decode, a tuple a request, ``executemany``; one transaction a ``write`` call."""

    def __init__(self, db_path: Path):
        self.connection = _connect(db_path)
        columns, key = TABLES["requests"]
        self.connection.execute(f"CREATE TABLE requests ({', '.join(columns)}, PRIMARY KEY ({', '.join(key)}))")
        for k, index in enumerate(INDEXES["requests"]):
            self.connection.execute(f"CREATE INDEX requests_{k} ON requests ({', '.join(index)})")
        self.connection.execute("CREATE TABLE frames (seq, raw)")
        given = written("requests")  # (a copy's mark, ``copied``, is no floor's)
        self.insert = f"INSERT INTO requests ({', '.join(given)}) VALUES ({', '.join('?' for _ in given)})"
        self.sampling = list(sampling_columns())
        self.decode = msgspec.msgpack.Decoder(Request).decode
        self.json = msgspec.json.Encoder().encode

    def write(self, messages: list[tuple[int, list[bytes]]]) -> None:
        """Messages as (seq, parts): each an ADD's request type and body."""
        rows, frames, sampling, json = [], [], self.sampling, self.json
        for seq, parts in messages:
            frames.append((seq, b"".join(parts)))
            r = self.decode(parts[1])
            params = r.sampling_params or {}
            rows.append((1, seq, seq, 0, 0, r.request_id, r.external_req_id, len(r.prompt_token_ids),
                         json(r.prompt_token_ids).decode(), r.arrival_time, r.data_parallel_rank, r.priority,
                         *[params.get(c) for c in sampling], json(params).decode()))
        with self.connection:
            self.connection.executemany(self.insert, rows)
            self.connection.executemany("INSERT INTO frames VALUES (?, ?)", frames)

    def close(self) -> None:
        self.connection.close()


class MinimalPipeline:
    """Decode, a tuple a row, ``executemany``; one transaction a ``write`` call."""

    def __init__(self, db_path: Path, *, frames: bool):
        self.connection = _connect(db_path)
        columns = TABLES["output_rows"][0]
        self.connection.execute(f"CREATE TABLE output_rows ({', '.join(columns)})")
        given = written("output_rows")
        self.insert = f"INSERT INTO output_rows ({', '.join(given)}) VALUES ({', '.join('?' for _ in given)})"
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
