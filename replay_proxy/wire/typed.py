"""The fast path for the bulk of the traffic: EngineCoreOutputs that conform to their release's schema.

A busy engine sends one EngineCoreOutputs per step with an output per
running request: nearly every frame and row a recording holds. Naming those
generically (``schema.Namer``: a Python call per field) is most of a
writer's CPU. Here the same schema generates msgspec Structs, so msgspec
decodes and checks a conforming frame in C:

* every position the release defines must be there, and no more;
* a scalar field must have one of its schema kinds (msgspec's own check);
* an output's nested or opaque fields (logprobs, events, tensors, transfer
  params...) must be nil, and the frame must have no aux frames.

Whatever does not conform (a drifted peer, logprobs, a utility answer, the
odd frame with events) makes ``read`` return None, and the caller names it
generically: the result is the same either way, this way is only faster
(``tests/wire/test_typed.py`` holds the two against each other). A frame's
own nested fields (scheduler stats) are named generically, one per frame.
"""

from __future__ import annotations

import operator
from typing import Any

import msgspec

from replay_proxy.wire.schema import Flag, Namer, Schema
from replay_proxy.wire.values import decode_msgpack

_SCALARS = {"nil": type(None), "bool": bool, "int": int, "str": str, "float": float}


class Outputs(msgspec.Struct, frozen=True, gc=False):
    """A conforming EngineCoreOutputs, read: its own fields named, its outputs as column values."""

    fields: dict[str, Any]  # every field but outputs, named as the Namer names them
    outputs: list[tuple]  # per output: request_id, new_token_ids, finish_reason, stop_reason, num_nans_in_logits
    flags: tuple[Flag, ...]  # from the frame's nested fields (its outputs conform, or it would not be here)


def _scalar_type(kinds: tuple[str, ...]) -> Any:
    """The msgspec type of a field of scalar kinds only, or None."""
    return _kinds_type(kinds) if set(kinds) <= _SCALARS.keys() else None


# The EngineCoreOutput fields a row of output_rows holds as columns, in the order ``read`` gives them.
OUTPUT_COLUMNS = ("request_id", "new_token_ids", "finish_reason", "stop_reason", "num_nans_in_logits")


class TypedOutputs:
    """Reads conforming EngineCoreOutputs frames of one release (see the module's docstring)."""

    def __init__(self, schema: Schema):
        self.schema = schema
        frame, output = schema.structs["EngineCoreOutputs"], schema.structs["EngineCoreOutput"]
        output_fields = []
        for field in output.fields:
            scalar = _scalar_type(field.kinds) if field.struct is None and not field.tensor else None
            if field.name == "new_token_ids" and field.kinds == ("array",):
                scalar = list
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
        # Frame fields read raw: (position, Field, a decoder that checks the value conforms, or None).
        self._named: list[tuple[int, Any, Any]] = []
        frame_fields = []
        for field in frame.fields:
            if field.name == "outputs":
                kind = list[output_struct]
            elif field.name == "utility_output":
                kind = None  # a utility answer: the generic path's
            else:
                kind = _scalar_type(field.kinds) if field.struct is None and not field.tensor else None
                if kind is None:
                    kind = msgspec.Raw
                    check = _field_type(schema, field, {})
                    self._named.append((field.position, field,
                                        None if check is None else msgspec.msgpack.Decoder(check).decode))
            frame_fields.append((field.name, kind))
        self._frame_names = [name for name, _ in frame_fields]
        self._outputs_at = self._frame_names.index("outputs")
        self._decode = msgspec.msgpack.Decoder(_positional("TypedOutputs", [kind for _, kind in frame_fields])).decode

    def read(self, parts: list[bytes]) -> Outputs | None:
        """The frame read, or None if it does not conform (then name it generically)."""
        if len(parts) != 1:
            return None
        try:
            value = astuple(self._decode(parts[0]))
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
        fields = dict(zip(self._frame_names, value))
        del fields["outputs"]
        namer = Namer(self.schema, parts)
        for position, field, check in self._named:
            raw = fields[field.name]
            if check is not None:
                try:
                    check(raw)  # it conforms: the Namer would give back the value as decoded
                    fields[field.name] = decode_msgpack(raw)
                    continue
                except msgspec.DecodeError:
                    pass
            fields[field.name] = namer.field("EngineCoreOutputs", field, decode_msgpack(raw), f"$[{position}]")
        return Outputs(fields, outputs, tuple(namer.flags))


astuple, UNSET = msgspec.structs.astuple, msgspec.UNSET
_OTHER_KINDS = {"bin": bytes, "ext": msgspec.msgpack.Ext, "map": dict, "array": list, "any": Any}


def _field_type(schema: Schema, field: Any, made: dict[str, Any]) -> Any:
    """A msgspec type that accepts exactly the values the Namer names without a flag and gives back as
    decoded, for one field; None where no msgspec type says that (then the Namer checks it)."""
    if field.tensor:
        return None  # the Namer resolves tensors: never the value as decoded
    if field.struct is None:
        return _kinds_type(field.kinds)
    nested = _struct_type(schema, field.struct, made)
    if nested is None:
        return None
    container = field.type.split("[", 1)[0]
    if container in ("list", "set", "frozenset", "tuple") and field.kinds == ("array",):
        return list[nested]
    if container == "dict" and field.kinds == ("map",):
        return dict[str, nested]
    others = [_SCALARS.get(k) for k in field.kinds if k not in ("map", "array")]
    if None in others or {"map", "array"} <= set(field.kinds):
        return None
    return _union([nested, *others])


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


_made: dict[int, tuple[Schema, TypedOutputs | None]] = {}  # by id: a Schema holds dicts, so it has no hash


def typed_outputs(schema: Schema) -> TypedOutputs | None:
    """The fast path for ``schema``'s release; None where its outputs cannot be typed (then all is generic)."""
    made = _made.get(id(schema))
    if made is None or made[0] is not schema:
        try:
            typed = TypedOutputs(schema)
        except ValueError:
            typed = None
        made = _made[id(schema)] = (schema, typed)
    return made[1]
