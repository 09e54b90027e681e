"""The readers on the link, modelled: what each decoder does with a message unlike its own layout.

The rules are data (``readers.json``), each with where it comes from and the
test that pins it against the real reader; findings name the readers a change
breaks by asking them here, never by a reader's name in code.

A reader's layout of a release is that release's own declaration: the Python
classes for vLLM's Python readers (msgspec reads exactly what they declare),
the Rust structs for vllm-rs (``reader_schema``). Where the two languages of
one release differ (compare/drift.py), vllm-rs is judged by what it declares,
and so are the rules that turn on an attribute of a Rust struct (``unless``:
``deny_unknown_fields``, a tuple struct read through ``AllowTrailingFields``).
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from typing import Literal

import msgspec

from replay_proxy.compare.drift import pair_structs
from replay_proxy.compare.findings import PYTHON_ENGINE, PYTHON_FRONTEND, RUST_FRONTEND
from replay_proxy.wire.rust import RustField, RustSchema, load_rust_schema, rust_schema_path
from replay_proxy.wire.schema import Field, Schema, StructSchema, load_schema, shipped_releases

Rule = Literal["extra_trailing_elements", "missing_trailing_with_default", "unknown_map_key",
               "missing_required_key", "changed_type"]
READERS = (PYTHON_ENGINE, PYTHON_FRONTEND, RUST_FRONTEND)


@functools.cache
def reader_rules() -> dict[str, dict]:
    data = json.loads((importlib.resources.files("replay_proxy.compare") / "readers.json").read_text())
    return {reader: data[reader] for reader in READERS}


def reader_schema(reader: str, release: str) -> Schema:
    """``reader``'s layout of ``release``: the Python schema, or for a reader whose layouts are Rust's, the
    release's Rust structs (where the release has none: the Python schema, as vllm-rs mirrors it)."""
    if reader_rules()[reader]["layouts"] == "rust" and rust_schema_path(release).exists():
        return _rust_layouts_of(release)
    return load_schema(release)


@functools.cache
def _rust_layouts_of(release: str) -> Schema:
    return rust_layouts(load_schema(release), load_rust_schema(release))


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


@functools.cache
def _declared(release: str, attribute: str) -> frozenset[str]:
    """The Python names of the structs whose Rust struct in ``release`` declares ``attribute``."""
    rust = load_rust_schema(release)
    if rust is None:
        return frozenset()
    pairs = pair_structs(load_schema(release), rust)
    if attribute == "read_with_trailing":
        return frozenset(p for p, r in pairs.items() if r in rust.read_with_trailing)
    return frozenset(p for p, r in pairs.items() if getattr(rust.structs[r], attribute))


def _rule(reader: str, rule: Rule, struct: str | None, release: str | None) -> tuple[str, str]:
    """The verdict and source of ``reader``'s rule for ``struct`` in ``release`` (None: the newest)."""
    entry = reader_rules()[reader]["rules"][rule]
    unless = entry.get("unless")
    if unless and struct in _declared(release or shipped_releases()[-1], unless):
        return entry["then"], f"{entry['source']}; {struct} is read so in {release or 'the newest release'}"
    return entry["verdict"], entry["source"]


def verdict(reader: str, rule: Rule, struct: str | None = None, release: str | None = None) -> str:
    """What ``reader`` of ``release`` does with a message of ``struct`` that ``rule`` describes."""
    return _rule(reader, rule, struct, release)[0]


def source(reader: str, rule: Rule, struct: str | None = None, release: str | None = None) -> str:
    """Where the rule ``reader`` of ``release`` follows for ``struct`` comes from."""
    return _rule(reader, rule, struct, release)[1]


def rejecting(readers: tuple[str, ...], rule: Rule, struct: str | None = None,
              release: str | None = None) -> tuple[str, ...]:
    """Those of ``readers`` (of ``release``) that reject a message (of ``struct``) under ``rule``."""
    return tuple(r for r in readers if verdict(r, rule, struct, release) == "rejects")


def requiring(readers: tuple[str, ...], struct: str, field: str, release: str) -> tuple[str, ...]:
    """Those of ``readers`` whose own layout of ``release`` requires ``field`` of ``struct``: a Python reader
    as its release's class declares it, vllm-rs as its Rust struct does (one it does not declare, it never
    reads)."""
    required = []
    for reader in readers:
        layout = reader_schema(reader, release).structs.get(struct)
        declared = layout.by_name.get(field) if layout is not None else None
        if declared is not None and declared.required:
            required.append(reader)
    return tuple(required)


def how_they_read(readers: tuple[str, ...], rule: Rule, struct: str | None = None, release: str | None = None) -> str:
    """One clause per verdict: 'python-frontend ignores them; rust-frontend rejects them (...)'."""
    by_verdict: dict[str, list[str]] = {}
    for reader in readers:
        by_verdict.setdefault(verdict(reader, rule, struct, release), []).append(reader)
    clauses = []
    for what, names in by_verdict.items():
        why = source(names[0], rule, struct, release) if what == "rejects" else None
        verb = what.removesuffix("s") if len(names) > 1 else what
        clauses.append(f"{' and '.join(names)} {verb} them" + (f" ({why.split(':')[0]})" if why else ""))
    return "; ".join(clauses)
