"""What one session's frontend sent, held to every engine release's reader (``replay-proxy readers``).

A frontend that is no vLLM release (smg, a gateway built on vLLM's Rust
crates) writes as some release's layout without being that release, and an
engine reads it without complaint while filling in what it left out. For
each shipped release, its engine's reader takes the session's requests as
the matrix predicts a cell (``predict.read_direction``: what it rejects,
ignores or does not do), and this adds what a reader fills in: each field
of an array-encoded struct the frontend did not send (the elements past the
last one it sent), and each key of a map it did not send where the struct
does not omit defaults. Across releases: the layouts it matches exactly
(every field read, none filled), what no release reads (flagged by every
reader), and each float that crossed as a float32's nearest double (smg
sends ``top_p`` 0.9 as 0.8999999761581421): what the user asked for is not
what the engine uses.
"""

from __future__ import annotations

import contextlib
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from replay_proxy.compare.findings import PYTHON_ENGINE
from replay_proxy.compare.readers import reader_schema
from replay_proxy.matrix import Evidence, Verdict, worst
from replay_proxy.matrix.predict import read_direction
from replay_proxy.store.queries import find_session, open_recording, sent_frames
from replay_proxy.wire.messages import Channel, Direction, RequestType
from replay_proxy.wire.registry import load_schema, schema_for, shipped_releases
from replay_proxy.wire.schema import Namer, Schema, StructSchema
from replay_proxy.wire.values import decode_msgpack


class Filled(msgspec.Struct, frozen=True):
    """A field the frontend never sent in some of its messages, which the reader fills with its default."""

    struct: str
    field: str
    position: int | None  # (None: a map's key)
    default: Any
    messages: int


class EngineReading(msgspec.Struct):
    """One engine release's reader of the session's requests."""

    engine: str
    verdict: Verdict
    evidence: list[Evidence]  # (works: every message its own layout, or flags it ignores)
    filled: list[Filled]


class Rounded(msgspec.Struct, frozen=True):
    """A float sent as a float32's nearest double: the frontend rounded what the user asked for."""

    struct: str
    field: str
    sent: float  # one value as it crossed, 0.8999999761581421
    meant: str  # the shortest decimal that rounds to it as a float32, "0.9"
    messages: int


class SentReading(msgspec.Struct):
    session: str
    frontend: str | None  # record --frontend: NAME==VERSION, or NAME
    engine: str | None  # the release its engines announced
    requests: int
    exact_layouts: list[str]  # the releases whose reader reads every field of it and fills none
    unread_by_any: list[str]  # STRUCT.FIELD (or position): what every shipped release's reader flags
    rounded: list[Rounded]
    readings: list[EngineReading]
    judged: list[str]  # the engine releases the verdict is of (readers --engines)
    verdict: Verdict


def read_sent(db: Path, session: str, engines: list[str] | None = None) -> SentReading:
    """Session ``session``'s requests held to every shipped release's engine; the verdict over ``engines``
    (default: the release its own engines announced)."""
    with contextlib.closing(open_recording(db)) as recording:
        row = find_session(recording, session)
    sent = [(channel, parts) for channel, parts in sent_frames(db, str(row["id"]), Direction.TO_ENGINE)
            if channel is Channel.INPUT]
    adds = [(parts[1:], request) for _, parts in sent if parts[:1] == [RequestType.ADD.value] and len(parts) > 1
            and (request := _decoded(parts[1])) is not None]  # (one that does not decode is read_direction's)
    engine = schema_for(row["vllm_version"])[0].release  # (the nearest shipped release to an unknown one)
    writer = load_schema(row["frontend_release"]) if row["frontend_release"] else schema_for(engine)[0]
    readings = [_reading(release, sent, adds, writer) for release in shipped_releases()]
    judged = engines or [engine]
    flagged = [{(e.struct, e.field, e.position) for e in r.evidence if e.rule in UNREAD_RULES} for r in readings]
    unread = set.intersection(*flagged) if flagged else set()
    frontend = row["frontend_name"] and row["frontend_name"] + (f"=={row['frontend_version']}"
                                                                 if row["frontend_version"] else "")
    return SentReading(
        session=row["name"], frontend=frontend, engine=row["vllm_version"], requests=len(adds),
        exact_layouts=[r.engine for r in readings if not r.filled and not any(e.rule for e in r.evidence)],
        unread_by_any=sorted(f"{s}.{f}" if f else f"{s} position {p}" for s, f, p in unread),
        rounded=_rounded(adds, writer), readings=readings, judged=judged,
        verdict=worst(r.verdict for r in readings if r.engine in judged))


UNREAD_RULES = ("unknown_map_key", "extra_trailing_elements")


Add = tuple[list[bytes], Any]  # an ADD's body and aux frames, and its body decoded


def _decoded(body: bytes) -> Any:
    try:
        return decode_msgpack(body)
    except msgspec.DecodeError:
        return None


def _reading(release: str, sent: list[tuple[Channel, list[bytes]]], adds: list[Add], writer: Schema
             ) -> EngineReading:
    reader = reader_schema(PYTHON_ENGINE, release)
    evidence = read_direction(Direction.TO_ENGINE, sent, writer, reader, PYTHON_ENGINE)
    filled: Counter = Counter()
    for payload, request in adds:
        namer = _Filling(reader, payload)
        namer.struct("EngineCoreRequest", request)
        filled.update(set(namer.filled))
    return EngineReading(release, worst(e.verdict for e in evidence), evidence,
                         [Filled(*key, messages=count) for key, count in sorted(filled.items(), key=str)])


class _Filling(Namer):
    """A Namer that also notes each field the reader fills in (``Filled``'s key)."""

    def __init__(self, schema: Schema, frames: list[bytes]):
        super().__init__(schema, frames)
        self.filled: list[tuple[str, str, int | None, Any]] = []

    def _array(self, name: str, spec: StructSchema, value: list[Any], path: str) -> dict[str, Any]:
        self.filled += [(name, f.name, f.position, f.default) for f in spec.fields
                        if f.position >= len(value) and not f.required]
        return super()._array(name, spec, value, path)

    def _map(self, name: str, spec: StructSchema, value: dict[Any, Any], path: str) -> dict[Any, Any]:
        if not spec.omit_defaults:  # (one that omits them leaves a default out by design)
            self.filled += [(name, f.name, None, f.default) for f in spec.fields
                            if f.name not in value and not f.required]
        return super()._map(name, spec, value, path)


def _rounded(adds: list[Add], writer: Schema) -> list[Rounded]:
    """Each float field of the requests' sampling parameters sent as a float32's nearest double."""
    seen: dict[str, float] = {}
    counts: Counter = Counter()
    for _, request in adds:
        params = writer.read(request, "EngineCoreRequest", "sampling_params") if isinstance(request, list) else None
        for key, value in (params.items() if isinstance(params, dict) else ()):
            if isinstance(value, float) and f32_decimal(value) is not None:
                seen.setdefault(key, value)
                counts[key] += 1
    return [Rounded("SamplingParams", key, seen[key], str(f32_decimal(seen[key])), counts[key]) for key in sorted(seen)]


def f32_decimal(value: float) -> str | None:
    """The shortest decimal whose float32 is ``value``, where ``value`` is a float32 that no shorter double
    names (0.8999999761581421 -> "0.9"); None for a double as a user would write it (0.9, 1.0, 0.25)."""
    if struct.unpack("<f", struct.pack("<f", value))[0] != value:
        return None
    for digits in range(1, 10):
        decimal = f"{value:.{digits}g}"
        if struct.unpack("<f", struct.pack("<f", float(decimal)))[0] == value:
            return decimal if float(decimal) != value else None
    return None
