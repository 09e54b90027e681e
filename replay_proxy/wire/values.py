"""Generic msgpack values: decoding, ext types, tensors, JSON-safe form.

vLLM's serializer (``vllm/v1/serial_utils.py``) uses three ext codes: 1 and 2
carry pickle / cloudpickle payloads and 3 carries raw array bytes. All three
decode to an opaque ``Ext``: pickles are never unpickled, raw arrays are only
read as numbers once a schema says the field is a tensor. A tensor travels
as ``[dtype, shape, data]`` where ``data`` is either ``Ext(3, bytes)`` or an
int index into the message's frame list (0 is the body, 1 the first aux
frame).
"""

from __future__ import annotations

import functools
import math
import struct
from typing import Any

import msgspec

RAW_VIEW = 3  # vLLM's CUSTOM_TYPE_RAW_VIEW; 1 and 2 are pickle and cloudpickle
INLINE_VALUES_LIMIT = 4096  # larger tensors keep only dtype/shape in the decoded form

# numpy dtype.str ("<i4": byte order, kind, size) and torch dtype names -> struct format characters. numpy's
# "=" is the writer's own order (vllm-rs 0.34.0 sends "=u4"): every platform vLLM ships for is little-endian.
_NUMPY_FORMATS = {"i8": "q", "i4": "i", "i2": "h", "i1": "b", "u8": "Q", "u4": "I", "u2": "H", "u1": "B",
                  "f8": "d", "f4": "f", "f2": "e", "b1": "?"}
_TORCH_FORMATS = {"int64": "q", "int32": "i", "int16": "h", "int8": "b", "uint64": "Q", "uint32": "I",
                  "uint16": "H", "uint8": "B", "float64": "d", "float32": "f", "float16": "e", "bool": "?"}
_INTEGER_FORMATS = frozenset("qihbQIHB")
_SIZES = {fmt: struct.calcsize(fmt) for fmt in _NUMPY_FORMATS.values()}


@functools.cache
def _format(dtype: str) -> tuple[str, bool] | None:
    """A dtype's struct format character and whether its bytes are big-endian; None for one not read."""
    if dtype in _TORCH_FORMATS:
        return _TORCH_FORMATS[dtype], False
    fmt = _NUMPY_FORMATS.get(dtype[1:]) if len(dtype) == 3 and dtype[0] in "<>=|" else None
    return (fmt, dtype[0] == ">") if fmt else None


Ext = msgspec.msgpack.Ext  # code and data: kept as bytes, pickles are never unpickled


class Tensor(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """A tensor or ndarray as vLLM sends it, resolved against its frames."""

    dtype: str
    shape: list[int]
    nbytes: int
    aux_frame: int | None = None  # index into the frame list, when not inline
    values: list[Any] | None = None  # flat, row-major; None when too large or unknown dtype
    error: str | None = None


def _ext_hook(code: int, data: memoryview) -> Ext:
    return Ext(code, bytes(data))  # copied: the buffer is only valid during decoding


_decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def decode_msgpack(data: bytes) -> Any:
    """Decode one msgpack document into plain Python values and ``Ext``."""
    return _decoder.decode(data)


_KINDS = {type(None): "nil", bool: "bool", int: "int", float: "float", str: "str",
          bytes: "bin", list: "array", dict: "map", Ext: "ext"}


def kind_of(value: Any) -> str:
    """The msgpack kind of a decoded value."""
    return _KINDS.get(type(value), type(value).__name__)


def resolve_tensor(value: Any, frames: list[bytes], limit: int | None = INLINE_VALUES_LIMIT) -> Tensor | None:
    """Read ``[dtype, shape, data]``; None if the value is not of that shape. Values are read up to ``limit``
    of them (None: all)."""
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str)
            and isinstance(value[1], list)):
        return None
    dtype, shape, data = value
    aux = None
    if isinstance(data, Ext) and data.code == RAW_VIEW:
        raw = bytes(data.data)  # (bytes already, as _ext_hook made it: the same object, not a copy)
    elif isinstance(data, int) and not isinstance(data, bool):
        aux = data
        if not 0 < data < len(frames):
            return Tensor(dtype, shape, 0, aux_frame=aux,
                          error=f"aux frame {data} not in message of {len(frames)} frames")
        raw = frames[data]
    else:
        return None
    values: list[Any] | None = None
    error = None
    count = 1
    for n in shape:
        count *= n if isinstance(n, int) else 0
    readable = limit is None or count <= limit
    if dtype == "bfloat16":
        if len(raw) == 2 * count and readable:
            # bfloat16 is the top half of a float32: widen by padding zeros.
            widened = b"".join(b"\x00\x00" + raw[i:i + 2] for i in range(0, len(raw), 2))
            values = memoryview(widened).cast("f").tolist()
    elif (fmt := _format(dtype)) is None:
        error = f"unknown dtype {dtype!r}"
    elif readable:
        values, error = _values(raw, *fmt)
        if values is not None and len(values) != count:
            error = f"shape {shape} wants {count} values, data holds {len(values)}"
            values = None
    if values and isinstance(values[0], float):
        # JSON has no -inf, and logprobs of impossible tokens are -inf.
        values = [v if math.isfinite(v) else str(v) for v in values]
    return Tensor(dtype, shape, len(raw), aux_frame=aux, values=values, error=error)


def _values(raw: bytes, fmt: str, big_endian: bool) -> tuple[list[Any] | None, str | None]:
    size = _SIZES[fmt]
    if len(raw) % size:
        return None, f"{len(raw)} bytes are not a whole number of {size}-byte values"
    if big_endian:
        return list(struct.unpack(f">{len(raw) // size}{fmt}", raw)), None
    return memoryview(raw).cast("B").cast(fmt).tolist(), None  # type: ignore[call-overload]  # (a run-time format)


def token_ids(value: Any) -> list[int] | None:
    """Token ids as a release sends them: a msgpack array of ints (to 0.33.0), or a one-dimensional integer
    ndarray, read (0.34.0's prompt); None for anything else."""
    if type(value) is list:
        return value if all(type(v) is int for v in value) else None
    if type(value) is Tensor and value.values is not None and len(value.shape) == 1:
        fmt = _format(value.dtype)
        return value.values if fmt is not None and fmt[0] in _INTEGER_FORMATS else None
    return None


def _json_hook(value: Any) -> Any:
    if isinstance(value, Ext):
        return {"$ext": value.code, "nbytes": len(bytes(value.data))}
    raise TypeError(f"{type(value).__name__} has no JSON form")


_json = msgspec.json.Encoder(enc_hook=_json_hook)


def to_json(value: Any) -> str | None:
    """The JSON form of decoded values, for the database and reports.

    bytes become base64 strings, opaque ext values ``{"$ext": code, "nbytes": n}``,
    NaN and infinities null (tensor values keep them as strings, see
    ``resolve_tensor``).
    """
    if value is None:
        return None
    try:
        return _json.encode(value).decode()
    except (TypeError, msgspec.EncodeError):  # a map key JSON cannot hold (bytes, nil)
        return _json.encode(_string_keys(value)).decode()


def _string_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k if isinstance(k, (str, int)) else repr(k): _string_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_string_keys(v) for v in value]
    return value
