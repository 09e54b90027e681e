"""Breaking-change analysis between two release schemas (``buf breaking`` for msgspec structs).

Which reader a change breaks is the readers' rules' (``readers.json``): for
example msgspec skips extra trailing array elements while vLLM's Rust
frontend (rmp-serde + serde_tuple) rejects them in most structs and
releases, and Python always sends arrays at full length. Each finding says which decoder breaks in a mixed
deployment: the struct's reader of one release with its writer of the other.
"""

from __future__ import annotations

from replay_proxy.compare.codes import Code
from replay_proxy.compare.findings import PYTHON_ENGINE, PYTHON_FRONTEND, RUST_FRONTEND, Finding, Severity
from replay_proxy.compare.readers import how_they_read, rejecting, requiring
from replay_proxy.wire.schema import Field, Parameter, Schema, StructSchema

# Roots of what the frontend sends; everything else travels engine -> frontend.
TO_ENGINE_ROOTS = ("EngineCoreRequest", "EngineHandshakeMetadata")


def readers(schema: Schema, struct: str) -> tuple[str, ...]:
    """The decoders that read ``struct``: the engine, or the two kinds of frontend."""
    to_engine = set()
    stack = list(TO_ENGINE_ROOTS)
    while stack:
        name = stack.pop()
        if name in to_engine or name not in schema.structs:
            continue
        to_engine.add(name)
        stack.extend(f.struct for f in schema.structs[name].fields if f.struct)
    return (PYTHON_ENGINE,) if struct in to_engine else (PYTHON_FRONTEND, RUST_FRONTEND)


def diff_schemas(old: Schema, new: Schema) -> list[Finding]:
    """Every change from release ``old`` to release ``new`` that a decoder could notice."""
    findings: list[Finding] = []
    for name in sorted(set(old.structs) | set(new.structs)):
        if name not in new.structs or name not in old.structs:
            findings.append(Finding(
                "schema", Severity.INFO, Code.STRUCT_REMOVED if name in old.structs else Code.STRUCT_ADDED,
                f"{name} {'no longer exists' if name in old.structs else 'is new'} in {new.release}",
                struct=name))
            continue
        a, b = old.structs[name], new.structs[name]
        who = readers(new, name)
        if a.encoding != b.encoding:
            findings.append(Finding("schema", Severity.BREAKING, Code.ENCODING_CHANGED,
                                    f"{name} changed from {a.encoding} to {b.encoding}", struct=name,
                                    baseline=a.encoding, candidate=b.encoding, breaks=who))
        elif a.encoding == "array":
            findings += _array_changes(name, a, b, who, old.release, new.release)
        else:
            findings += _map_changes(name, a, b, who, old.release, new.release)
    for enum_name in sorted(set(old.enums) & set(new.enums)):
        added = {k: v for k, v in new.enums[enum_name].items() if k not in old.enums[enum_name]}
        removed = {k: v for k, v in old.enums[enum_name].items() if k not in new.enums[enum_name]}
        for label, values, severity in (("added", added, Severity.WARNING), ("removed", removed, Severity.WARNING)):
            for key, value in values.items():
                findings.append(Finding("schema", severity, Code(f"enum_value_{label}"),
                                        f"{enum_name}.{key} ({value!r}) {label} in {new.release}",
                                        struct=enum_name, field=key, candidate=value if label == "added" else None,
                                        baseline=value if label == "removed" else None))
    findings += _ext_type_changes(old, new)
    findings += _utility_changes(old, new)
    return findings


def _ext_type_changes(old: Schema, new: Schema) -> list[Finding]:
    findings = []
    for name in sorted(set(old.ext_types) | set(new.ext_types)):
        a, b = old.ext_types.get(name), new.ext_types.get(name)
        if a != b:
            renumbered = a is not None and b is not None  # else only added or removed: a warning
            findings.append(Finding("schema", Severity.BREAKING if renumbered else Severity.WARNING,
                                    Code.EXT_TYPE_CHANGED,
                                    f"msgpack extension {name}: code {a} -> {b} in {new.release}",
                                    struct="ext_types", field=name, baseline=a, candidate=b,
                                    breaks=(PYTHON_ENGINE, PYTHON_FRONTEND, RUST_FRONTEND) if renumbered else ()))
    return findings


def _utility_changes(old: Schema, new: Schema) -> list[Finding]:
    """A UTILITY request calls ``method(*args)`` on the engine: what a frontend of one release sends
    that the engine of the other cannot take."""
    if old.utility_methods is None or new.utility_methods is None:
        return []
    findings = []
    for method in sorted(set(old.utility_methods) | set(new.utility_methods)):
        a, b = old.utility_methods.get(method), new.utility_methods.get(method)
        if a is None or b is None:
            findings.append(Finding(
                "schema", Severity.WARNING, Code.UTILITY_METHOD_ADDED if a is None else Code.UTILITY_METHOD_REMOVED,
                f"utility {method} {'is new in' if a is None else 'no longer exists in'} {new.release}: a "
                f"{(old if a is None else new).release} engine answers a call to it with a failure",
                struct="utility_methods", field=method, baseline=_signature(a), candidate=_signature(b)))
            continue
        positional_a = [p for p in a if p.kind in ("positional_only", "positional_or_keyword")]
        positional_b = [p for p in b if p.kind in ("positional_only", "positional_or_keyword")]

        def takes_any(ps: list[Parameter] | tuple[Parameter, ...]) -> bool:
            return any(p.kind == "var_positional" for p in ps)

        required_a, required_b = sum(p.required for p in positional_a), sum(p.required for p in positional_b)
        problems = []
        if required_b > required_a:  # an older frontend sends fewer arguments than the newer engine needs
            problems.append(f"needs {required_b} positional arguments, {old.release} callers send {required_a}+")
        if len(positional_b) < len(positional_a) and not takes_any(b):
            problems.append(f"takes at most {len(positional_b)} positional arguments, {old.release} callers may "
                            f"send {len(positional_a)}")
        if len(positional_a) < len(positional_b) and not takes_any(a):
            problems.append(f"{new.release} callers may send {len(positional_b)} positional arguments, a "
                            f"{old.release} engine takes {len(positional_a)}")
        renamed = [(p.name, q.name) for p, q in zip(positional_a, positional_b) if p.name != q.name]
        if problems:
            findings.append(Finding("schema", Severity.BREAKING, Code.UTILITY_SIGNATURE_CHANGED,
                                    f"utility {method}({_signature(a)}) -> ({_signature(b)}): {'; '.join(problems)}",
                                    struct="utility_methods", field=method, baseline=_signature(a),
                                    candidate=_signature(b), breaks=(PYTHON_ENGINE,)))
        elif a != b:
            findings.append(Finding("schema", Severity.INFO, Code.UTILITY_SIGNATURE_CHANGED,
                                    f"utility {method}({_signature(a)}) -> ({_signature(b)})"
                                    + (f": parameters renamed {renamed}" if renamed else ""),
                                    struct="utility_methods", field=method, baseline=_signature(a),
                                    candidate=_signature(b)))
    return findings


def _signature(parameters: tuple[Parameter, ...] | None) -> str | None:
    if parameters is None:
        return None
    marks = {"var_positional": "*", "var_keyword": "**"}
    return ", ".join(f"{marks.get(p.kind, '')}{p.name}{'' if p.required or p.kind in marks else '=...'}"
                     for p in parameters)


def _array_changes(name: str, a: StructSchema, b: StructSchema, who: tuple[str, ...],
                   old: str, new: str) -> list[Finding]:
    old_names = [f.name for f in a.fields]
    new_names = [f.name for f in b.fields]
    findings = []
    common = 0
    while common < min(len(old_names), len(new_names)) and old_names[common] == new_names[common]:
        common += 1
    for field_a, field_b in zip(a.fields[:common], b.fields[:common]):
        findings += _type_change(name, field_a, field_b, who, old, new, field_b.position)
    old_rest, new_rest = old_names[common:], new_names[common:]
    if not old_rest:  # pure append
        for field in b.fields[common:]:
            # New readers that require it (of older writers' messages), old readers that reject the extra element
            breaks = _union(requiring(who, name, field.name, new), rejecting(who, "extra_trailing_elements", name, old))
            severity = Severity.BREAKING if breaks else Severity.INFO
            why = ("required: older writers cannot send it" if field.required else
                   f"{new} writers send it; of {old}'s readers, "
                   f"{how_they_read(who, 'extra_trailing_elements', name, old)}")
            findings.append(Finding("schema", severity, Code.FIELD_APPENDED,
                                    f"{name}.{field.name} appended at position {field.position} ({why})",
                                    struct=name, field=field.name, position=field.position,
                                    candidate=field.type, breaks=breaks))
        return findings
    if not new_rest:  # pure removal from the end
        for field in a.fields[common:]:
            breaks = requiring(who, name, field.name, old) if field.required else ()
            findings.append(Finding("schema", Severity.BREAKING if breaks else Severity.WARNING,
                                    Code.TRAILING_FIELD_REMOVED,
                                    f"{name}.{field.name} (position {field.position}) removed in {new}",
                                    struct=name, field=field.name, position=field.position,
                                    baseline=field.type, breaks=breaks))
        return findings
    # Something in the middle moved: every later position means something else now.
    first = common
    inserted = [n for n in new_rest if n not in old_rest]
    removed = [n for n in old_rest if n not in new_rest]
    if new_rest[0] in inserted:
        code, what = Code.FIELD_INSERTED, f"{new_rest[0]} inserted at position {first}"
    elif old_rest[0] in removed:
        code, what = Code.FIELD_REMOVED, f"{old_rest[0]} removed from position {first}"
    else:
        code, what = Code.FIELDS_REORDERED, f"fields reordered from position {first}"
    shifted = [n for n in old_rest if n in new_rest and old_names.index(n) != new_names.index(n)]
    findings.append(Finding(
        "schema", Severity.BREAKING, code,
        f"{name}: {what}; {len(shifted)} later field(s) change position "
        f"({', '.join(f'{n} {old_names.index(n)}->{new_names.index(n)}' for n in shifted[:4])}"
        f"{', ...' if len(shifted) > 4 else ''}): a reader of one release misreads the other's messages",
        struct=name, field=new_rest[0] if code is Code.FIELD_INSERTED else old_rest[0], position=first,
        baseline=old_names[first:], candidate=new_names[first:], breaks=who))
    return findings


def _map_changes(name: str, a: StructSchema, b: StructSchema, who: tuple[str, ...],
                 old: str, new: str) -> list[Finding]:
    findings = []
    directions = (  # (code, where the key is, where it is not, why if required, why if optional, side)
        (Code.KEY_ADDED, b, a, f"required: {new} readers reject {old} messages without it",
         f"{old} readers ignore it: what it controls is silently not applied by an {old} peer", "candidate"),
        (Code.KEY_REMOVED, a, b, f"required by {old} readers, which reject {new} messages",
         f"{new} readers ignore it when an {old} peer sends it", "baseline"),
    )
    for code, present, absent, if_required, if_optional, side in directions:
        requiring_release = new if present is b else old
        for key in [f for f in present.fields if f.name not in absent.by_name]:
            breaks = tuple(r for r in requiring(who, name, key.name, requiring_release)
                           if r in rejecting(who, "missing_required_key")) if key.required else ()
            findings.append(Finding(
                "schema", Severity.BREAKING if breaks else Severity.INFO, code,
                f"{name}.{key.name} {code.removeprefix('key_')} ({if_required if key.required else if_optional})"
                + _only(who, breaks),
                struct=name, field=key.name, breaks=breaks, baseline=key.type if side == "baseline" else None,
                candidate=key.type if side == "candidate" else None))
    for field_a in a.fields:
        field_b = b.by_name.get(field_a.name)
        if field_b is not None:  # map fields have no position on the wire
            findings += _type_change(name, field_a, field_b, who, old, new, None)
    return findings


def _union(*groups: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(r for group in groups for r in group))


def _only(who: tuple[str, ...], breaks: tuple[str, ...]) -> str:
    """Where a reader's own layout does not require what its release's Python class does (vllm-rs declaring
    an Option), the finding says who is spared."""
    spared = [r for r in who if r not in breaks]
    return f"; {' and '.join(spared)} {'does' if len(spared) == 1 else 'do'} not require it" if spared and breaks \
        else ""


def _type_change(name: str, a: Field, b: Field, who: tuple[str, ...], old: str, new: str,
                 position: int | None) -> list[Finding]:
    findings = []
    if a.required != b.required:
        if b.required:
            breaks = requiring(who, name, b.name, new)
            findings.append(Finding("schema", Severity.BREAKING if breaks else Severity.INFO, Code.BECAME_REQUIRED,
                                    f"{name}.{a.name} became required in {new}" + _only(who, breaks), struct=name,
                                    field=a.name, position=position, breaks=breaks))
        else:
            findings.append(Finding("schema", Severity.INFO, Code.BECAME_OPTIONAL,
                                    f"{name}.{a.name} became optional in {new}", struct=name, field=a.name,
                                    position=position))
    if set(a.kinds) != set(b.kinds):
        widened = set(a.kinds) <= set(b.kinds)
        findings.append(Finding(
            "schema", Severity.BREAKING, Code.TYPE_CHANGED,
            f"{name}.{a.name} changed type {a.type} -> {b.type}"
            + (f" (widened: {old} readers reject the new {sorted(set(b.kinds) - set(a.kinds))} values)"
               if widened else ""),
            struct=name, field=a.name, position=position, baseline=a.type, candidate=b.type,
            breaks=rejecting(who, "changed_type")))
    elif a.type != b.type:
        findings.append(Finding("schema", Severity.INFO, Code.TYPE_RENAMED,
                                f"{name}.{a.name} type {a.type} -> {b.type} (same wire kinds)",
                                struct=name, field=a.name, position=position, baseline=a.type, candidate=b.type))
    # A nested struct's default changes whenever that struct does; that is reported on the struct.
    if a.default != b.default and not a.required and not b.required and not b.struct:
        findings.append(Finding("schema", Severity.WARNING, Code.DEFAULT_CHANGED,
                                f"{name}.{a.name} default {a.default!r} -> {b.default!r}: omitted values "
                                f"mean different things to the two releases",
                                struct=name, field=a.name, position=position, baseline=a.default,
                                candidate=b.default))
    return findings
