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
from typing import Any, Literal

import msgspec

from replay_proxy.compare.findings import PYTHON_ENGINE, PYTHON_FRONTEND, RUST_FRONTEND
from replay_proxy.wire.rust import pair_structs, rust_layouts
from replay_proxy.wire.registry import load_rust_schema, load_schema, rust_schema_path, shipped_releases
from replay_proxy.wire.schema import Schema

Rule = Literal["extra_trailing_elements", "missing_trailing_with_default", "unknown_map_key",
               "missing_required_key", "changed_type"]
READERS = (PYTHON_ENGINE, PYTHON_FRONTEND, RUST_FRONTEND)


@functools.cache
def reader_rules() -> dict[str, dict[str, Any]]:
    data = json.loads((importlib.resources.files("replay_proxy.compare") / "readers.json").read_text())
    return {reader: data[reader] for reader in READERS}


class _Release(msgspec.Struct, frozen=True):
    """What the readers of one release declare, read once."""
    python: Schema  # the Python readers' layouts (msgspec reads exactly what the classes declare)
    rust: Schema | None  # vllm-rs's (rust_layouts); None where the release has no Rust structs
    declared: dict[str, frozenset[str]]  # a Rust struct attribute -> the Python names of the structs declaring it


def _release(release: str) -> _Release:
    # Read again once its Rust schema is there: add-release writes it after the Python one, and judges between.
    return _read_release(release, rust_schema_path(release).exists())


@functools.cache
def _read_release(release: str, has_rust: bool) -> _Release:
    python, rust = load_schema(release), load_rust_schema(release) if has_rust else None
    if rust is None:
        return _Release(python, None, {"read_with_trailing": frozenset(), "deny_unknown_fields": frozenset()})
    pairs = pair_structs(python, rust)
    return _Release(python, rust_layouts(python, rust), {
        "read_with_trailing": frozenset(p for p, r in pairs.items() if r in rust.read_with_trailing),
        "deny_unknown_fields": frozenset(p for p, r in pairs.items() if rust.structs[r].deny_unknown_fields)})


def reader_schema(reader: str, release: str) -> Schema:
    """``reader``'s layout of ``release``: the Python schema, or for a reader whose layouts are Rust's, the
    release's Rust structs (where the release has none: the Python schema, as vllm-rs mirrors it)."""
    layouts = _release(release)
    return layouts.rust if reader_rules()[reader]["layouts"] == "rust" and layouts.rust else layouts.python


def _rule(reader: str, rule: Rule, struct: str | None, release: str | None) -> tuple[str, str]:
    """The verdict and source of ``reader``'s rule for ``struct`` in ``release`` (None: the newest)."""
    entry = reader_rules()[reader]["rules"][rule]
    unless = entry.get("unless")
    if unless and struct in _release(release or shipped_releases()[-1]).declared[unless]:
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
