"""Per-release wire schemas, and naming decoded msgpack values with them.

A schema is data: one JSON file per vLLM release in ``schemas/``, written by
``extract.py`` from that release's own classes. Naming a value walks it
against a struct's fields: arrays by position, maps by key. Whatever the
schema does not describe (an extra trailing position, a missing required
one, an unexpected msgpack kind, an unknown map key) becomes a ``Flag``
instead of an exception, so a frame from a drifted peer still decodes as far
as it can and the drift itself is recorded.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import msgspec

from replay_proxy.wire.values import INLINE_VALUES_LIMIT, Ext, Tensor, kind_of, resolve_tensor


INT_ARRAYS = frozenset(f"{c}[int]{n}" for c in ("list", "set", "frozenset", "tuple") for n in ("", " | None"))
TOKEN_TENSORS = frozenset({"prompt_token_ids"})  # 0.34.0 on: a 32-bit int ndarray


class Field(msgspec.Struct, frozen=True):
    name: str
    position: int
    type: str
    kinds: tuple[str, ...]  # msgpack kinds accepted: nil bool int float str bin array map any
    required: bool
    default: Any = None
    struct: str | None = None  # the nested struct this field (or its items) holds
    tensor: bool = False

    @property
    def int_items(self) -> bool:
        """An array of ints (token ids, mostly): its items are checked too, so that another release's
        encoding of the same field (0.34.0's prompt as an ndarray) is not read as one."""
        return self.type in INT_ARRAYS

    @property
    def whole(self) -> bool:
        """A tensor of token ids, read whatever its length: a request's substance, not bulk data."""
        return self.tensor and self.name in TOKEN_TENSORS

    @property
    def resolved(self) -> bool:
        """The Namer resolves this field's value (a tensor, a multimodal item): never named as decoded."""
        return self.tensor or self.type.startswith("MultiModalKwargsItem")


def read(value: Any, field: Field | None) -> Any:
    """One field of a struct's value as it came off the wire, none of the rest decoded or named: the element
    at its position of an array, its key of a map; None where the value has no such field (shorter, not a
    struct, or a release without it: ``field`` None)."""
    if field is None:
        return None
    if isinstance(value, list):
        return value[field.position] if field.position < len(value) else None
    return value.get(field.name) if isinstance(value, dict) else None


class StructSchema(msgspec.Struct, frozen=True, dict=True):
    """One vLLM struct: how it is encoded and its fields in order."""

    vllm_class: str
    encoding: Literal["array", "map"]
    omit_defaults: bool
    fields: tuple[Field, ...]

    @functools.cached_property
    def by_name(self) -> dict[str, Field]:
        return {f.name: f for f in self.fields}


def schema_lines(fields: tuple[Field, ...]) -> list[str]:
    """A struct's fields as lines for a side-by-side view: ``position name: type = default``."""
    return [f"{f.position} {f.name}: {f.type}{'' if f.required else ' = ' + repr(f.default)}" for f in fields]


class Parameter(msgspec.Struct, frozen=True):
    """A parameter of a utility method, after self."""

    name: str
    kind: str  # positional_or_keyword, positional_only, var_positional, keyword_only, var_keyword
    required: bool
    type: str | None = None


class Schema(msgspec.Struct, frozen=True, dict=True):
    """The wire schema of one vLLM release."""

    release: str
    extracted_from: str
    structs: dict[str, StructSchema]
    enums: dict[str, dict[str, Any]]
    ext_types: dict[str, int] = {}  # CUSTOM_TYPE_* -> msgpack ext code
    utility_methods: dict[str, tuple[Parameter, ...]] | None = None  # None: not extracted for this release

    def position(self, struct: str, field: str) -> int:
        """Where ``field`` stands in an array-encoded ``struct``."""
        return self.structs[struct].by_name[field].position

    def read(self, value: Any, struct: str, field: str) -> Any:
        """Field ``field`` of a ``struct`` value as it came off the wire (``read``): by this release's layout."""
        spec = self.structs.get(struct)
        return read(value, spec.by_name.get(field) if spec is not None else None)

    def enum_name(self, enum: str, value: Any) -> str | None:
        for name, v in self.enums.get(enum, {}).items():
            if v == value:
                return name
        return None

    def finish_name(self, value: Any) -> str | None:
        """``1`` -> ``"length"``: vLLM's FinishReason string form."""
        if value is None:
            return None
        name = self.enum_name("FinishReason", value)
        return name.lower() if name else str(value)

    @functools.cached_property
    def sampling_defaults(self) -> dict[str, Any]:
        return {f.name: f.default for f in self.structs["SamplingParams"].fields}

    def sampling_value(self, params: dict[str, Any], key: str) -> Any:
        """The value of SamplingParams ``key`` in effect: as sent, else this release's default
        (the Python frontend leaves defaults out)."""
        return params.get(key, self.sampling_defaults.get(key))


Issue = Literal["extra_position", "missing_required", "type_mismatch", "unknown_key", "not_a_struct"]


class Flag(msgspec.Struct, frozen=True, omit_defaults=True):
    """Something in a frame the schema does not describe."""

    struct: str
    issue: Issue
    path: str
    field: str | None = None
    position: int | None = None
    expected: str | None = None
    got: str | None = None


def release_key(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release.split("+")[0].split(".") if p.isdigit())


class Namer:
    """Names one decoded value against a schema, collecting flags."""

    def __init__(self, schema: Schema, frames: list[bytes] | None = None):
        self.schema = schema
        self.frames = frames or []
        self.flags: list[Flag] = []

    def struct(self, name: str, value: Any, path: str = "$") -> Any:
        spec = self.schema.structs.get(name)
        if spec is None:
            return value
        if spec.encoding == "array":
            if not isinstance(value, list):
                self._flag(name, "not_a_struct", path, expected="array", got=kind_of(value))
                return value
            return self._array(name, spec, value, path)
        if not isinstance(value, dict):
            self._flag(name, "not_a_struct", path, expected="map", got=kind_of(value))
            return value
        return self._map(name, spec, value, path)

    def _array(self, name: str, spec: StructSchema, value: list[Any], path: str) -> dict[str, Any]:
        named: dict[str, Any] = {}
        for field in spec.fields:
            if field.position < len(value):
                named[field.name] = self.field(name, field, value[field.position], f"{path}[{field.position}]")
            elif field.required:
                self._flag(name, "missing_required", path, field=field.name, position=field.position)
        for position in range(len(spec.fields), len(value)):
            extra = value[position]
            named[f"${position}"] = extra
            self._flag(name, "extra_position", f"{path}[{position}]", position=position, got=kind_of(extra))
        return named

    def _map(self, name: str, spec: StructSchema, value: dict[Any, Any], path: str) -> dict[Any, Any]:
        named: dict[Any, Any] = {}
        fields = spec.by_name
        for key, item in value.items():
            field = fields.get(key)
            if field is None:
                named[key] = item
                self._flag(name, "unknown_key", f"{path}.{key}", field=str(key), got=kind_of(item))
            else:
                named[key] = self.field(name, field, item, f"{path}.{key}")
        if not spec.omit_defaults:
            # Dataclass maps carry every field; a missing required key is what
            # makes msgspec fail with "Object missing required field".
            for field in spec.fields:
                if field.required and field.name not in value:
                    self._flag(name, "missing_required", path, field=field.name)
        return named

    def field(self, owner: str, field: Field, value: Any, path: str) -> Any:
        kind = kind_of(value)
        if "any" not in field.kinds and kind not in field.kinds:
            self._flag(owner, "type_mismatch", path, field=field.name, position=field.position,
                       expected=field.type, got=kind)
            return value
        if field.tensor:
            tensor = resolve_tensor(value, self.frames, None if field.whole else INLINE_VALUES_LIMIT)
            if tensor is None and value is not None:  # vLLM's decoder reads [dtype, shape, data] here, or fails
                self._flag(owner, "type_mismatch", path, field=field.name, position=field.position,
                           expected=field.type, got=kind)
            return value if tensor is None else tensor
        if kind == "array" and field.int_items:
            bad = next((i for i, v in enumerate(value) if type(v) is not int), None)
            if bad is not None:  # (where msgspec's decoder stops too: the first item that is no int)
                self._flag(owner, "type_mismatch", f"{path}[{bad}]", field=field.name, position=field.position,
                           expected=field.type, got=kind_of(value[bad]))
                return value
        if field.type.startswith("MultiModalKwargsItem") and isinstance(value, dict):
            return self._mm_item(value)
        if field.struct is None or value is None:
            return value
        container = field.type.split("[", 1)[0]
        if container in ("list", "set", "frozenset", "tuple") and isinstance(value, list):
            return [self.struct(field.struct, v, f"{path}[{i}]") for i, v in enumerate(value)]
        if container == "dict" and isinstance(value, dict):
            return {k: self.struct(field.struct, v, f"{path}.{k}") for k, v in value.items()}
        return self.struct(field.struct, value, path)

    def _tensor(self, value: Any) -> Any:
        tensor = resolve_tensor(value, self.frames)
        return tensor if tensor is not None else value

    def _mm_item(self, item: dict[str, Any]) -> dict[str, Any]:
        """A multimodal item as vLLM sends it: by key, its data (tensors, nested in lists, or numbers) and
        its field ([factory name, its keywords], kept as sent)."""
        return {key: {**elem, "data": self._nested_tensors(elem.get("data"))} if isinstance(elem, dict) else elem
                for key, elem in item.items()}

    def _nested_tensors(self, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], str):
            return self._tensor(value)
        return [self._nested_tensors(v) for v in value] if isinstance(value, list) else value

    def _flag(self, struct: str, issue: Issue, path: str, **details: Any) -> None:
        self.flags.append(Flag(struct=struct, issue=issue, path=path, **details))


__all__ = ["Ext", "Field", "Flag", "Namer", "Schema", "StructSchema", "Tensor", "release_key", "schema_lines"]
