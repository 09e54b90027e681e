"""Schema findings of two sessions: the registration, array shapes on the wire, finish reasons.

What a struct looked like is observed from the raw frames, not from the
schema the recorder named them with: an inserted or removed positional field
shows as a shift of the kinds seen at each position, a longer array as new
trailing positions (which readers reject or skip: ``readers.json`` says). A
missing key or element breaks the readers whose own layout of the baseline's
release requires it: vllm-rs as its Rust struct declares it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import msgspec

from replay_proxy.compare.codes import Code
from replay_proxy.compare.findings import PYTHON_FRONTEND, RUST_FRONTEND, Finding, Severity
from replay_proxy.compare.readers import how_they_read, rejecting, requiring
from replay_proxy.compare.rules import Rules
from replay_proxy.compare.schema_diff import readers
from replay_proxy.store.session import Session
from replay_proxy.wire.messages import Kind
from replay_proxy.wire.schema import Schema
from replay_proxy.wire.values import decode_msgpack, kind_of


class Shape(msgspec.Struct):
    """What a positional struct looked like on the wire across a session."""

    lengths: set[int] = set()
    kinds: dict[int, set[str]] = {}  # position -> msgpack kinds seen there, nil included


Shapes = dict[str, Shape]


def observed_shapes(session: Session) -> Shapes:
    """The shapes of EngineCoreRequest (ADD), EngineCoreOutputs, EngineCoreOutput and UtilityOutput."""
    shapes: Shapes = defaultdict(Shape)
    for frame in session.inputs + session.outputs:
        if frame.kind in (Kind.ADD, Kind.OUTPUTS, Kind.UTILITY_OUTPUT):
            body = frame.parts[1] if frame.kind is Kind.ADD else frame.parts[0]  # ADD: after its request type
            _observe_shapes(shapes, frame.kind, decode_msgpack(body), session.schema)
    return dict(shapes)


def _observe(shapes: Shapes, struct: str, value: Any) -> None:
    if not isinstance(value, list):
        return
    shape = shapes[struct]
    shape.lengths.add(len(value))
    for position, item in enumerate(value):
        shape.kinds.setdefault(position, set()).add(kind_of(item))


def _observe_shapes(shapes: Shapes, kind: Kind, body: Any, schema: Schema) -> None:
    if kind is Kind.ADD:
        _observe(shapes, "EngineCoreRequest", body)
        return
    _observe(shapes, "EngineCoreOutputs", body)
    if isinstance(body, list):
        outputs, utility = (schema.position("EngineCoreOutputs", f) for f in ("outputs", "utility_output"))
        for output in body[outputs] if len(body) > outputs and isinstance(body[outputs], list) else []:
            _observe(shapes, "EngineCoreOutput", output)
        if len(body) > utility:
            _observe(shapes, "UtilityOutput", body[utility])


def schema_findings(baseline: Session, candidate: Session, shapes: tuple[Shapes, Shapes],
                    rules: Rules) -> list[Finding]:
    """The registration's keys and values, array shapes as seen on the wire, unknown finish reasons."""
    findings = []
    keys_a, keys_b = (set().union(*s.registrations) for s in (baseline, candidate))
    if keys_a:
        release = baseline.schema.release
        for key in sorted(keys_a - keys_b):
            # Each frontend of the baseline's release as its own layout declares the key (vllm-rs: its Rust struct)
            breaks = tuple(r for r in requiring((PYTHON_FRONTEND, RUST_FRONTEND), "EngineCoreReadyResponse", key,
                                                release) if r in rejecting((r,), "missing_required_key"))
            findings.append(Finding(
                "schema", Severity.BREAKING if breaks else Severity.WARNING, Code.REGISTRATION_KEY_MISSING,
                f"the registration lacks {key!r}" + (f", which a {release} {' and a '.join(breaks)} "
                                                     f"require{'s' if len(breaks) == 1 else ''} "
                                                     f"(\"missing required field `{key}`\")" if breaks else ""),
                message_kind="REGISTRATION", struct="EngineCoreReadyResponse", field=key, breaks=breaks))
        for key in sorted(keys_b - keys_a):
            findings.append(Finding("schema", Severity.INFO, Code.REGISTRATION_KEY_ADDED,
                                    f"the registration has a new key {key!r} (frontends ignore unknown keys)",
                                    message_kind="REGISTRATION", struct="EngineCoreReadyResponse", field=key))
        ignored = set(rules.ignore_registration_keys)
        for key in sorted(keys_a & keys_b - ignored):
            a, b = baseline.registrations[0].get(key), candidate.registrations[0].get(key)
            if a != b:
                findings.append(Finding("schema", Severity.WARNING, Code.REGISTRATION_VALUE_CHANGED,
                                        f"registration {key}: {a!r} -> {b!r}", message_kind="REGISTRATION",
                                        struct="EngineCoreReadyResponse", field=key, baseline=a, candidate=b))
    for struct in ("EngineCoreRequest", "EngineCoreOutputs", "EngineCoreOutput", "UtilityOutput"):
        if struct in shapes[0] and struct in shapes[1]:
            findings += _shape_findings(struct, baseline.schema, candidate.schema, shapes[0][struct], shapes[1][struct])
    finish_names = {k.lower() for k in baseline.schema.enums.get("FinishReason", {})}
    for reason in sorted(candidate.finish_reasons - finish_names):
        findings.append(Finding("schema", Severity.BREAKING, Code.FINISH_REASON_UNKNOWN,
                                f"finish reason {reason!r} is not one that {baseline.schema.release} knows",
                                message_kind="OUTPUTS", struct="FinishReason", candidate=reason,
                                breaks=(PYTHON_FRONTEND, RUST_FRONTEND)))
    return findings


def _alignment(a: Shape, b: Shape, at: int, shift: int) -> list[tuple[int, int]]:
    """Position pairs (baseline, candidate) if ``shift`` elements were inserted (or removed) at ``at``."""
    length_a, length_b = max(a.lengths), max(b.lengths)
    pairs = []
    for p in range(length_a):
        q = p if p < at else p + shift
        if 0 <= q < length_b and (shift >= 0 or p < at or p >= at - shift):
            pairs.append((p, q))
    return pairs


def _shape_findings(struct: str, schema_a: Schema, schema_b: Schema, a: Shape, b: Shape) -> list[Finding]:
    """Array drift between two sessions' observed shapes of ``struct``.

    Every way of lining the two up is tried: elements inserted (or removed)
    at each position, or at the end. The one under which the most positions
    saw exactly the same kinds (nil included: a field that is sometimes nil
    has a pattern of its own) wins; ties go to the simpler "at the end".
    """
    names_a = [f.name for f in schema_a.structs[struct].fields]
    names_b = [f.name for f in schema_b.structs[struct].fields]

    def name_a(p: int) -> str:
        return names_a[p] if p < len(names_a) else f"${p}"

    def name_b(p: int) -> str:
        return names_b[p] if p < len(names_b) else f"${p}"

    who = readers(schema_a, struct)
    length_a, length_b = max(a.lengths), max(b.lengths)
    shift = length_b - length_a
    end = min(length_a, length_b)

    def score(at: int) -> int:
        return sum(a.kinds.get(p) == b.kinds.get(q) for p, q in _alignment(a, b, at, shift))

    at = max(range(end + 1), key=lambda i: (score(i), i)) if shift else end
    findings = []
    if at < end:
        moved = "inserted" if shift > 0 else "removed"
        findings.append(Finding(
            "schema", Severity.BREAKING, Code(f"field_{moved}"),
            f"{struct}: {abs(shift)} element(s) {moved} at position {at}; {name_a(at)} and every later field "
            f"moved {shift:+d}: a reader of one build misreads the other's messages",
            struct=struct, field=name_a(at), position=at, baseline=length_a, candidate=length_b, breaks=who))
    for p, q in _alignment(a, b, at, shift):
        kinds_a, kinds_b = a.kinds.get(p, set()) - {"nil"}, b.kinds.get(q, set()) - {"nil"}
        if kinds_a and kinds_b and not kinds_a & kinds_b:
            findings.append(Finding(
                "schema", Severity.BREAKING, Code.POSITION_TYPE_CHANGED,
                f"{struct} position {p} ({name_a(p)}) held {sorted(kinds_a)}, now {sorted(kinds_b)}",
                struct=struct, field=name_a(p), position=p, baseline=sorted(kinds_a), candidate=sorted(kinds_b),
                breaks=who))
    if at == end and shift > 0:
        breaks = rejecting(who, "extra_trailing_elements", struct, schema_a.release)
        findings.append(Finding(
            "schema", Severity.BREAKING if breaks else Severity.INFO, Code.ARRAY_LONGER,
            f"{struct} arrays grew from {length_a} to {length_b} elements (new: "
            f"{', '.join(name_b(p) for p in range(length_a, length_b))}); "
            f"{how_they_read(who, 'extra_trailing_elements', struct, schema_a.release)}",
            struct=struct, position=length_a, baseline=length_a, candidate=length_b, breaks=breaks))
    elif at == end and shift < 0:
        missing = [f.name for f in schema_a.structs[struct].fields[length_b:length_a]]
        # Each reader as its own layout declares them (vllm-rs: its Rust struct)
        breaks = tuple(r for r in who if any(requiring((r,), struct, name, schema_a.release) for name in missing))
        required = [n for n in missing if schema_a.structs[struct].by_name[n].required]
        findings.append(Finding(
            "schema", Severity.BREAKING if breaks else Severity.INFO, Code.ARRAY_SHORTER,
            f"{struct} arrays shrank from {length_a} to {length_b} elements (missing: "
            f"{', '.join(name_a(p) for p in range(length_b, length_a))})"
            + (f"; {', '.join(required)} required by {' and '.join(breaks)}" if breaks else
               "; readers fill in defaults"),
            struct=struct, position=length_b, baseline=length_a, candidate=length_b, breaks=breaks))
    return findings
