"""The fast path for the bulk of the traffic: outputs and requests that conform to their release's schema.

A busy engine sends one EngineCoreOutputs per step with an output per
running request, and its frontend an EngineCoreRequest (an ADD) per
request: nearly every frame and row a recording holds. Naming those
generically (``schema.Namer``: a Python call per field) is most of a
writer's CPU. Here the same schema generates msgspec Structs, so msgspec
decodes and checks a conforming frame in C:

* every position the release defines must be there, and no more;
* a field that holds no struct must have one of its schema kinds (msgspec's
  own check);
* a field that holds one (sampling parameters, scheduler stats...) is read
  raw and checked in C against a Struct that accepts exactly what the Namer
  would give back as decoded; where no msgspec type says that (a positional
  nested struct, a tensor that is not nil), the Namer names that field alone;
* an output's nested or opaque fields (logprobs, events, tensors, transfer
  params...) must be nil, and a frame must have no aux frames.

ABORT and UTILITY bodies are flat arrays, read by one typed decoder each.
Whatever does not conform (a drifted peer, logprobs, a utility answer, an
``add_lora`` call, whose argument is a struct) makes ``read`` return None,
and the caller names it generically: the result is the same either way, this
way is only faster (``tests/wire/test_typed.py`` holds the two against each
other).
"""

from __future__ import annotations

import operator
from types import GenericAlias
from typing import Any, TypeVar

import msgspec

from replay_proxy.wire.messages import UTILITY_ARGUMENTS, UTILITY_CALL_FIELDS, Kind, Message, RequestType
from replay_proxy.wire.schema import Flag, Namer, Schema
from replay_proxy.wire.values import decode_msgpack, resolve_tensor

_SCALARS = {"nil": type(None), "bool": bool, "int": int, "str": str, "float": float}


class Outputs(msgspec.Struct, frozen=True, gc=False):
    """A conforming EngineCoreOutputs, read: its own fields named, its outputs as column values."""

    fields: dict[str, Any]  # every field but outputs, named as the Namer names them
    # Per output: request_id, new_token_ids, finish_reason, stop_reason, num_nans_in_logits.
    outputs: list[tuple[Any, ...]]
    flags: tuple[Flag, ...]  # from the frame's nested fields (its outputs conform, or it would not be here)


def _scalar_type(kinds: tuple[str, ...]) -> Any:
    """The msgspec type of a field of scalar kinds only, or None."""
    return _kinds_type(kinds) if set(kinds) <= _SCALARS.keys() else None


class _Positional:
    """One array-encoded struct of a release, read by msgspec: a field that holds no struct typed by its
    kinds (the Namer gives those back as decoded), every other field raw, then checked in C or, where no
    msgspec type can check it, named by the Namer (the module's docstring)."""

    def __init__(self, schema: Schema, name: str, given: dict[str, Any]):
        """``given``: the msgspec type of some fields, by name, instead of the one made here."""
        self.schema, self.name = schema, name
        fields = schema.structs[name].fields
        self.names = [field.name for field in fields]
        self._raw: list[tuple[Any, Any]] = []  # (Field, a decoder that checks its raw value conforms, or None)
        self._arrays = [field for field in fields if field.whole]  # token arrays: read as _TokenArray, then resolved
        kinds: list[Any] = []
        made: dict[str, Any] = {}
        for field in fields:
            kind = given[field.name] if field.name in given else _TokenArray | None if field.whole else \
                _plain_type(field) if field.struct is None and not field.resolved else None
            if kind is None and field.name not in given:
                kind = msgspec.Raw
                check = _field_type(schema, field, made)
                self._raw.append((field, None if check is None else msgspec.msgpack.Decoder(check).decode))
            kinds.append(kind)
        self.decode = msgspec.msgpack.Decoder(_positional(f"Typed{name}", kinds)).decode

    def named(self, value: tuple[Any, ...], frames: list[bytes]) -> tuple[dict[str, Any], list[Flag]]:
        """The fields of a decoded value by name, each as the Namer names it; the flags of those it named."""
        fields = dict(zip(self.names, value))
        namer = Namer(self.schema, frames)
        for field in self._arrays:
            array = fields[field.name]
            if array is not None:
                tensor = [array.dtype, array.shape, array.data]
                fields[field.name] = resolve_tensor(tensor, frames, None) or \
                    namer.field(self.name, field, tensor, f"$[{field.position}]")  # (not one: flagged)
        for field, check in self._raw:
            raw = fields[field.name]
            if check is not None:
                try:
                    check(raw)  # it conforms: the Namer would give back the value as decoded
                    fields[field.name] = decode_msgpack(raw)
                    continue
                except msgspec.DecodeError:
                    pass
            fields[field.name] = namer.field(self.name, field, decode_msgpack(raw), f"$[{field.position}]")
        return fields, namer.flags


class _TokenArray(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """0.34.0's prompt as it travels: a numpy array's dtype, shape and bytes (inline) or aux frame index."""

    dtype: str
    shape: list[int]
    data: msgspec.msgpack.Ext | int


# The EngineCoreOutput fields an output's packed value in frame_outputs holds (store/tables.py), in the order ``read``
# gives them.
OUTPUT_COLUMNS = ("request_id", "new_token_ids", "finish_reason", "stop_reason", "num_nans_in_logits")


class TypedOutputs:
    """Reads conforming EngineCoreOutputs frames of one release (see the module's docstring)."""

    def __init__(self, schema: Schema):
        output = schema.structs["EngineCoreOutput"]
        output_fields = []
        for field in output.fields:
            scalar = _scalar_type(field.kinds) if field.struct is None and not field.resolved else None
            if field.name == "new_token_ids" and field.kinds == ("array",):
                scalar = _plain_type(field)
            if field.name in OUTPUT_COLUMNS:
                if scalar is None:
                    raise ValueError(f"{schema.release}: EngineCoreOutput.{field.name} is {field.kinds}")
            elif "nil" in field.kinds:
                scalar = None  # must be nil: anything else is the generic path's
            elif scalar is None:
                raise ValueError(f"{schema.release}: EngineCoreOutput.{field.name} is never nil: {field.kinds}")
            output_fields.append((field.name, scalar))
        names = [name for name, _ in output_fields]
        if not set(OUTPUT_COLUMNS) <= set(names):
            raise ValueError(f"{schema.release}: EngineCoreOutput lacks some of {OUTPUT_COLUMNS}")
        self._columns = operator.attrgetter(*(f"f{names.index(c)}" for c in OUTPUT_COLUMNS))  # _positional's names
        output_struct = _positional("TypedOutput", [kind for _, kind in output_fields])
        # A utility answer is the generic path's: the frame must not hold one.
        self._frame = _Positional(schema, "EngineCoreOutputs", {"outputs": GenericAlias(list, output_struct),
                                                                 "utility_output": None})
        self._outputs_at = self._frame.names.index("outputs")

    def read(self, parts: list[bytes]) -> Outputs | None:
        """The frame read, or None if it does not conform (then name it generically)."""
        if len(parts) != 1:
            return None
        try:
            value = astuple(self._frame.decode(parts[0]))
        except msgspec.DecodeError:  # ValidationError included
            return None
        if value[-1] is not UNSET:
            return None
        columns = self._columns
        outputs = []
        for output in value[self._outputs_at]:
            if output.extra is not UNSET:
                return None
            outputs.append(columns(output))
        fields, flags = self._frame.named(value, parts)
        del fields["outputs"]
        return Outputs(fields, outputs, tuple(flags))


class _UtilityCall(msgspec.Struct, array_like=True, gc=False):
    client_index: int
    call_id: int
    method: str
    args: list[Any]


class TypedRequests:
    """Reads conforming ADD, ABORT and UTILITY messages of one release into the ``Message`` the generic
    decoder gives (see the module's docstring)."""

    def __init__(self, schema: Schema):
        self._add = _Positional(schema, "EngineCoreRequest", {})
        self._decode_abort = msgspec.msgpack.Decoder(list[str]).decode
        self._decode_utility = msgspec.msgpack.Decoder(_UtilityCall).decode

    def read(self, parts: list[bytes]) -> Message | None:
        """The message read, or None if it does not conform (then name it generically)."""
        if len(parts) < 2:  # the request type and its body, then any aux frames (0.34.0's long prompts)
            return None
        request_type, body = parts[0], parts[1]
        try:
            if request_type == RequestType.ADD.value:
                value = astuple(self._add.decode(body))
                if value[-1] is not UNSET:
                    return None
                fields, flags = self._add.named(value, parts[1:])  # tensor references count from the body
                return Message(kind=Kind.ADD, fields=fields, flags=tuple(flags))
            if request_type == RequestType.ABORT.value:
                return Message(kind=Kind.ABORT, fields={"request_ids": self._decode_abort(body)})
            if request_type == RequestType.UTILITY.value:
                call = self._decode_utility(body)
                if call.method in UTILITY_ARGUMENTS:
                    return None
                return Message(kind=Kind.UTILITY, fields=dict(zip(UTILITY_CALL_FIELDS, astuple(call))))
        except msgspec.DecodeError:
            return None
        return None


astuple, UNSET = msgspec.structs.astuple, msgspec.UNSET
_OTHER_KINDS = {"bin": bytes, "ext": msgspec.msgpack.Ext, "map": dict, "array": list, "any": Any}


def _field_type(schema: Schema, field: Any, made: dict[str, Any]) -> Any:
    """A msgspec type that accepts exactly the values the Namer names without a flag and gives back as
    decoded, for one field; None where no msgspec type says that (then the Namer checks it)."""
    if field.resolved:  # only nil is named as decoded
        return type(None) if "nil" in field.kinds else None
    if field.struct is None:
        return _plain_type(field)
    nested = _struct_type(schema, field.struct, made)
    if nested is None:  # only nil is named as decoded
        return type(None) if "nil" in field.kinds else None
    container = field.type.split("[", 1)[0]
    if container in ("list", "set", "frozenset", "tuple") and field.kinds == ("array",):
        return GenericAlias(list, nested)  # (types made as the schema says, at run time)
    if container == "dict" and field.kinds == ("map",):
        return GenericAlias(dict, (str, nested))
    others = [_SCALARS.get(k) for k in field.kinds if k not in ("map", "array")]
    if None in others or {"map", "array"} <= set(field.kinds):
        return None
    return _union([nested, *others])


def _plain_type(field: Any) -> Any:
    """The msgspec type of a field that holds no struct: its kinds', and an array of ints checked as one (the
    Namer checks those items too)."""
    if field.int_items:
        return list[int] | None if "nil" in field.kinds else list[int]
    return _kinds_type(field.kinds)


def _kinds_type(kinds: tuple[str, ...]) -> Any:
    """A msgspec type that accepts exactly these msgpack kinds, or None where none does."""
    if "float" in kinds and "int" not in kinds:
        return None  # msgspec reads an int as a float: only where int is allowed too is that the same
    types = [_SCALARS.get(k) or _OTHER_KINDS.get(k) for k in kinds]
    if None in types:
        return None
    return Any if Any in types else _union(types)


def _struct_type(schema: Schema, name: str, made: dict[str, Any]) -> Any:
    """A validating Struct for a map-encoded struct (unknown keys refused, required ones required)."""
    if name in made:
        return made[name]
    spec = schema.structs.get(name)
    made[name] = None  # a struct that holds itself: left to the Namer
    if spec is None or spec.encoding != "map" or not all(f.name.isidentifier() for f in spec.fields):
        return None
    fields = []
    for field in sorted(spec.fields, key=lambda f: not f.required):  # required first, as msgspec wants
        kind = _field_type(schema, field, made)
        if kind is None:
            return None
        fields.append((field.name, kind) if field.required and not spec.omit_defaults else (field.name, kind, UNSET))
    made[name] = msgspec.defstruct(f"Checked{name}", fields, forbid_unknown_fields=True, gc=False)
    return made[name]


def _union(types: list[Any]) -> Any:
    union = types[0]
    for t in types[1:]:
        union = union | t
    return union


def _positional(name: str, kinds: list[Any]) -> type[msgspec.Struct]:
    """An array-like Struct of these field types, plus a trailing catch-all: msgspec ignores positions
    beyond a struct's fields, where the Namer flags them, so a frame with one more is not read here."""
    fields = [(f"f{i}", kind) for i, kind in enumerate(kinds)] + [("extra", Any, UNSET)]
    return msgspec.defstruct(name, fields, array_like=True, gc=False)


_made: dict[tuple[int, type], tuple[Schema, Any]] = {}  # by id: a Schema holds dicts, so it has no hash
Reader = TypeVar("Reader", "TypedOutputs", "TypedRequests")


def _typed(reader: type[Reader], schema: Schema) -> Reader | None:
    made = _made.get((id(schema), reader))
    if made is None or made[0] is not schema:
        typed: Reader | None
        try:
            typed = reader(schema)
        except ValueError:
            typed = None
        made = _made[(id(schema), reader)] = (schema, typed)
    typed = made[1]
    return typed


def typed_outputs(schema: Schema) -> TypedOutputs | None:
    """The fast path for ``schema``'s outputs; None where they cannot be typed (then all is generic)."""
    return _typed(TypedOutputs, schema)


def typed_requests(schema: Schema) -> TypedRequests | None:
    """The fast path for ``schema``'s requests (none where they cannot be typed: then all is generic)."""
    return _typed(TypedRequests, schema)
