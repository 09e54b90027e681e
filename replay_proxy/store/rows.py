"""From one decoded message to the rows it contributes to each table."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import msgspec

from replay_proxy.store.tables import TABLES, sampling_columns
from replay_proxy.wire.capture import CapturedFrame
from replay_proxy.wire.messages import Kind, Message
from replay_proxy.wire.schema import Schema
from replay_proxy.wire.values import decode_msgpack, to_json

_raw = msgspec.msgpack.Encoder()
HANDSHAKE_KINDS = {Kind.HELLO, Kind.INIT, Kind.READY, Kind.REGISTRATION}
# Output fields with a column of their own; the rest go to "other" when set.
OUTPUT_COLUMNS = {"request_id", "new_token_ids", "finish_reason", "stop_reason",
                  "num_nans_in_logits", "new_logprobs", "events"}


def _sqlite_value(value: int) -> int | str:
    """SQLite integers are signed 64-bit; Python's utility call ids are u64: keep those as text."""
    return value if -(2**63) <= value < 2**63 else str(value)


class Rows:
    """Rows for every table, accumulated over a batch of frames."""

    def __init__(self):
        self.tables: dict[str, list[tuple]] = defaultdict(list)

    def _add(self, table: str, **row: Any) -> None:
        values = [row.get(c) for c in TABLES[table][0]]
        self.tables[table].append(tuple([_sqlite_value(v) if type(v) is int else v for v in values]))

    def add_frame(self, session_id: int, frame: CapturedFrame, message: Message, schema: Schema) -> None:
        """A frame's row (its bytes, where they went, its named fields) and every concept row it makes."""
        where = dict(session_id=session_id, seq=frame.seq, ts_ns=frame.ts_ns,
                     engine_index=frame.engine_index, client_index=frame.client_index)
        error = message.error
        try:
            self._concepts(where, frame, message, schema)
        except Exception as exc:  # noqa: BLE001 - an odd frame must not stop the recording
            error = f"{error}; " if error else ""
            error += f"recorder could not tabulate it: {type(exc).__name__}: {exc}"
        self._add("frames", **where, channel=str(frame.channel), direction=str(frame.direction),
                  kind=str(message.kind), n_parts=len(frame.parts), nbytes=sum(map(len, frame.parts)),
                  raw=_raw.encode(frame.parts), forwarded_raw=_raw.encode(frame.forwarded) if frame.forwarded else None,
                  decoded=to_json(message.fields), decode_error=error,
                  flags=to_json(message.flags) if message.flags else None)

    def _concepts(self, where: dict, frame: CapturedFrame, message: Message, schema: Schema) -> None:
        fields, kind = message.fields, message.kind
        if kind is Kind.ENGINE_CORE_DEAD:  # a bare sentinel: no fields
            self.add_engine_event(where["session_id"], where["seq"], frame.ts_ns, frame.engine_index,
                                  "ENGINE_CORE_DEAD", f"on the output socket of API server {frame.client_index}")
        if not isinstance(fields, dict):
            return
        if kind in HANDSHAKE_KINDS:
            rewritten = None
            if frame.forwarded:
                rewritten = to_json(decode_msgpack(frame.forwarded[0]))
            self._add("handshakes", **where, kind=str(kind), payload=to_json(fields),
                      rewritten=rewritten, vllm_version=fields.get("vllm_version"))
        elif kind is Kind.ADD:
            self._request(where, fields, schema)
        elif kind in (Kind.OUTPUTS, Kind.UTILITY_OUTPUT):
            self._outputs(where, fields, schema)
        elif kind is Kind.ABORT:
            for position, request_id in enumerate(fields["request_ids"]):
                self._add("aborts", **where, position=position, request_id=request_id)
        elif kind is Kind.UTILITY:
            self._add("utility_requests", **where, call_id=fields["call_id"],
                      method=fields["method"], args=to_json(fields["args"]))

    def add_engine_event(self, session_id: int, seq: int, ts_ns: int, engine_index: int | None,
                         name: str, detail: str) -> None:
        self._add("engine_events", session_id=session_id, seq=seq, ts_ns=ts_ns,
                  engine_index=engine_index, event=name, detail=detail)

    def _request(self, where: dict, fields: dict, schema: Schema) -> None:
        params = fields.get("sampling_params")
        effective = {}
        if isinstance(params, dict):
            effective = {c: schema.sampling_value(params, c) for c in sampling_columns()}
            effective = {c: v for c, v in effective.items() if v is None or not isinstance(v, (list, dict))}
        prompt = fields.get("prompt_token_ids")
        self._add("requests", **where, **effective, request_id=fields.get("request_id"),
                  external_req_id=fields.get("external_req_id"),
                  prompt_len=len(prompt) if isinstance(prompt, list) else None,
                  prompt_token_ids=to_json(prompt), arrival_time=fields.get("arrival_time"),
                  data_parallel_rank=fields.get("data_parallel_rank"), priority=fields.get("priority"),
                  sampling_params=to_json(params))

    def _outputs(self, where: dict, fields: dict, schema: Schema) -> None:
        utility = fields.get("utility_output")
        if isinstance(utility, dict):
            self._add("utility_results", **where, call_id=utility.get("call_id"),
                      failure_message=utility.get("failure_message"), result=to_json(utility.get("result")))
        stamp = fields.get("timestamp")  # the engine's time.monotonic() when it made these outputs
        engine_time = stamp if type(stamp) is float and stamp > 0 else None
        for position, output in enumerate(fields.get("outputs") or []):
            if not isinstance(output, dict):
                continue
            tokens = output.get("new_token_ids")
            finish = output.get("finish_reason")
            stop = output.get("stop_reason")
            other = {k: v for k, v in output.items()
                     if k not in OUTPUT_COLUMNS and v not in (None, 0, [], {})}
            self._add("outputs", **where, position=position, engine_time_s=engine_time,
                      request_id=output.get("request_id"),
                      new_token_ids=to_json(tokens),
                      num_new_tokens=len(tokens) if isinstance(tokens, list) else None,
                      finish_reason=schema.finish_name(finish),
                      stop_reason=None if stop is None else str(stop),
                      num_nans_in_logits=output.get("num_nans_in_logits"),
                      new_logprobs=to_json(output.get("new_logprobs")),
                      events=to_json(output.get("events")), other=to_json(other) if other else None)

