"""The Rust frontend's wire schema, read from its own source with tree-sitter.

vllm-rs declares what it writes and reads on the link as serde structs and
enums in ``rust/src/engine-core-client/src/protocol/``. Each is read with a
real Rust parser (tree-sitter-rust), never with regular expressions:

* a struct's encoding: ``array`` when it derives ``Serialize_tuple`` /
  ``Deserialize_tuple`` (serde_tuple: positional, as msgspec's
  ``array_like``), ``transparent`` for ``#[serde(transparent)]`` or a tuple
  struct, else ``map`` (named fields);
* each field in declaration order: its name on the wire (``rename``), its
  Rust type, whether it is an ``Option``, whether a missing value is filled
  in (``#[serde(default)]`` on the field or the struct), ``flatten``,
  ``skip``, ``skip_serializing_if``;
* ``deny_unknown_fields``, and each enum: ``repr`` (an integer on the wire)
  or its variants' names (``rename``, ``rename_all``), ``untagged``.

Here too is which Rust struct mirrors which Python class (``pair_structs``)
and vllm-rs as a reader, its layouts laid out as a ``Schema`` (``rust_layouts``):
what the source declares. What that means for a reader (which extra or missing
values it accepts) is ``compare/``'s to judge.
Every release from 0.22.0 has it; each is read once (``replay-proxy schema
extract --rust``) and shipped in ``rust_schemas/RELEASE.json``, beside the
Python schemas, or added with a release (``add-release``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from replay_proxy.wire.schema import Field, Schema, StructSchema

if TYPE_CHECKING:
    from tree_sitter import Node

PROTOCOL = Path("rust/src/engine-core-client/src/protocol")  # within a vLLM source tree (an sdist's root)


class RustField(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str  # on the wire
    rust_name: str
    type: str  # as written, e.g. Option<Vec<u32>>
    position: int
    optional: bool = False  # Option<...>
    default: bool = False  # a missing value is filled in (serde default, on the field or its struct)
    flatten: bool = False
    skip: bool = False  # never read or written
    skip_serializing_if: str | None = None  # left out when writing if this holds
    allow_trailing: bool = False  # read through AllowTrailingFields: its structs' extra trailing elements pass

    @property
    def inner(self) -> str:
        """The type inside ``Option<...>``."""
        return self.type[len("Option<"):-1].strip() if self.optional else self.type


class RustStruct(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str
    encoding: str  # array, map, transparent
    fields: list[RustField]
    file: str
    deny_unknown_fields: bool = False


class RustEnum(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str
    variants: list[str]  # as on the wire: names (after rename / rename_all), or integers for a repr enum
    file: str
    repr: bool = False
    untagged: bool = False


class RustSchema(msgspec.Struct, frozen=True):
    release: str
    structs: dict[str, RustStruct]
    enums: dict[str, RustEnum]
    # A type that crosses the wire as another: #[serde(from, into, try_from)], or a hand-written
    # Serialize / Deserialize impl that goes through a wire type (StructuredOutputsParams -> its Wire...)
    wire_forms: dict[str, str] = {}

    def wire_form(self, name: str) -> str:
        seen = set()
        while name in self.wire_forms and name not in seen:
            seen.add(name)
            name = self.wire_forms[name]
        return name

    def struct_of(self, type_text: str) -> str | None:
        """The struct (in its wire form) a field of type ``type_text`` holds: ``Option<Vec<LoraRequest>>`` ->
        ``LoraRequest``; None for a scalar, a string, an enum."""
        return next((self.wire_form(n) for n in type_names(type_text) if self.wire_form(n) in self.structs), None)

    def wire_fields(self, struct: RustStruct) -> list[RustField]:
        """A struct's fields as they are on the wire: a ``flatten``ed struct's fields in its place, a flattened
        enum's variants as optional keys; skipped fields left out."""
        fields = []
        for f in struct.fields:
            if f.skip:
                continue
            if not f.flatten:
                fields.append(f)
                continue
            target = next((self.wire_form(n) for n in type_names(f.type)
                           if self.wire_form(n) in self.structs or self.wire_form(n) in self.enums), None)
            if target in self.structs:
                fields += [msgspec.structs.replace(g, optional=g.optional or f.optional)
                           for g in self.wire_fields(self.structs[target])]
            elif target in self.enums:
                fields += [RustField(v, v, f.type, f.position, optional=True) for v in self.enums[target].variants]
        return fields

    @property
    def read_with_trailing(self) -> set[str]:
        """Tuple structs vllm-rs reads through ``AllowTrailingFields`` somewhere: their extra trailing elements
        pass there (from 0.31.0: EngineCoreOutput, within EngineCoreOutputs)."""
        return {name for struct in self.structs.values() for f in struct.fields if f.allow_trailing
                for name in type_names(f.type)}


def type_names(type_text: str) -> list[str]:
    """The type names in a Rust type, innermost last: ``Option<Vec<lora::LoraRequest>>`` -> [.., LoraRequest]."""
    names, word = [], ""
    for ch in type_text + " ":
        if ch.isalnum() or ch == "_":
            word += ch
        else:
            if word:
                names.append(word)
            word = ""
    return names[::-1]


def read_protocol(root: Path, release: str) -> RustSchema:
    """The structs and enums declared in ``root`` (a vLLM source tree, or its protocol folder itself)."""
    import tree_sitter_rust
    from tree_sitter import Language, Parser

    folder = root / PROTOCOL if (root / PROTOCOL).is_dir() else root
    parser = Parser(Language(tree_sitter_rust.language()))
    structs: dict[str, RustStruct] = {}
    enums: dict[str, RustEnum] = {}
    impls: dict[str, set[str]] = {}  # a type with hand-written serde impls -> the paths its impls call
    forms: dict[str, str] = {}
    for path in sorted(folder.rglob("*.rs")):
        if path.name == "tests.rs" or "tests" in path.relative_to(folder).parts[:-1]:
            continue
        tree = parser.parse(path.read_bytes())
        _read_items(tree.root_node, str(path.relative_to(folder)), structs, enums, impls, forms)
    for name, called in impls.items():
        wire = sorted(n for n in called if n in structs and n != name)
        if wire and name not in forms:
            forms[name] = wire[0]
    return RustSchema(release, structs, enums, forms)


# Each ``#[name(key, key = "value", ...)]`` of an item, as (name, [(key, value or None), ...]).
Attributes = list[tuple[str, list[tuple[str, str | None]]]]


def _text(node: Node | None) -> str:
    """A node's source text ('' for a part the grammar lets an item leave out)."""
    return node.text.decode() if node is not None and node.text is not None else ""


SERDE_TRAITS = ("Serialize", "Deserialize", "serde::Serialize", "serde::Deserialize")


def _read_items(node: Node, file: str, structs: dict[str, RustStruct], enums: dict[str, RustEnum],
                impls: dict[str, set[str]], forms: dict[str, str]) -> None:
    attributes: list[Node] = []
    for child in node.children:
        if child.type == "attribute_item":
            attributes.append(child)
            continue
        serde = _serde(_attributes(attributes))
        form = serde.get("into") or serde.get("from") or serde.get("try_from")
        if child.type == "struct_item":
            struct = _struct(child, _attributes(attributes), file)
            if struct is not None:
                structs[struct.name] = struct
        elif child.type == "enum_item":
            enum = _enum(child, _attributes(attributes), file)
            if enum is not None:
                enums[enum.name] = enum
        elif child.type == "impl_item":
            trait, target = child.child_by_field_name("trait"), child.child_by_field_name("type")
            if trait is not None and target is not None and _base(_text(trait)) in SERDE_TRAITS:
                impls.setdefault(_base(_text(target)), set()).update(_called_paths(child))
        elif child.type == "mod_item" and not _is_test_module(attributes):  # (#[cfg(test)]: fixtures)
            body = child.child_by_field_name("body")
            if body is not None:
                _read_items(body, file, structs, enums, impls, forms)
        if form and child.type in ("struct_item", "enum_item"):
            forms[_text(child.child_by_field_name("name"))] = form
        if child.type not in ("line_comment", "block_comment"):
            attributes = []


def _base(type_text: str) -> str:
    """``Deserialize<'de>`` -> ``Deserialize``; ``Foo<T>`` -> ``Foo``."""
    return type_text.split("<", 1)[0].strip()


def _called_paths(node: Node) -> set[str]:
    """The first segment of every ``X::y`` path in ``node`` (the types an impl's body goes through)."""
    found, todo = set[str](), [node]
    while todo:
        current = todo.pop()
        if current.type == "scoped_identifier":
            path = current.child_by_field_name("path")
            if path is not None and path.type in ("identifier", "type_identifier"):
                found.add(_text(path))
        todo.extend(current.children)
    return found


def _is_test_module(attributes: list[Node]) -> bool:
    return any(name == "cfg" and "test" in [k for k, _ in args] for name, args in _attributes(attributes))


def _attributes(items: list[Node]) -> Attributes:
    """Each ``#[name(key, key = "value", ...)]`` as (name, [(key, value or None), ...])."""
    found = []
    for item in items:
        attribute = next((c for c in item.children if c.type == "attribute"), None)
        if attribute is None or not attribute.children:
            continue
        name = _text(attribute.children[0])
        tree = next((c for c in attribute.children if c.type == "token_tree"), None)
        found.append((name, _arguments(tree) if tree is not None else []))
    return found


def _arguments(tree: Node) -> list[tuple[str, str | None]]:
    """The top-level ``key`` and ``key = "value"`` of a token tree; nested trees kept as their text."""
    arguments: list[tuple[str, str | None]] = []
    tokens = [c for c in tree.children if c.type not in ("(", ")", "[", "]", "{", "}")]
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.type == ",":
            i += 1
            continue
        key = _text(token)
        value = None
        if i + 2 < len(tokens) and tokens[i + 1].type == "=":
            literal = tokens[i + 2]
            content = next((c for c in literal.children if c.type == "string_content"), None)
            value = _text(content) if content is not None else _text(literal)
            i += 3
        else:
            i += 1
        arguments.append((key, value))
    return arguments


def _named(attributes: Attributes, which: str) -> dict[str, str | None]:
    return {k: v for name, args in attributes if name == which for k, v in args}


def _serde(attributes: Attributes) -> dict[str, str | None]:
    return _named(attributes, "serde")


def _derives(attributes: Attributes) -> set[str]:
    return {k for name, args in attributes if name == "derive" for k, _ in args}


def _struct(node: Node, attributes: Attributes, file: str) -> RustStruct | None:
    derives = _derives(attributes)
    if not derives & {"Serialize", "Deserialize", "Serialize_tuple", "Deserialize_tuple"}:
        return None  # not on the wire
    name = _text(node.child_by_field_name("name"))
    serde = _serde(attributes)
    body = node.child_by_field_name("body")
    if body is None or body.type == "ordered_field_declaration_list" or "transparent" in serde:
        return RustStruct(name, "transparent", _tuple_fields(body), file)
    encoding = "array" if derives & {"Serialize_tuple", "Deserialize_tuple"} else "map"
    container_default = "default" in serde
    fields: list[RustField] = []
    pending: list[Node] = []
    for child in body.children:
        if child.type == "attribute_item":
            pending.append(child)
            continue
        if child.type != "field_declaration":
            continue
        attributes_of_field = _attributes(pending)
        own, serde_as = _serde(attributes_of_field), _named(attributes_of_field, "serde_as")
        pending = []
        rust_name = _text(child.child_by_field_name("name")).removeprefix("r#")  # r#type: a raw identifier
        type_text = " ".join(_text(child.child_by_field_name("type")).split())
        read_as = serde_as.get("deserialize_as") or serde_as.get("as") or ""
        fields.append(RustField(
            name=own.get("rename") or rust_name, rust_name=rust_name, type=type_text, position=len(fields),
            optional=type_text.startswith("Option<"), default=container_default or "default" in own,
            flatten="flatten" in own, skip="skip" in own, skip_serializing_if=own.get("skip_serializing_if"),
            allow_trailing="AllowTrailingFields" in read_as))
    return RustStruct(name, encoding, fields, file, deny_unknown_fields="deny_unknown_fields" in serde)


def _tuple_fields(body: Node | None) -> list[RustField]:
    if body is None:
        return []
    types = [c for c in body.children if c.type not in ("(", ")", ",", "visibility_modifier", "attribute_item")]
    return [RustField(name=str(i), rust_name=str(i), type=" ".join(_text(t).split()), position=i)
            for i, t in enumerate(types)]


def _enum(node: Node, attributes: Attributes, file: str) -> RustEnum | None:
    derives = _derives(attributes)
    repr_ = bool(derives & {"Serialize_repr", "Deserialize_repr"})
    if not repr_ and not derives & {"Serialize", "Deserialize"}:
        return None
    serde = _serde(attributes)
    variants: list[str] = []
    pending: list[Node] = []
    value = -1
    body = node.child_by_field_name("body")
    for variant in body.children if body is not None else []:
        if variant.type == "attribute_item":
            pending.append(variant)
            continue
        if variant.type != "enum_variant":
            continue
        own = _serde(_attributes(pending))
        pending = []
        rust_name = _text(variant.child_by_field_name("name"))
        if repr_:
            literal = variant.child_by_field_name("value")
            value = int(_text(literal)) if literal is not None else value + 1
            variants.append(str(value))
        else:
            variants.append(own.get("rename") or _renamed(rust_name, serde.get("rename_all")))
    return RustEnum(_text(node.child_by_field_name("name")), variants, file, repr=repr_,
                    untagged="untagged" in serde)


def _renamed(name: str, rule: str | None) -> str:
    """A variant's name under serde's ``rename_all`` rule."""
    words, word = [], ""
    for ch in name:
        if ch.isupper() and word:
            words.append(word)
            word = ""
        word += ch
    words.append(word)
    return {"lowercase": name.lower(), "UPPERCASE": name.upper(),
            "snake_case": "_".join(w.lower() for w in words),
            "SCREAMING_SNAKE_CASE": "_".join(w.upper() for w in words),
            "kebab-case": "-".join(w.lower() for w in words)}.get(rule or "", name)


def encode_rust_schema(schema: RustSchema) -> bytes:
    return msgspec.json.format(msgspec.json.encode(schema), indent=1) + b"\n"


# The structs each side writes on the link (the frontend: requests and utility calls; the engine: the rest),
# from which the pairing goes down.
FRONTEND_ROOTS = ("EngineCoreRequest",)
ENGINE_ROOTS = ("EngineCoreOutputs", "EngineCoreReadyResponse")


def pair_structs(python: Schema, rust: RustSchema) -> dict[str, str]:
    """Python class -> the Rust struct that mirrors it."""
    by_name = {}
    for name in rust.structs:
        for python_name in (name, name.removeprefix("Wire"), name.removeprefix("Wire").removeprefix("EngineCore"),
                            name.removeprefix("EngineCore")):
            if python_name in python.structs and python_name not in by_name:
                by_name[python_name] = name
                break
    pairs, todo = {}, [p for p in (*FRONTEND_ROOTS, *ENGINE_ROOTS) if p in by_name]
    for root in todo:
        pairs[root] = by_name[root]
    while todo:  # down through the fields of paired structs
        name = todo.pop()
        rust_fields = {f.name: f for f in rust.structs[pairs[name]].fields}
        for field in python.structs[name].fields:
            if field.struct is None or field.struct in pairs or field.name not in rust_fields:
                continue
            below = rust.struct_of(rust_fields[field.name].type)
            if below is not None:
                pairs[field.struct] = below
                todo.append(field.struct)
    return {**{p: r for p, r in by_name.items() if p not in pairs}, **pairs}


def rust_layouts(python: Schema, rust: RustSchema) -> Schema:
    """vllm-rs as a reader: its release's Python schema with each struct the Rust side mirrors laid
    out as Rust declares it: its fields on the wire in order (a flattened struct's in its place), required
    where neither an ``Option`` nor ``#[serde(default)]``, a map's missing required key a rejection. Each
    field Python mirrors keeps Python's name, struct and the msgpack kinds it accepts (one only Rust has accepts
    any: its width is compare/drift.py's to judge)."""
    structs = dict(python.structs)
    for name, rust_name in pair_structs(python, rust).items():
        declared = rust.structs[rust_name]
        if declared.encoding not in ("array", "map"):  # transparent: read as the type it wraps
            continue
        mirror = python.structs[name]
        fields = tuple(_as_read(f, position, _mirrored(mirror, declared.encoding, f, position))
                       for position, f in enumerate(rust.wire_fields(declared)))
        structs[name] = msgspec.structs.replace(mirror, encoding=declared.encoding,
                                                omit_defaults=False, fields=fields)
    return msgspec.structs.replace(python, structs=structs, extracted_from=f"vllm-rs {rust.release}'s Rust structs")


def _mirrored(mirror: StructSchema, encoding: str, declared: RustField, position: int) -> Field | None:
    """The Python field ``declared`` mirrors: in a tuple struct the one at its position, whatever either side
    calls it (positions carry no names: a name only one side uses there is drift's to report); in a map, the
    one of its name."""
    if encoding == "array":
        return mirror.fields[position] if position < len(mirror.fields) and mirror.encoding == "array" else None
    return mirror.by_name.get(declared.name)


def _as_read(declared: RustField, position: int, python: Field | None) -> Field:
    required = not (declared.optional or declared.default)
    if python is None:
        return Field(declared.name, position, declared.type, ("any",), required)
    return msgspec.structs.replace(python, position=position, required=required,
                                   default=None if required else python.default)
