"""Encode named values the way vLLM's msgspec classes do, from a schema.

The sim peers speak the protocol with this. Replay never re-encodes a
recorded frame (it resends raw bytes); this is for making new frames.
Rules copied from msgspec as vLLM configures it: array_like structs always go
out at full length (``omit_defaults`` has no effect on them); map structs
with ``omit_defaults`` leave out keys equal to their default; other maps
carry every field.
"""

from __future__ import annotations

import array
from typing import Any

import msgspec

from replay_proxy.wire.schema import Field, Schema
from replay_proxy.wire.values import RAW_VIEW

ZERO_COPY_THRESHOLD = 256  # VLLM_MSGPACK_ZERO_COPY_THRESHOLD: smaller tensors travel inline

_encoder = msgspec.msgpack.Encoder()


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


def struct_value(schema: Schema, name: str, named: dict[str, Any]) -> Any:
    """The msgpack-ready value of struct ``name`` built from named fields.

    Keys the schema does not know are kept (maps) or appended (arrays, in
    the order given): that is how a peer with drift is simulated.
    """
    spec = schema.structs[name]
    known = spec.by_name
    unknown = {k: v for k, v in named.items() if k not in known}
    if spec.encoding == "array":
        values = []
        for field in spec.fields:
            if field.name not in named and field.required:
                raise ValueError(f"{name}.{field.name} (position {field.position}) is required")
            values.append(_field_value(schema, field, named.get(field.name, field.default)))
        return values + list(unknown.values())
    out = {}
    for field in spec.fields:
        if field.name in named:
            value = named[field.name]
        elif field.required:
            raise ValueError(f"{name}.{field.name} is required")
        elif spec.omit_defaults:
            continue
        else:
            value = field.default
        if spec.omit_defaults and value == field.default:
            continue
        out[field.name] = _field_value(schema, field, value)
    out.update(unknown)
    return out


def _field_value(schema: Schema, field: Field, value: Any) -> Any:
    if field.struct is None or value is None:
        return value
    container = field.type.split("[", 1)[0]
    if container in ("list", "set", "frozenset", "tuple") and isinstance(value, list):
        return [_nested(schema, field.struct, v) for v in value]
    return _nested(schema, field.struct, value)


def _nested(schema: Schema, name: str, value: Any) -> Any:
    return struct_value(schema, name, value) if isinstance(value, dict) else value


def token_ids(field: Field, tokens: list[int], aux_frames: list[bytes], dtype: str = "<i4") -> Any:
    """Token ids as ``field``'s release sends them: a msgpack array, or where the field is an ndarray (0.34.0's
    prompt) a 32-bit one (the Python frontend's ``<i4``; vllm-rs sends ``=u4``)."""
    if not field.tensor:
        return tokens
    typecode = "I" if dtype[1] == "u" else "i"  # (4 bytes each, in this machine's order: "<" and "=" alike)
    return tensor(dtype, [len(tokens)], array.array(typecode, tokens).tobytes(), aux_frames)


def tensor(dtype: str, shape: list[int], data: bytes, aux_frames: list[bytes]) -> list[Any]:
    """A tensor as vLLM sends it: inline below the zero-copy threshold, else in an aux frame.

    ``aux_frames`` is the message's frame list after the body; a tensor that
    goes there is referenced by its index counting the body as 0.
    """
    if len(data) < ZERO_COPY_THRESHOLD:
        return [dtype, shape, msgspec.msgpack.Ext(RAW_VIEW, data)]
    aux_frames.append(data)
    return [dtype, shape, len(aux_frames)]
