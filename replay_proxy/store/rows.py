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

from replay_proxy.store.tables import sampling_columns, written
from replay_proxy.wire.capture import CapturedFrame
from replay_proxy.wire.messages import (
    ENGINE_CORE_DEAD, HANDSHAKE_KINDS, Channel, Direction, Kind, Message, WireDecoder)
from replay_proxy.wire.schema import Flag, Schema
from replay_proxy.wire.typed import OUTPUT_COLUMNS, typed_outputs, typed_requests
from replay_proxy.wire.values import decode_msgpack, to_json, token_ids

_raw = msgspec.msgpack.Encoder()
_json = msgspec.json.Encoder()
# EngineCoreRequest fields the requests table holds as sent (sampling_params as its JSON too).
REQUEST_COLUMNS = frozenset({"request_id", "external_req_id", "prompt_token_ids", "arrival_time",
                             "data_parallel_rank", "priority", "sampling_params"})
# Rows are built as tuples in their table's column order (no dict a row: ADDs are a busy frontend's traffic).
_REQUEST_HEAD = ("session_id", "seq", "ts_ns", "engine_index", "client_index", "request_id", "external_req_id",
                 "prompt_len", "prompt_token_ids", "arrival_time", "data_parallel_rank", "priority")
assert written("requests") == [*_REQUEST_HEAD, *sampling_columns(), "sampling_params"]
assert written("frames") == ["session_id", "seq", "ts_ns", "channel", "direction", "engine_index", "client_index",
                                  "kind", "n_parts", "nbytes", "raw", "forwarded_raw", "decoded", "decode_error",
                                  "flags", "engine_time_s"]
_SQLITE_AS_IS = frozenset({str, float, bool, bytes, type(None)})


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


def _engine_time(stamp: Any) -> float | None:
    """EngineCoreOutputs.timestamp: the engine's time.monotonic() when it made the outputs (0.0: unset)."""
    return stamp if type(stamp) is float and stamp > 0 else None


def _compact(fields: dict[str, Any], held: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A frame's fields for ``frames.decoded`` where tables hold its substance (an ADD, an
    EngineCoreOutputs): without what they hold, and without nil values two levels deep (for those
    json_extract gives NULL either way, and ``raw`` keeps the frame as sent)."""
    return {k: {k2: v2 for k2, v2 in v.items() if v2 is not None} if type(v) is dict else v
            for k, v in fields.items() if v is not None and k not in held}


def _stop_reason(stop: object) -> int | str | None:
    """A stop token or stop string as it came (``output_rows.stop_reason`` keeps the type); anything else as JSON."""
    return stop if stop is None or type(stop) is int or type(stop) is str else to_json(stop)


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
        self.frames_undecodable = 0  # frames whose row has a decode error
        self.newest_ts_ns = 0  # when the newest of these frames crossed the proxy
        # Frames their schema does not describe, with that schema (the one in use when each was named).
        self.flagged: list[tuple[CapturedFrame, Kind, tuple[Flag, ...], Schema]] = []
        self._defaults: dict[int, tuple[list[Any], dict[str, int]]] = {}  # by id(schema): they outlive a batch

    def _add(self, table: str, **row: Any) -> None:
        self.tables[table].append(_sqlite_row(map(row.get, written(table))))

    def add(self, session_id: int, frame: CapturedFrame, decoder: WireDecoder) -> Kind:
        """Decode a captured frame and add its rows; return its kind."""
        if frame.channel is Channel.OUTPUT and frame.direction is Direction.TO_FRONTEND \
                and frame.parts[:1] != [ENGINE_CORE_DEAD]:
            typed = typed_outputs(decoder.schema)
            read = typed.read(frame.parts) if typed is not None else None
            if read is not None:
                self._output_rows(session_id, frame.seq, read.outputs, decoder.schema)
                self._frame(session_id, frame, Kind.OUTPUTS, to_json(_compact(read.fields)), None, read.flags,
                            _engine_time(read.fields.get("timestamp")), decoder.schema)
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
        fields = message.fields
        try:
            held = self._concepts(where, frame, message, schema)
            if held:  # what the concept tables hold is not kept twice
                fields = _compact(fields, held)
        except Exception as exc:  # noqa: BLE001 - an odd frame must not stop the recording
            error = f"{error}; " if error else ""
            error += f"recorder could not tabulate it: {type(exc).__name__}: {exc}"
        engine_time = _engine_time(fields.get("timestamp")) if message.kind in (Kind.OUTPUTS, Kind.UTILITY_OUTPUT) \
            and isinstance(fields, dict) else None
        self._frame(session_id, frame, message.kind, to_json(fields), error, message.flags, engine_time, schema)

    def _frame(self, session_id: int, frame: CapturedFrame, kind: Kind, decoded: str | None, error: str | None,
               flags: tuple[Flag, ...], engine_time: float | None, schema: Schema) -> None:
        if flags:
            self.flagged.append((frame, kind, flags, schema))
        self.frames_undecodable += error is not None
        self.newest_ts_ns = max(self.newest_ts_ns, frame.ts_ns)
        self.tables["frames"].append((
            session_id, frame.seq, frame.ts_ns, str(frame.channel), str(frame.direction), frame.engine_index,
            frame.client_index, str(kind), len(frame.parts), sum(map(len, frame.parts)), _raw.encode(frame.parts),
            _raw.encode(frame.forwarded) if frame.forwarded else None, decoded, error,
            to_json(flags) if flags else None, engine_time))

    def _output_rows(self, session_id: int, seq: int, outputs: Sequence[tuple[Any, ...] | None], schema: Schema,
                     others: list[str | None] | None = None) -> None:
        """The rows of one frame's outputs, in ``output_rows``' column order (a busy engine's are made here).

        ``outputs``: per position, (request_id, new_token_ids, finish_reason, stop_reason, num_nans_in_logits)
        as on the wire, or None for one that is not tabulated; ``others``: per position, the JSON
        object of its other set fields, where any is set.
        """
        numbers, append, finish_name, encode = self.request_numbers, self.tables["output_rows"].append, \
            schema.finish_name, _json.encode
        for position, output in enumerate(outputs):
            if output is None:
                continue
            request_id, tokens, finish, stop, nans = output
            number = numbers.get(request_id)
            if number is None:
                number = numbers[request_id] = len(numbers) + 1
                self.new_request_ids.append(request_id)
                self.tables["request_ids"].append((session_id, number, request_id))
            append((session_id, number, seq, position, encode(tokens).decode(), len(tokens),
                    None if finish is None else finish_name(finish), _stop_reason(stop), nans,
                    others[position] if others else None))

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
            return frozenset({"outputs"}) if self._outputs(where, fields, schema) else frozenset()
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
        others: list[str | None] = []
        for output in outputs:
            if not (isinstance(output, dict) and isinstance(output.get("request_id"), str)
                    and isinstance(output.get("new_token_ids"), list)):
                rows.append(None)  # kept in the frame's decoded form instead
                others.append(None)
                continue
            rows.append((output["request_id"], output["new_token_ids"], output.get("finish_reason"),
                         output.get("stop_reason"), _sqlite_value(output.get("num_nans_in_logits"))))
            other = {k: v for k, v in output.items() if k not in OUTPUT_COLUMNS and v not in (None, 0, [], {})}
            others.append(to_json(other) if other else None)
        self._output_rows(where["session_id"], where["seq"], rows, schema, others)
        return None not in rows
