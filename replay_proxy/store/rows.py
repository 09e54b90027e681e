"""From one captured frame to the rows it contributes to each table.

A conforming EngineCoreOutputs or request (nearly every frame of a busy
engine and its frontend) is read by the typed fast path (``wire/typed.py``);
every other frame is named by the generic decoder. Both end in the same row
builders here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from replay_proxy.store import raw
from replay_proxy.store.tables import PREFIX_CACHE, sampling_columns, scheduler_columns, written
from replay_proxy.wire.capture import CapturedFrame
from replay_proxy.wire.messages import (
    ENGINE_CORE_DEAD, HANDSHAKE_KINDS, Channel, Direction, Kind, Message, WireDecoder)
from replay_proxy.wire.schema import Flag, Schema, StructSchema
from replay_proxy.wire.typed import OUTPUT_COLUMNS, typed_outputs, typed_requests
from replay_proxy.wire.values import decode_msgpack, to_json, token_ids

_json = msgspec.json.Encoder()
# EngineCoreRequest fields the requests table holds as sent (sampling_params as its JSON too).
REQUEST_COLUMNS = frozenset({"request_id", "external_req_id", "prompt_token_ids", "arrival_time",
                             "data_parallel_rank", "priority", "sampling_params"})
# Rows are built as tuples in their table's column order (no dict a row: ADDs are a busy frontend's traffic).
_REQUEST_HEAD = ("session_id", "seq", "ts_ns", "engine_index", "client_index", "request_id", "external_req_id",
                 "prompt_len", "prompt_token_ids", "arrival_time", "data_parallel_rank", "priority")
assert written("requests") == [*_REQUEST_HEAD, *sampling_columns(), "sampling_params"]
assert written("frames") == ["session_id", "seq", "ts_ns", "channel", "direction", "engine_index", "client_index",
                                  "kind", "n_parts", "nbytes", "decoded", "decode_error", "flags", "engine_time_s"]
_SQLITE_AS_IS = frozenset({str, float, bool, bytes, type(None)})
# The struct a message's fields are, for the kinds whose ``decoded`` leaves out defaults (``_compact``).
_STRUCTS = {Kind.ADD: "EngineCoreRequest", Kind.OUTPUTS: "EngineCoreOutputs", Kind.UTILITY_OUTPUT: "EngineCoreOutputs"}
# An EngineCoreOutputs' fields that a table or column holds: its outputs (``frame_outputs``), its time (engine_time_s).
_STEP_HELD = frozenset({"outputs", "timestamp"})
_STATS_HELD = frozenset({"scheduler_stats"})  # (``scheduler_stats``: a row of its own)
_SCALARS = frozenset({int, float, bool, str})


def _sqlite_value(value: Any) -> Any:
    """A wire value as SQLite can hold it. SQLite integers are signed 64-bit (Python's utility call ids are u64):
    those past it as text (exact only in a column of no affinity: ``tables.py``); arrays and maps (a drifted
    peer's, where a column wants a scalar) as JSON."""
    if type(value) is int:
        return value if -(2**63) <= value < 2**63 else str(value)
    return value if type(value) in _SQLITE_AS_IS else to_json(value)


def _sqlite_row(values: Iterable[Any]) -> tuple[Any, ...]:
    return tuple([v if type(v) in _SQLITE_AS_IS else _sqlite_value(v) for v in values])


def _sampling_value(value: Any) -> Any:
    """A sampling parameter's column: lists and maps have none (``sampling_params`` holds them)."""
    return None if type(value) is list or type(value) is dict else _sqlite_value(value)


def _held_elsewhere(fields: dict[str, Any], kind: Kind, schema: Schema, held: frozenset[str]) -> str | None:
    """``frames.decoded`` of a frame whose substance tables hold (``held``): what is left (``_compact``), or null
    where nothing is (a busy engine's step, an ADD: most frames)."""
    left = _compact(fields, schema.structs.get(_STRUCTS.get(kind, "")), schema, held)
    return to_json(left) if left else None


def _engine_time(stamp: Any) -> float | None:
    """EngineCoreOutputs.timestamp: the engine's time.monotonic() when it made the outputs (0.0: unset)."""
    return stamp if type(stamp) is float and stamp > 0 else None


def _compact(fields: dict[str, Any], struct: StructSchema | None, schema: Schema,
             held: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A frame's fields for ``frames.decoded`` where tables hold its substance (an ADD, an EngineCoreOutputs):
    without what they hold, and without the values that are their release's default, in nested structs too (a
    step's scheduler stats are mostly zeros and empty maps): json_extract reads those as NULL, and the frame's
    bytes (``raw.py``) keep them as sent."""
    fields_of = struct.by_name if struct is not None else {}
    compact = {}
    for name, value in fields.items():
        field = fields_of.get(name)
        if value is None or name in held or (field is not None and not field.required and value == field.default):
            continue
        if type(value) is dict and field is not None and field.struct in schema.structs:
            value = _compact(value, schema.structs[field.struct], schema)
            if not value:  # (every field at its default)
                continue
        compact[name] = value
    return compact


class Rows:
    """Rows for every table, accumulated over a batch of frames.

    ``request_numbers`` is the session's: request id -> its number in ``request_ids``, shared by
    every batch. Ids first numbered in this batch are in ``new_request_ids``, to be forgotten if the
    batch is not written.
    """

    def __init__(self, request_numbers: dict[str, int] | None = None):
        self.tables: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
        self.request_numbers = {} if request_numbers is None else request_numbers
        self.new_request_ids: list[str] = []
        # Each frame's bytes, as an item of the batch its transaction writes (``raw.py``), and its seq.
        self.raw_seqs: list[int] = []
        self.raw_items: list[bytes] = []
        self.frames_undecodable = 0  # frames whose row has a decode error
        self.newest_ts_ns = 0  # when the newest of these frames crossed the proxy
        # Frames their schema does not describe, with that schema (the one in use when each was named).
        self.flagged: list[tuple[CapturedFrame, Kind, tuple[Flag, ...], Schema]] = []
        self._defaults: dict[int, tuple[list[Any], dict[str, int]]] = {}  # by id(schema): they outlive a batch
        self._scheduler_columns = {name: at for at, name in enumerate(scheduler_columns())}

    def _add(self, table: str, **row: Any) -> None:
        self.tables[table].append(_sqlite_row(map(row.get, written(table))))

    def add(self, session_id: int, frame: CapturedFrame, decoder: WireDecoder) -> Kind:
        """Decode a captured frame and add its rows; return its kind."""
        if frame.channel is Channel.OUTPUT and frame.direction is Direction.TO_FRONTEND \
                and frame.parts[:1] != [ENGINE_CORE_DEAD]:
            typed = typed_outputs(decoder.schema)
            read = typed.read(frame.parts) if typed is not None else None
            if read is not None:
                schema = decoder.schema
                self._frame_outputs(session_id, frame.seq, read.outputs, schema)
                held = _STEP_HELD | self._scheduler_stats(session_id, frame.seq, read.fields, schema)
                self._frame(session_id, frame, Kind.OUTPUTS, _held_elsewhere(read.fields, Kind.OUTPUTS, schema, held),
                            None, read.flags, _engine_time(read.fields.get("timestamp")), schema)
                return Kind.OUTPUTS
        schema = decoder.schema
        message = None
        if frame.channel is Channel.INPUT and frame.direction is Direction.TO_ENGINE:
            schema = decoder.request_schema(frame.parts)  # the frontend's release
            if decoder.reader_flags:  # its engines' release does not read what it sends: drift, said once
                self.flagged.append((frame, Kind.ADD, decoder.reader_flags, decoder.schema))
                decoder.reader_flags = ()
            requests = typed_requests(schema)
            message = requests.read(frame.parts) if requests is not None else None
        if message is None:
            message = decoder.decode(frame.channel, frame.direction, frame.parts)
        self.add_frame(session_id, frame, message, schema)
        return message.kind

    def add_frame(self, session_id: int, frame: CapturedFrame, message: Message, schema: Schema) -> None:
        """A frame's row (its bytes, where they went, its named fields) and every concept row it makes."""
        where = dict(session_id=session_id, seq=frame.seq, ts_ns=frame.ts_ns,
                     engine_index=frame.engine_index, client_index=frame.client_index)
        error = message.error
        decoded = None
        try:
            held = self._concepts(where, frame, message, schema)
            if held:  # what the concept tables hold is not kept twice
                decoded = _held_elsewhere(message.fields, message.kind, schema, held)
        except Exception as exc:  # noqa: BLE001 - an odd frame must not stop the recording
            error = f"{error}; " if error else ""
            error += f"recorder could not tabulate it: {type(exc).__name__}: {exc}"
            held = frozenset()
        engine_time = _engine_time(message.fields.get("timestamp")) if message.kind in (
            Kind.OUTPUTS, Kind.UTILITY_OUTPUT) and isinstance(message.fields, dict) else None
        self._frame(session_id, frame, message.kind, decoded if held else to_json(message.fields), error,
                    message.flags, engine_time, schema)

    def _frame(self, session_id: int, frame: CapturedFrame, kind: Kind, decoded: str | None, error: str | None,
               flags: tuple[Flag, ...], engine_time: float | None, schema: Schema) -> None:
        if flags:
            self.flagged.append((frame, kind, flags, schema))
        self.frames_undecodable += error is not None
        self.newest_ts_ns = max(self.newest_ts_ns, frame.ts_ns)
        self.tables["frames"].append((
            session_id, frame.seq, frame.ts_ns, str(frame.channel), str(frame.direction), frame.engine_index,
            frame.client_index, str(kind), len(frame.parts), sum(map(len, frame.parts)), decoded, error,
            to_json(flags) if flags else None, engine_time))
        self.raw_seqs.append(frame.seq)
        self.raw_items.append(raw.item(frame.seq, frame.parts, frame.forwarded or None))

    def _scheduler_stats(self, session_id: int, seq: int, fields: dict[str, Any], schema: Schema) -> frozenset[str]:
        """The ``scheduler_stats`` row of a step's fields, if they carry stats: the fields it holds."""
        stats = fields.get("scheduler_stats")
        if type(stats) is not dict:
            return frozenset()
        columns = self._scheduler_columns
        values: list[Any] = [None] * len(columns)
        rest: dict[str, Any] = {}
        for name, value in stats.items():
            if name == "prefix_cache_stats" and type(value) is dict:
                for cache_name, cache_value in value.items():
                    at = columns.get(PREFIX_CACHE + cache_name)
                    if at is not None and type(cache_value) in _SCALARS:
                        values[at] = cache_value
                    else:
                        rest.setdefault(name, {})[cache_name] = cache_value
            elif (at := columns.get(name)) is not None and type(value) in _SCALARS:
                values[at] = value
            elif type(value) is dict and value and all(type(count) is int for count in value.values()):
                rest[name] = {key: count for key, count in value.items() if count}  # counts by stage: zeros left out
            else:
                rest[name] = value
        rest = _compact(rest, schema.structs.get("SchedulerStats"), schema)
        self.tables["scheduler_stats"].append((session_id, seq, *values, to_json(rest) if rest else None))
        return _STATS_HELD

    def _frame_outputs(self, session_id: int, seq: int, outputs: Sequence[tuple[Any, ...] | None], schema: Schema,
                       others: list[dict[str, Any] | None] | None = None) -> None:
        """The ``frame_outputs`` row of one frame's outputs (a busy engine's are made here): each output packed as
        ``tables.py`` says.

        ``outputs``: per position, (request_id, new_token_ids, finish_reason, stop_reason, num_nans_in_logits)
        as on the wire, or None for one that is not tabulated; ``others``: per position, its other set fields,
        where any is set (the generic path's, whose values may be any the wire holds: ``to_json`` writes them).
        """
        numbers, finish_name = self.request_numbers, schema.finish_name
        packed: list[list[Any] | None] = []
        for position, output in enumerate(outputs):
            if output is None:
                packed.append(None)
                continue
            request_id, tokens, finish, stop, nans = output
            number = numbers.get(request_id)
            if number is None:
                number = numbers[request_id] = len(numbers) + 1
                self.new_request_ids.append(request_id)
                self.tables["request_ids"].append((session_id, number, request_id))
            value = [number, tokens, None if nans == 0 else nans, None if finish is None else finish_name(finish), stop,
                     others[position] if others else None]
            while value[-1] is None:
                value.pop()
            packed.append(value)
        if packed:
            self.tables["frame_outputs"].append(
                (session_id, seq, _json.encode(packed).decode() if others is None else to_json(packed)))

    def forget_new_request_ids(self) -> None:
        """The batch was not written: its request numbers are free again."""
        for request_id in self.new_request_ids:
            del self.request_numbers[request_id]
        self.new_request_ids.clear()

    def _concepts(self, where: dict[str, Any], frame: CapturedFrame, message: Message, schema: Schema
                  ) -> frozenset[str]:
        """Add the concept rows of a message; return the fields they hold in full."""
        fields, kind = message.fields, message.kind
        if kind is Kind.ENGINE_CORE_DEAD:  # a bare sentinel: no fields
            self.add_engine_event(where["session_id"], where["seq"], frame.ts_ns, frame.engine_index,
                                  "ENGINE_CORE_DEAD", f"on the output socket of API server {frame.client_index}")
        if not isinstance(fields, dict):
            return frozenset()
        if kind in HANDSHAKE_KINDS:
            rewritten = None
            if frame.forwarded:
                rewritten = to_json(decode_msgpack(frame.forwarded[0]))
            self._add("handshakes", **where, kind=str(kind), payload=to_json(fields),
                      rewritten=rewritten, vllm_version=fields.get("vllm_version"))
        elif kind is Kind.ADD:
            self._request(where, fields, schema)
            return REQUEST_COLUMNS
        elif kind in (Kind.OUTPUTS, Kind.UTILITY_OUTPUT):
            held = self._scheduler_stats(where["session_id"], where["seq"], fields, schema)
            return held | _STEP_HELD if self._outputs(where, fields, schema) else held
        elif kind is Kind.ABORT:
            for position, request_id in enumerate(fields["request_ids"]):
                self._add("aborts", **where, position=position, request_id=request_id)
        elif kind is Kind.UTILITY:
            self._add("utility_requests", **where, call_id=fields["call_id"],
                      method=fields["method"], args=to_json(fields["args"]))
        return frozenset()

    def add_engine_event(self, session_id: int, seq: int, ts_ns: int, engine_index: int | None,
                         name: str, detail: str) -> None:
        self._add("engine_events", session_id=session_id, seq=seq, ts_ns=ts_ns,
                  engine_index=engine_index, event=name, detail=detail)

    def _request(self, where: dict[str, Any], fields: dict[str, Any], schema: Schema) -> None:
        params = fields.get("sampling_params")
        # Each sampling column's value in effect: as sent, else the release's default.
        defaults, column_at = self._sampling_defaults(schema)
        if isinstance(params, dict):
            sampling = defaults.copy()
            for key, value in params.items():
                at = column_at.get(key)
                if at is not None:  # (the common kinds inline: a frontend sends a dozen of these an ADD)
                    sampling[at] = value if type(value) in _SQLITE_AS_IS else _sampling_value(value)
        else:
            sampling = [None] * len(defaults)
        sent = fields.get("prompt_token_ids")
        prompt = token_ids(sent)  # whichever way its release encodes it (as sent where it is not token ids)
        self.tables["requests"].append((
            where["session_id"], where["seq"], where["ts_ns"], where["engine_index"], where["client_index"],
            *_sqlite_row((fields.get("request_id"), fields.get("external_req_id"))),
            len(prompt) if prompt is not None else None, to_json(sent if prompt is None else prompt),
            *_sqlite_row((fields.get("arrival_time"), fields.get("data_parallel_rank"), fields.get("priority"))),
            *sampling, to_json(params)))

    def _sampling_defaults(self, schema: Schema) -> tuple[list[Any], dict[str, int]]:
        """The release's default of each sampling column, in column order, and each column's place there."""
        defaults = self._defaults.get(id(schema))
        if defaults is None:
            columns = list(sampling_columns())
            defaults = self._defaults[id(schema)] = (
                [_sampling_value(schema.sampling_defaults.get(c)) for c in columns],
                {c: at for at, c in enumerate(columns)})
        return defaults

    def _outputs(self, where: dict[str, Any], fields: dict[str, Any], schema: Schema) -> bool:
        utility = fields.get("utility_output")
        if isinstance(utility, dict):
            self._add("utility_results", **where, call_id=utility.get("call_id"),
                      failure_message=utility.get("failure_message"), result=to_json(utility.get("result")))
        outputs = fields.get("outputs") or []
        if not isinstance(outputs, list):
            return False
        rows: list[tuple[Any, ...] | None] = []
        others: list[dict[str, Any] | None] = []
        for output in outputs:
            if not (isinstance(output, dict) and isinstance(output.get("request_id"), str)
                    and isinstance(output.get("new_token_ids"), list)):
                rows.append(None)  # kept in the frame's decoded form instead
                others.append(None)
                continue
            rows.append((output["request_id"], output["new_token_ids"], output.get("finish_reason"),
                         output.get("stop_reason"), output.get("num_nans_in_logits")))
            other = _compact({k: v for k, v in output.items() if k not in OUTPUT_COLUMNS},
                             schema.structs.get("EngineCoreOutput"), schema)
            others.append(other or None)
        self._frame_outputs(where["session_id"], where["seq"], rows, schema, others)
        return None not in rows
