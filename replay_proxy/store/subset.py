"""A session's frames as a subset of its requests keeps them: what ``cut`` writes, and what ``record
--sample-requests`` records (``store/sample.py``). Sans-IO: frames in, frames (or None) out.

Kept: every handshake, registration and READY, engine losses and deaths, utility calls and their
results (``cut``: those at start-up and in its window), the chosen requests' ADDs (simplified by an
``Edit``, for ``shrink``) and ABORTs, and their outputs. An EngineCoreOutputs frame is rebuilt to hold
only the chosen requests' outputs, its other fields and its time as recorded; a frame that loses nothing
keeps its bytes, and one that does not decode is kept as it was.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any, overload

import msgspec

from replay_proxy.wire.capture import CapturedFrame, EngineLoss
from replay_proxy.wire.messages import ENGINE_CORE_DEAD, Channel, Direction, RequestType, request_type
from replay_proxy.wire.registry import schema_for
from replay_proxy.wire.values import decode_msgpack

_encode = msgspec.msgpack.Encoder().encode


class Edit(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A request's ADD, simplified: sampling values back to their defaults, a shorter prompt, fewer tokens."""

    defaults: list[str] = []  # SamplingParams keys taken out (a map struct: absent is its default)
    prompt_len: int | None = None  # the prompt cut to its first this many tokens
    max_tokens: int | None = None


def announced_release(registration: CapturedFrame) -> str | None:
    """The vLLM release an engine's registration names, if it names one."""
    try:
        value = decode_msgpack(registration.parts[0]) if registration.parts and registration.parts[0] else None
    except msgspec.DecodeError:
        return None
    version = value.get("vllm_version") if isinstance(value, dict) else None
    return version if isinstance(version, str) else None


class Cutter:
    """Each frame of the source session as the cut keeps it (None: not kept).

    ``chosen``: the request ids kept (anything that answers ``in``: a set, or ``record``'s keyed sample,
    ``store/sample.py``). ``every_call``: keep every utility call's result, not only those of calls kept
    (live, a call's result may come before the call in the order the proxy reports them)."""

    def __init__(self, chosen: Container[str], vllm_version: str | None, in_window: Any, first_add_ns: int | None,
                 edits: dict[str, Edit] | None = None, every_call: bool = False):
        self.chosen, self.in_window, self.first_add_ns = chosen, in_window, first_add_ns
        self.edits, self.every_call = edits or {}, every_call
        self.schema, _ = schema_for(vllm_version)
        self.calls: set[tuple[int | None, Any, Any]] = set()  # (engine, API server, call id) of the utility calls kept
        self.outputs_left_out = 0  # the outputs of requests not chosen

    @overload
    def frame(self, item: CapturedFrame) -> CapturedFrame | None: ...

    @overload
    def frame(self, item: EngineLoss) -> EngineLoss: ...

    def frame(self, item: CapturedFrame | EngineLoss) -> CapturedFrame | EngineLoss | None:
        if isinstance(item, EngineLoss) or item.channel in (Channel.HANDSHAKE, Channel.COORDINATOR_INPUT):
            return item
        parts = item.parts
        if item.channel is Channel.INPUT:
            if item.direction is Direction.TO_FRONTEND and (version := announced_release(item)):
                self.schema, _ = schema_for(version)  # (its schema says where the request ids are)
            if item.direction is Direction.TO_FRONTEND or not parts or parts == [b"READY"]:
                return item  # registrations, subscriptions
            return self._request(item)
        if parts == [ENGINE_CORE_DEAD]:
            return item
        return self._outputs(item)

    def _request(self, frame: CapturedFrame) -> CapturedFrame | None:
        asks = request_type(frame.channel, frame.direction, frame.parts)
        try:
            body: Any = decode_msgpack(frame.parts[1]) if len(frame.parts) > 1 else None
        except msgspec.DecodeError:
            return frame  # a frame that does not decode is kept as it was
        if asks is RequestType.ADD:
            rid = self.schema.read(body, "EngineCoreRequest", "request_id")
            if rid not in self.chosen:
                return None
            edit = self.edits.get(str(rid))
            return frame if edit is None else msgspec.structs.replace(
                frame, parts=[frame.parts[0], _encode(self._edited(body, edit)), *frame.parts[2:]])
        if asks is RequestType.ABORT and isinstance(body, list):
            kept = [rid for rid in body if rid in self.chosen]
            return None if not kept else frame if len(kept) == len(body) else \
                msgspec.structs.replace(frame, parts=[frame.parts[0], _encode(kept), *frame.parts[2:]])
        if asks is RequestType.UTILITY and isinstance(body, list) and len(body) >= 2:
            start_up = self.first_add_ns is None or frame.ts_ns < self.first_add_ns
            if not (start_up or self.in_window(frame.ts_ns)):
                return None
            self.calls.add((frame.engine_index, body[0], body[1]))
        return frame  # and START_DP_WAVE

    def _edited(self, body: list[Any], edit: Edit) -> list[Any]:
        body = list(body)
        params_at, prompt_at = (self.schema.position("EngineCoreRequest", name)
                                for name in ("sampling_params", "prompt_token_ids"))
        params = body[params_at]
        if isinstance(params, dict):
            params = {k: v for k, v in params.items() if k not in edit.defaults}
            if edit.max_tokens is not None:
                params["max_tokens"] = edit.max_tokens
            body[params_at] = params
        if edit.prompt_len is not None and isinstance(body[prompt_at], list):
            body[prompt_at] = body[prompt_at][:edit.prompt_len]
        return body

    def _outputs(self, frame: CapturedFrame) -> CapturedFrame | None:
        try:
            value = decode_msgpack(frame.parts[0])
        except msgspec.DecodeError:
            return frame
        if not isinstance(value, list):
            return frame  # not an EngineCoreOutputs this schema knows: kept as it is
        read = self.schema.read
        outputs = read(value, "EngineCoreOutputs", "outputs")
        utility = read(value, "EngineCoreOutputs", "utility_output")
        if isinstance(utility, list) and utility and not self.every_call \
                and (frame.engine_index, frame.client_index, utility[0]) not in self.calls:
            utility = None
        kept = [o for o in outputs if read(o, "EngineCoreOutput", "request_id") in self.chosen] \
            if isinstance(outputs, list) else outputs
        if isinstance(outputs, list):
            self.outputs_left_out += len(outputs) - len(kept)
        if (isinstance(outputs, list) and outputs and not kept) and utility is None:
            return None
        if kept == outputs and utility == read(value, "EngineCoreOutputs", "utility_output"):
            return frame
        outputs_at = self.schema.position("EngineCoreOutputs", "outputs")
        utility_at = self.schema.position("EngineCoreOutputs", "utility_output")
        value = list(value)
        value[outputs_at] = kept
        if len(value) > utility_at:
            value[utility_at] = utility
        referenced = _aux_frames(value)
        parts = [_encode(value), *(part if index in referenced else b"" for index, part in
                                   enumerate(frame.parts[1:], start=1))]
        return msgspec.structs.replace(frame, parts=parts)


def _aux_frames(value: Any) -> set[int]:
    """The aux frames a value's tensors refer to ([dtype, shape, index])."""
    if isinstance(value, list):
        if len(value) == 3 and isinstance(value[0], str) and isinstance(value[1], list) and type(value[2]) is int:
            return {value[2]}
        return set().union(*map(_aux_frames, value)) if value else set()
    if isinstance(value, dict):
        return set().union(*map(_aux_frames, value.values())) if value else set()
    return set()
