"""Drift between the two languages inside one release: Python's msgspec classes against vllm-rs's serde structs.

Each Rust struct is paired with the Python class it mirrors: by name (``Wire``
and ``EngineCore`` prefixes aside: ``WireEngineCoreOutputs`` is
``EngineCoreOutputs``, ``EngineCoreSamplingParams`` is ``SamplingParams``),
then through the fields of paired structs (a field's Python struct and its
Rust type name the pair below it). For each pair, every difference is judged
both ways, as each language's reader treats what the other writes:

* a key or trailing element only the writer has: msgspec ignores it; serde
  ignores a key unless ``deny_unknown_fields``, and rejects a longer array
  (serde_tuple) unless it is read through ``AllowTrailingFields``;
* one only the reader has: filled in where it has a default (Python) or is
  ``Option`` / ``#[serde(default)]`` (Rust), else rejected: a Python frontend
  rejects a registration without ``block_size`` that Rust encoded;
* an element at one position named otherwise on each side: misread;
* a value the reader is narrower for: a Python float as Rust's ``f32`` loses
  precision; a value of a Python enum that the Rust enum lacks is rejected,
  and a plain Python string that Rust reads as a closed enum (the
  registration's ``dtype``) is rejected outside that set.

A rejection is breaking whichever language writes: in production the frontend
writes requests and utility calls and the engine the registration and
outputs (the finding says which), but the other way round has real writers
too (vllm-rs's mock engine encodes registrations and outputs: vLLM PR 45557
found a Python frontend rejecting its registration without ``block_size``).
"""

from __future__ import annotations

import msgspec

from replay_proxy.compare.codes import Code
from replay_proxy.compare.findings import PYTHON_ENGINE, PYTHON_FRONTEND, RUST_FRONTEND, Finding, Severity
from replay_proxy.wire.rust import (ENGINE_ROOTS, FRONTEND_ROOTS, RustField, RustSchema, RustStruct, pair_structs,
                                    type_names)
from replay_proxy.wire.schema import Field, Schema

def drift_findings(python: Schema, rust: RustSchema, frontend_handled: frozenset[str] = frozenset()
                   ) -> list[Finding]:
    """Every difference between the paired structs, with its consequence on the wire (the module's docstring).
    ``frontend_handled``: SamplingParams keys whose work a frontend does itself; any other that only Python
    declares is a parameter a vllm-rs user cannot ask for (a warning)."""
    pairs = pair_structs(python, rust)
    writers = _writers(python)
    lenient = rust.read_with_trailing
    findings = []
    for name, rust_name in sorted(pairs.items()):
        py, rs = python.structs[name], rust.structs[rust_name]
        if rs.encoding == "transparent":
            continue
        if py.encoding != rs.encoding:
            findings.append(_finding(name, None, None, Code.ENCODING_DIFFERS, (
                f"{name} is a msgpack {py.encoding} in Python and a msgpack {rs.encoding} in Rust ({rs.file}: "
                f"{rust_name}): neither reads the other's"), {"python": True, "rust": True}, writers.get(name)))
            continue
        findings += _struct_drift(name, py.encoding, py.fields, rs, rust.wire_fields(rs), rust_name in lenient,
                                  writers.get(name))
        findings += _enum_drift(name, py.by_name, rs, rust, python, writers.get(name))
    return [_unaskable(f) if f.struct == "SamplingParams" and f.code is Code.ONLY_IN_PYTHON and f.severity is
            Severity.INFO and f.field not in frontend_handled and not (f.field or "").startswith("_") else f
            for f in findings]


def _enum_drift(name: str, py_fields: dict[str, Field], rs: RustStruct, rust: RustSchema, python: Schema,
                writer: str | None) -> list[Finding]:
    """Each field that is a closed enum in Rust, against what Python lets it hold: a value of Python's enum
    that Rust's lacks is rejected by the Rust reader (a finish reason vllm-rs cannot read); a plain Python
    string that Rust reads as a closed set is a rejection waiting for a value outside it."""
    findings = []
    for rf in rust.wire_fields(rs):
        py = py_fields.get(rf.name)
        enum = next((rust.enums[rust.wire_form(n)] for n in type_names(rf.type) if rust.wire_form(n) in rust.enums),
                    None)
        if py is None or enum is None or enum.untagged:
            continue
        python_enum = next((n for n in type_names(py.type.replace(" | ", "|").replace("|", " ")) if n in python.enums),
                           None)
        where = f"{name}.{rf.name}"
        if python_enum is not None:
            values = {str(v): k for k, v in python.enums[python_enum].items()}
            unreadable = [f"{values[v]} ({v})" for v in values if v not in enum.variants]
            if unreadable:
                findings.append(_finding(name, rf.name, rf.position, Code.ENUM_VALUE_ONLY_IN_PYTHON, (
                    f"{where}: Python's {python_enum} has {', '.join(unreadable)}, which Rust's {enum.name} "
                    f"({enum.file}) does not accept: the Rust reader rejects a message that carries it"),
                    {"python": False, "rust": True}, writer))
        elif set(py.kinds) <= {"str", "nil"} and not enum.repr:
            findings.append(Finding(
                "schema", Severity.WARNING if writer == "engine" else Severity.INFO, Code.CLOSED_ENUM_IN_RUST,
                f"{where} is any string in Python and one of {', '.join(enum.variants)} in Rust ({enum.file}: "
                f"{enum.name}): the Rust reader rejects a message with any other", struct=name, field=rf.name))
    return findings


def _unaskable(finding: Finding) -> Finding:
    """A sampling parameter only Python declares: the Rust frontend never sends it, so the engine applies its
    default for every vllm-rs request (vLLM PR 52703: routed_experts_prompt_start, to 0.28.0)."""
    return msgspec.structs.replace(
        finding, severity=Severity.WARNING, code=Code.SAMPLING_PARAM_ONLY_IN_PYTHON, message=(
        f"{finding.message}: a vllm-rs user cannot ask for SamplingParams.{finding.field}, and the engine applies "
        "its default to every request the Rust frontend sends"))


def _writers(python: Schema) -> dict[str, str]:
    """Python class -> who writes it on the link in production: ``frontend`` or ``engine``."""
    writers: dict[str, str] = {}
    for side, roots in (("frontend", FRONTEND_ROOTS), ("engine", ENGINE_ROOTS)):
        todo = [r for r in roots if r in python.structs]
        while todo:
            name = todo.pop()
            if name in writers:
                continue
            writers[name] = side
            todo += [f.struct for f in python.structs[name].fields if f.struct and f.struct in python.structs]
    return writers


def _struct_drift(name: str, encoding: str, py_fields: tuple[Field, ...], rs: RustStruct, rs_fields: list[RustField],
                  lenient: bool, writer: str | None) -> list[Finding]:
    findings = []
    if encoding == "array":  # positional: a name counts only where it moved (an element inserted or removed)
        rust_at = {f.name: i for i, f in enumerate(rs_fields)}
        for i, (py, rf) in enumerate(zip(py_fields, rs_fields)):
            if py.name != rf.name and (rust_at.get(py.name, i) != i or rf.name in {p.name for p in py_fields}):
                return [_finding(name, py.name, py.position, Code.POSITION_DIFFERS, (
                    f"{name} position {py.position} is {py.name} in Python and {rf.name} in Rust ({rs.file}): each "
                    "reads the other's value as its own field from there on"), {"python": True, "rust": True}, writer)]
        only_python, only_rust = list(py_fields[len(rs_fields):]), rs_fields[len(py_fields):]
    else:
        only_python = [f for f in py_fields if f.name not in {r.name for r in rs_fields}]
        only_rust = [f for f in rs_fields if f.name not in {p.name for p in py_fields}]
    # How each reader meets what only the other writes (an unknown key, a longer array) ...
    rust_extra = "rejects" if (rs.deny_unknown_fields or encoding == "array" and not lenient) else "ignores"
    python_extra = "ignores"  # msgspec: unknown keys and trailing elements past the last field (readers.json)
    for py in only_python:  # ... and what it leaves out: Python fills a field with a default, else rejects
        findings.append(_one_sided(name, py.name, py.position, "python", rs.file,
                                   missing="rejects" if py.required else f"fills it in (default {py.default!r})",
                                   extra=rust_extra, writer=writer))
    for rf in only_rust:  # Rust fills an Option or a #[serde(default)] field, else rejects
        findings.append(_one_sided(name, rf.name, rf.position, "rust", rs.file,
                                   missing="fills it in (its default)" if rf.optional or rf.default else "rejects",
                                   extra=python_extra, writer=writer))
    py_by_name = {f.name: f for f in py_fields}
    for rf in rs_fields:
        same = py_by_name.get(rf.name)
        if same is not None and same.type.split(" | ")[0] == "float" and "f32" in type_names(rf.type):
            findings.append(Finding(
                "schema", Severity.INFO, Code.FLOAT_NARROWED,
                f"{name}.{rf.name}: a Python float (64 bits) is an f32 in Rust ({rs.file}): what the Rust side "
                "writes carries float32 precision (0.7 arrives as 0.699999988079071)", struct=name, field=rf.name))
    return findings


def _one_sided(struct: str, field: str, position: int, only: str, file: str, missing: str, extra: str,
               writer: str | None) -> Finding:
    """A field only one language declares. ``missing``: what that language's reader does when the other side's
    message lacks it; ``extra``: what the other language's reader does when this side's message carries it."""
    other = "rust" if only == "python" else "python"
    rejects = {only: missing == "rejects", other: extra == "rejects"}

    def said(verdict: str) -> str:
        return "rejects the message" if verdict == "rejects" else verdict

    message = (f"{struct}.{field} (position {position}) only in {only.capitalize()} ({file}): from a "
               f"{other.capitalize()} writer it is missing, and the {only.capitalize()} reader {said(missing)}; from a "
               f"{only.capitalize()} writer the {other.capitalize()} reader "
               f"{said(extra).replace('ignores', 'ignores it')}")
    return _finding(struct, field, position, Code(f"only_in_{only}"), message, rejects, writer)


def _finding(struct: str, field: str | None, position: int | None, code: Code, message: str,
             rejects: dict[str, bool], writer: str | None) -> Finding:
    """Breaking where a reader rejects it, whichever language writes (the other way round from production is a
    real writer too: vllm-rs's mock engine, test peers, tools); else information."""
    readers = {"python": PYTHON_FRONTEND if writer == "engine" else PYTHON_ENGINE, "rust": RUST_FRONTEND}
    breaks = tuple(readers[side] for side, rejected in rejects.items() if rejected)
    severity = Severity.BREAKING if breaks else Severity.INFO
    where = {"engine": "on the link the engine writes it", "frontend": "on the link the frontend writes it"}
    return Finding("schema", severity, code, message + (f" ({where[writer]})" if writer in where else ""),
                   struct=struct, field=field, position=position, breaks=breaks)
