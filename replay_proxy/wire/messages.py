"""Classify multipart frames into typed engine-core messages.

``WireDecoder.decode(channel, direction, frames)`` is the whole sans-IO
surface: bytes in, a ``Message`` out. It never raises on input from the wire;
anything it cannot read becomes ``Kind.UNKNOWN`` with the error text, and
what it reads but the schema does not describe becomes flags on the message.
Frames are given without ZMQ routing identities (the socket layer strips
those and reports the engine separately).

The decoder is stateful in two respects, one for each side that writes.
The registration names the engines' ``vllm_version``, and from then on what
the engines write is named with that release's schema. What the frontend
writes is named with the frontend's release, which no handshake names: given
(``record --frontend-release``), or found from its first ADD, read without
flags by the engines' own release if it can be, else by the newest shipped
release that can. A frontend of another release than its engines (a rolling
upgrade) is so read as it was written; one that no known release reads is
named with the engines' schema, flagged, and said so (``frontend_source``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import msgspec

from replay_proxy.wire.schema import Flag, Namer, Schema
from replay_proxy.wire.registry import load_schema, schema_for, shipped_releases
from replay_proxy.wire.values import decode_msgpack, kind_of

ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
COORDINATOR_READY = b"READY"
SUBSCRIBE_ALL = b"\x01"
UNSUBSCRIBE_ALL = b"\x00"  # what an XPUB receives when a subscriber disconnects


class Channel(enum.StrEnum):
    HANDSHAKE = "handshake"
    INPUT = "input"
    OUTPUT = "output"
    COORDINATOR_INPUT = "coordinator_input"  # coordinator XPUB -> engine XSUB
    COORDINATOR_OUTPUT = "coordinator_output"  # engine PUSH -> coordinator PULL


class Side(enum.StrEnum):
    """One side of the link. A replay names the side under test; the proxy plays the other."""

    ENGINE = "engine"
    FRONTEND = "frontend"

    @property
    def other(self) -> Side:
        return Side.FRONTEND if self is Side.ENGINE else Side.ENGINE

    @property
    def reads(self) -> Direction:
        """The direction of the messages this side reads."""
        return Direction.TO_ENGINE if self is Side.ENGINE else Direction.TO_FRONTEND


class Direction(enum.StrEnum):
    """Where a message goes: its reader is that side."""

    TO_ENGINE = "to_engine"
    TO_FRONTEND = "to_frontend"  # the coordinator counts as the frontend side

    @property
    def reader(self) -> Side:
        return Side.ENGINE if self is Direction.TO_ENGINE else Side.FRONTEND


class Kind(enum.StrEnum):
    HELLO = "HELLO"
    INIT = "INIT"
    READY = "READY"
    REGISTRATION = "REGISTRATION"
    ADD = "ADD"
    ABORT = "ABORT"
    UTILITY = "UTILITY"
    START_DP_WAVE = "START_DP_WAVE"
    OUTPUTS = "OUTPUTS"
    UTILITY_OUTPUT = "UTILITY_OUTPUT"
    ENGINE_CORE_DEAD = "ENGINE_CORE_DEAD"
    COORDINATOR_READY = "COORDINATOR_READY"
    SUBSCRIBE = "SUBSCRIBE"
    UNSUBSCRIBE = "UNSUBSCRIBE"
    UNKNOWN = "UNKNOWN"


HANDSHAKE_KINDS = frozenset({Kind.HELLO, Kind.INIT, Kind.READY, Kind.REGISTRATION})
INPUT_KINDS = frozenset({Kind.ADD, Kind.ABORT, Kind.UTILITY})  # frontend -> engine
OUTPUT_KINDS = frozenset({Kind.OUTPUTS, Kind.UTILITY_OUTPUT, Kind.ENGINE_CORE_DEAD})  # engine -> frontend


class RequestType(bytes, enum.Enum):
    """The first frame of an input message (vLLM ``EngineCoreRequestType``)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"


def request_type(channel: Channel, direction: Direction, parts: list[bytes]) -> RequestType | None:
    """What an input message to an engine asks (ADD, ABORT, UTILITY, START_DP_WAVE), from its first frame
    alone; None for any other frame."""
    if channel is not Channel.INPUT or direction is not Direction.TO_ENGINE or not parts:
        return None
    try:
        return RequestType(bytes(parts[0]))
    except ValueError:
        return None


class Message(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One decoded multipart message."""

    kind: Kind
    fields: Any = None  # named values: field names from the schema, flags for the rest
    error: str | None = None
    flags: tuple[Flag, ...] = ()


UTILITY_CALL_FIELDS = ("client_index", "call_id", "method", "args")
# Utility methods whose arguments vLLM's engine converts to msgspec structs (EngineCore._convert_msgspec_args,
# by the method's annotations): named here as those structs, so that they drift as structs do.
UTILITY_ARGUMENTS: dict[str, tuple[str, ...]] = {"add_lora": ("LoRARequest",)}
START_DP_WAVE_FIELDS = ("wave", "exclude_engine_index")


class FrontendSource(enum.StrEnum):
    """How the frontend's release was found (``sessions.frontend_source``)."""

    GIVEN = "given"  # record --frontend-release
    ENGINES = "engines"  # its first ADD reads without flags as the engines' release
    NEWEST = "newest"  # ... as the newest shipped release that reads it so
    UNREAD = "unread"  # no shipped release reads it without flags: named with the engines' schema


class WireDecoder:
    """Decodes the frames of one session, choosing each side's schema as it learns it."""

    def __init__(self, schema: Schema | None = None, *, fixed: bool = False, frontend_release: str | None = None,
                 frontend_source: str | None = None):
        """With ``fixed``, ``schema`` names everything, whatever release a registration announces or the
        frontend writes: a reader of that release reading another's messages. ``frontend_release``: what
        writes to the engines, given (or found before, by ``frontend_source``)."""
        self.schema, self.schema_exact = (schema, True) if schema else schema_for(None)
        self.vllm_version: str | None = None
        self.fixed = fixed
        self.frontend_schema = load_schema(frontend_release) if frontend_release else None
        self.frontend_source = FrontendSource(frontend_source or FrontendSource.GIVEN) if frontend_release \
            else FrontendSource.UNREAD if frontend_source == FrontendSource.UNREAD else None
        # The flags the engines' schema gave the first ADD of a frontend of another release: what its engines
        # cannot read as sent (the caller takes them once, as drift; the ADD itself is named without them).
        self.reader_flags: tuple[Flag, ...] | None = None

    @property
    def frontend_release(self) -> str | None:
        return self.frontend_schema.release if self.frontend_schema is not None else None

    def request_schema(self, frames: Sequence[bytes]) -> Schema:
        """The schema to name an input message (``frames``: its request type first) with: the frontend's,
        found from the first ADD if not yet known (the module's docstring)."""
        if self.frontend_source is None and not self.fixed and frames[:1] == [RequestType.ADD.value] \
                and len(frames) > 1:
            payload = list(frames[1:])
            self.reader_flags = _flags(self.schema, payload)
            if self.reader_flags == ():
                self.frontend_schema, self.frontend_source = self.schema, FrontendSource.ENGINES
            else:
                newest = (load_schema(r) for r in reversed(shipped_releases()))
                self.frontend_schema = next((s for s in newest if _flags(s, payload) == ()), None)
                self.frontend_source = FrontendSource.NEWEST if self.frontend_schema else FrontendSource.UNREAD
                if self.frontend_schema is None:
                    self.reader_flags = ()  # (the message's own flags say it)
        return self.frontend_schema or self.schema

    def decode(self, channel: Channel, direction: Direction, frames: Sequence[bytes]) -> Message:
        frames = list(frames)
        try:
            message = self._decode(channel, direction, frames)
        except Exception as exc:  # noqa: BLE001 - nothing from the wire may raise out of here
            return Message(kind=Kind.UNKNOWN, error=f"{type(exc).__name__}: {exc}")
        return message

    def learn_version(self, version: Any) -> None:
        """Name what follows with ``version``'s schema (a registration says it; so may a recording)."""
        if isinstance(version, str) and version != self.vllm_version and not self.fixed:
            self.vllm_version = version
            self.schema, self.schema_exact = schema_for(version)

    def _decode(self, channel: Channel, direction: Direction, frames: list[bytes]) -> Message:
        if not frames:
            return Message(kind=Kind.UNKNOWN, error="empty message")
        first = frames[0]
        if channel is Channel.HANDSHAKE:
            return self._handshake(direction, frames)
        if channel is Channel.INPUT and direction is Direction.TO_ENGINE:
            return self._request(frames)
        if channel is Channel.INPUT:
            if len(frames) != 1:
                return _unknown(f"registration is one frame, got {len(frames)}")
            if first == b"":  # the pre-2026-04 registration form
                return Message(kind=Kind.REGISTRATION, fields={})
            value = decode_msgpack(first)
            if isinstance(value, dict):  # the release it announces names it, and all that follows
                self.learn_version(value.get("vllm_version"))
            return self._named(Kind.REGISTRATION, "EngineCoreReadyResponse", frames, value)
        if channel in (Channel.OUTPUT, Channel.COORDINATOR_OUTPUT):
            # The sentinel is not msgpack: 'E' would decode as fixint 69.
            if first == ENGINE_CORE_DEAD and len(frames) == 1:
                return Message(kind=Kind.ENGINE_CORE_DEAD)
            return self._outputs(frames)
        if direction is Direction.TO_FRONTEND:  # XSUB -> XPUB: b"\x01" + topic, or b"\x00" + topic on leaving
            if len(frames) == 1 and first[:1] in (SUBSCRIBE_ALL, UNSUBSCRIBE_ALL):
                return Message(kind=Kind.SUBSCRIBE if first[:1] == SUBSCRIBE_ALL else Kind.UNSUBSCRIBE,
                               fields={"topic": first[1:]} if len(first) > 1 else None)
            return _unknown("expected a subscription frame (b'\\x01' or b'\\x00' and a topic)")
        if frames == [COORDINATOR_READY]:
            return Message(kind=Kind.COORDINATOR_READY)
        return self._request(frames)

    def _handshake(self, direction: Direction, frames: list[bytes]) -> Message:
        if len(frames) != 1:
            return _unknown(f"handshake messages are one frame, got {len(frames)}")
        value = decode_msgpack(frames[0])
        if not isinstance(value, dict):
            return _unknown(f"handshake payload is a {kind_of(value)}, expected a map")
        if direction is Direction.TO_ENGINE:
            return self._named(Kind.INIT, "EngineHandshakeMetadata", frames, value)
        status = value.get("status")
        if status in ("HELLO", "READY"):
            return Message(kind=Kind(status), fields=value)
        return Message(kind=Kind.UNKNOWN, fields=value, error=f"unknown handshake status {status!r}")

    def _request(self, frames: list[bytes]) -> Message:
        try:
            request_type = RequestType(frames[0])
        except ValueError:
            return _unknown(f"unknown request type {frames[0][:8]!r}")
        if len(frames) < 2:
            return _unknown(f"{request_type.name} without a body")
        payload = frames[1:]  # tensor references count from the body (index 0)
        schema = self.request_schema(frames)
        if request_type is RequestType.ADD:
            return self._named(Kind.ADD, "EngineCoreRequest", payload, schema=schema)
        value = decode_msgpack(payload[0])
        if request_type is RequestType.ABORT:
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return Message(kind=Kind.ABORT, fields={"request_ids": value})
            return _unknown("ABORT body is not a list of request ids", value)
        names = UTILITY_CALL_FIELDS if request_type is RequestType.UTILITY else START_DP_WAVE_FIELDS
        kind = Kind.UTILITY if request_type is RequestType.UTILITY else Kind.START_DP_WAVE
        if not isinstance(value, list) or len(value) != len(names):
            return _unknown(f"{kind} body is not an array of {len(names)}", value)
        fields = dict(zip(names, value))
        structs = UTILITY_ARGUMENTS.get(str(fields.get("method"))) if kind is Kind.UTILITY else None
        if not structs or not isinstance(fields["args"], list):
            return Message(kind=kind, fields=fields)
        namer = Namer(schema, payload)
        fields["args"] = [namer.struct(structs[i], arg) if i < len(structs) and structs[i] in schema.structs
                          else arg for i, arg in enumerate(fields["args"])]
        return Message(kind=kind, fields=fields, flags=tuple(namer.flags))

    def _outputs(self, frames: list[bytes]) -> Message:
        message = self._named(Kind.OUTPUTS, "EngineCoreOutputs", frames)
        fields = message.fields
        if isinstance(fields, dict) and fields.get("utility_output") is not None and not fields.get("outputs"):
            return msgspec.structs.replace(message, kind=Kind.UTILITY_OUTPUT)
        return message

    def _named(self, kind: Kind, struct: str, frames: list[bytes], value: Any = None, *,
               schema: Schema | None = None) -> Message:
        schema = schema or self.schema
        if value is None:
            value = decode_msgpack(frames[0])
        namer = Namer(schema, frames)
        fields = namer.struct(struct, value)
        if not isinstance(fields, dict):
            return Message(kind=Kind.UNKNOWN, fields=fields, flags=tuple(namer.flags),
                           error=f"{struct} is not a {schema.structs[struct].encoding}")
        return Message(kind=kind, fields=fields, flags=tuple(namer.flags))


def _flags(schema: Schema, payload: list[bytes]) -> tuple[Flag, ...] | None:
    """The flags ``schema`` gives an ADD's body (and its aux frames); None where it does not name it at all."""
    try:
        namer = Namer(schema, payload)
        named = namer.struct("EngineCoreRequest", decode_msgpack(payload[0]))
    except Exception:  # noqa: BLE001 - whatever does not decode is not named
        return None
    return tuple(namer.flags) if isinstance(named, dict) else None


def _unknown(error: str, value: Any = None) -> Message:
    return Message(kind=Kind.UNKNOWN, fields=value, error=error)
