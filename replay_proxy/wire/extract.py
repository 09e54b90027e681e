"""Extract a release's wire schema from vLLM's own classes.

Theory of operation: the only trustworthy description of a release's wire
format is the release itself. This file is run as a script by the Python
interpreter of a vLLM installation (``replay-proxy schema extract`` starts it
with ``--python``), so it imports nothing from replay_proxy: only msgspec,
vLLM and the standard library. It walks every struct reachable from the
top-level messages with ``msgspec.inspect.type_info`` and prints one JSON
document: per struct its encoding (array or map), and per field its name,
position, printable type, the msgpack kinds it accepts, whether it is
required, its default, the nested struct it holds and whether it is a tensor;
the enums (request types, finish reasons, ...); the msgpack extension type
codes; and every method a UTILITY request can call on the engine, with its
positional parameters (the engine calls ``method(*args)``, so a new required
parameter breaks a call from an older frontend as surely as a new field).
"""

from __future__ import annotations

import enum
import inspect
import json
import sys
from typing import Any

import msgspec
import msgspec.inspect as mi

TOP_LEVEL = {
    "EngineCoreRequest": "vllm.v1.engine:EngineCoreRequest",
    "EngineCoreOutputs": "vllm.v1.engine:EngineCoreOutputs",
    "EngineCoreReadyResponse": "vllm.v1.engine:EngineCoreReadyResponse",
    "EngineHandshakeMetadata": "vllm.v1.engine.utils:EngineHandshakeMetadata",
}
ENUMS = {
    "FinishReason": "vllm.v1.engine:FinishReason",
    "EngineCoreRequestType": "vllm.v1.engine:EngineCoreRequestType",
    "EngineCoreEventType": "vllm.v1.engine:EngineCoreEventType",
    "RequestOutputKind": "vllm.sampling_params:RequestOutputKind",
}
TENSOR_TYPES = {"Tensor", "ndarray"}
SERIAL_UTILS = "vllm.v1.serial_utils"  # CUSTOM_TYPE_* constants: the msgpack ext codes
UTILITY_TARGET = "vllm.v1.engine.core:EngineCoreProc"  # what a UTILITY request's method is looked up on


def load(path: str) -> Any:
    module, _, name = path.partition(":")
    obj = __import__(module, fromlist=[name])
    return getattr(obj, name, None)


class Walker:
    def __init__(self) -> None:
        self.structs: dict[str, dict[str, Any] | None] = {}

    def describe(self, t: mi.Type) -> tuple[str, list[str], str | None, bool]:
        """Return (printable type, msgpack kinds, nested struct name, tensor)."""
        if isinstance(t, mi.UnionType):
            parts = [self.describe(x) for x in t.types]
            kinds = sorted({k for p in parts for k in p[1]})
            nested = next((p[2] for p in parts if p[2]), None)
            return " | ".join(p[0] for p in parts), kinds, nested, any(p[3] for p in parts)
        simple = {
            mi.NoneType: ("None", ["nil"]),
            mi.BoolType: ("bool", ["bool"]),
            mi.IntType: ("int", ["int"]),
            mi.FloatType: ("float", ["float", "int"]),
            mi.StrType: ("str", ["str"]),
            mi.BytesType: ("bytes", ["bin"]),
            mi.ByteArrayType: ("bytearray", ["bin"]),
            mi.AnyType: ("Any", ["any"]),
        }
        for cls, (name, kinds) in simple.items():
            if isinstance(t, cls):
                return name, kinds, None, False
        if isinstance(t, mi.EnumType):
            values = [m.value for m in t.cls]
            kinds = sorted({"int" if isinstance(v, int) else "str" for v in values})
            return t.cls.__name__, kinds, None, False
        if isinstance(t, mi.LiteralType):
            kinds = sorted({"int" if isinstance(v, int) else "str" for v in t.values})
            return "Literal" + repr(list(t.values)), kinds, None, False
        if isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
            name, _, nested, tensor = self.describe(t.item_type)
            container = type(t).__name__.replace("Type", "").replace("VarTuple", "tuple").lower()
            return f"{container}[{name}]", ["array"], nested, tensor
        if isinstance(t, mi.TupleType):
            names = [self.describe(x)[0] for x in t.item_types]
            return f"tuple[{', '.join(names)}]", ["array"], None, False
        if isinstance(t, mi.DictType):
            k, v = self.describe(t.key_type), self.describe(t.value_type)
            return f"dict[{k[0]}, {v[0]}]", ["map"], v[2], False
        if isinstance(t, (mi.StructType, mi.DataclassType, mi.NamedTupleType, mi.TypedDictType)):
            name = t.cls.__name__
            self.add(name, t)
            array = isinstance(t, mi.NamedTupleType) or getattr(t, "array_like", False)
            return name, ["array" if array else "map"], name, False
        if isinstance(t, mi.CustomType):
            name = t.cls.__name__
            return name, ["any"], None, name in TENSOR_TYPES
        return type(t).__name__, ["any"], None, False

    def add(self, name: str, t: Any) -> None:  # (a StructType, DataclassType, NamedTupleType or TypedDictType)
        if name in self.structs:
            return
        self.structs[name] = None  # reserve: structs can be recursive
        array = isinstance(t, mi.NamedTupleType) or getattr(t, "array_like", False)
        fields = []
        for position, f in enumerate(t.fields):
            printable, kinds, nested, tensor = self.describe(f.type)
            fields.append(
                {
                    "name": f.encode_name,
                    "position": position,
                    "type": printable,
                    "kinds": kinds,
                    "required": f.required,
                    "default": default_of(f),
                    "struct": nested,
                    "tensor": tensor,
                }
            )
        self.structs[name] = {
            "vllm_class": f"{t.cls.__module__}.{t.cls.__qualname__}",
            "encoding": "array" if array else "map",
            # msgspec ignores omit_defaults on array_like structs (msgspec#720).
            "omit_defaults": omits_defaults(t.cls) and not array,
            "fields": fields,
        }


def omits_defaults(cls: type) -> bool:
    config = getattr(cls, "__struct_config__", None)
    return bool(config is not None and config.omit_defaults)


def default_of(field: mi.Field) -> Any:
    if field.required:
        return None
    if field.default is not mi.NODEFAULT:  # type: ignore[attr-defined]  # (exported, not declared)
        value = field.default
    elif field.default_factory is not mi.NODEFAULT:  # type: ignore[attr-defined]
        value = field.default_factory()
    else:
        return None
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, (set, frozenset, tuple)):
        value = sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    try:
        return json.loads(msgspec.json.encode(value))
    except (TypeError, msgspec.EncodeError):
        return repr(value)


def ext_types() -> dict[str, int]:
    module = __import__(SERIAL_UTILS, fromlist=["_"])
    return {name: value for name, value in sorted(vars(module).items())
            if name.startswith("CUSTOM_TYPE_") and isinstance(value, int)}


def utility_methods() -> dict[str, list[dict[str, Any]]] | None:
    """Public methods of the engine process, each with its parameters after self, or None if it does not import."""
    try:
        cls = load(UTILITY_TARGET)
    except Exception as exc:  # noqa: BLE001 - an older release's engine module may need what is not here
        print(f"utility methods not extracted: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    methods = {}
    for name, function in sorted(inspect.getmembers(cls, inspect.isfunction)):
        if name.startswith("_"):
            continue
        parameters = list(inspect.signature(function).parameters.values())[1:]
        methods[name] = [{"name": p.name, "kind": p.kind.name.lower(), "required": p.default is p.empty
                          and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD),
                          "type": None if p.annotation is p.empty else
                          (p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation))}
                         for p in parameters]
    return methods


def main() -> None:
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM logs to stdout at import; keep ours clean
    import vllm  # type: ignore[import-not-found]  # (run by a vLLM installation's interpreter)

    walker = Walker()
    for name, path in TOP_LEVEL.items():
        cls = load(path)
        if cls is not None:
            walker.add(name, mi.type_info(cls))
    enums: dict[str, dict[str, Any]] = {}
    for name, path in ENUMS.items():
        cls = load(path)
        if cls is not None:
            enums[name] = {m.name: m.value.decode("latin-1") if isinstance(m.value, bytes) else m.value for m in cls}
    version = vllm.__version__.split("+")[0]
    json.dump(
        {
            "release": version,
            "extracted_from": f"vllm {vllm.__version__}, msgspec {msgspec.__version__}",
            "structs": dict(sorted(walker.structs.items())),
            "enums": enums,
            "ext_types": ext_types(),
            "utility_methods": utility_methods(),
        },
        out,
        indent=1,
    )
    out.write("\n")


if __name__ == "__main__":
    main()
