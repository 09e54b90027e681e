"""A reader's rejection, named as the schema break it is.

When the peer under test cannot decode a message of the link, what it says (a log line, an HTTP error
body) is its decoder's complaint, not the change on the wire, and every request the message carried fails
after it: vllm-rs answers each completion with HTTP 500 ``messagepack decode failed for
vllm_engine_core_client::protocol::output::EngineCoreOutputs: array had incorrect length, expected 8``.
Reported as those failures, a replay says "11 requests failed", and a shrink or a CI job chases the
symptoms. Here the complaint is read with the recording's own schema into one breaking schema finding on
the struct, position and field it names (``reader_rejected``); the failures it caused are listed under it
as its consequences, not as findings of their own.

What a decoder says is data: ``rules.json``'s ``link_broke_patterns``, whose named groups give the struct
where the reader names it (vllm-rs does; msgspec does not: there it is the struct of a message the peer
was last sent). The complaint's own details (a length, a field, a path) are read by ``COMPLAINTS``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

import msgspec

from replay_proxy.compare.codes import Code
from replay_proxy.compare.findings import PYTHON_ENGINE, PYTHON_FRONTEND, RUST_FRONTEND, Finding, Severity
from replay_proxy.compare.rules import Rules
from replay_proxy.compare.schema import observed_shapes
from replay_proxy.store.session import Session
from replay_proxy.wire.messages import UTILITY_ARGUMENTS, Kind, Message, Side
from replay_proxy.wire.schema import Schema, StructSchema

# The struct a message of each kind is decoded as, for a reader that does not name it (msgspec); a utility
# call's arguments are converted to its method's structs (wire/messages.py: UTILITY_ARGUMENTS).
STRUCT_OF = {Kind.REGISTRATION: "EngineCoreReadyResponse", Kind.OUTPUTS: "EngineCoreOutputs",
             Kind.UTILITY_OUTPUT: "EngineCoreOutputs", Kind.ADD: "EngineCoreRequest"}
# What the two decoders say about what they could not read (rmp-serde through serde, and msgspec).
COMPLAINTS = (
    re.compile(r"array had incorrect length, expected (?P<expected>\d+)"),  # rmp-serde: a tuple struct's length
    re.compile(r"Expected `array` of length [<>]?=? ?(?P<expected>\d+)"),  # msgspec: an array_like struct's
    re.compile(r"missing (?:required )?field `(?P<field>\w+)`"),  # both: a required key or field absent
    re.compile(r" - at `\$(?P<path>[^`]*)`"),  # msgspec: where in the message
    re.compile(r", got `(?P<got>\w+)`"),  # msgspec: what it found there
)
# What msgspec calls a value it got, by the types of the fields that send such a value.
GOT = {"bool": ("bool",), "int": ("int",), "float": ("float",), "str": ("str",), "null": ("None",),
       "bytes": ("bytes",), "array": ("list[", "tuple[", "set["), "object": ("dict[",)}
FAILED = (Code.HTTP_FAILED, Code.REPLAY_FAILED)  # a replay's failures, whose messages quote what the peer said
REQUEST_FAILURES = (Code.HTTP_FAILED, Code.HTTP_RESPONSE_DIFFERS, Code.REQUEST_UNMATCHED)  # what a request's user got
# A complaint's variable parts (request ids, a value dump), dropped so that one rejection is one finding.
DETAIL = re.compile(r"; value fallback:.*|cmpl-[\w-]+|\"[^\"]{24,}\"")


def read_as(message: Message) -> str | None:
    """The struct a reader decodes ``message`` as (a utility call: its first argument's), if any."""
    if message.kind is Kind.UTILITY and isinstance(message.fields, dict):
        return next(iter(UTILITY_ARGUMENTS.get(str(message.fields.get("method")), ())), None)
    return STRUCT_OF.get(message.kind)


def reader_rejections(said: Iterable[str], schema: Schema, side: Side, rules: Rules,
                      last_sent: Sequence[str | None] = (), lengths: Mapping[str, int] = MappingProxyType({})
                      ) -> list[Finding]:
    """One breaking finding per distinct complaint in ``said`` (the peer under test's log lines and HTTP
    error bodies), read with ``schema``, the recording's release. ``last_sent``: the structs the last
    messages sent to the peer are read as (``read_as``), latest first, for a complaint that names no
    struct. ``lengths``: the longest array of each struct the peer was sent (``sent_lengths``), where it
    is known: what was on the wire, which a drifted peer's recording may not have laid out as its schema."""
    findings: dict[str, Finding] = {}
    for line in (line for text in said for line in text.splitlines()):
        for pattern in rules.link_broke_patterns:
            match = re.search(pattern, line)
            if match is None:
                continue
            complaint = line[match.start():].strip()
            key = DETAIL.sub("", complaint)
            if key not in findings:
                named = match.groupdict().get("struct")
                reader = RUST_FRONTEND if named else (PYTHON_FRONTEND if side is Side.FRONTEND else PYTHON_ENGINE)
                structs = [named] if named else [s for s in last_sent if s is not None]
                findings[key] = _finding(complaint, structs, schema, side, reader, lengths)
            break
    return list(findings.values())


def sent_lengths(session: Session) -> dict[str, int]:
    """The longest array of each struct ``session`` holds: what a replay of it sends."""
    return {struct: max(shape.lengths) for struct, shape in observed_shapes(session).items() if shape.lengths}


def _finding(complaint: str, structs: list[str], schema: Schema, side: Side, reader: str,
             lengths: Mapping[str, int]) -> Finding:
    """The finding for ``complaint`` about one of ``structs``: the one that has the field it names, else
    the first."""
    details = {k: v for c in COMPLAINTS if (m := c.search(complaint)) for k, v in m.groupdict().items()}
    field = details.get("field")
    known = [s for s in structs if s in schema.structs]
    struct = next((s for s in known if field in schema.structs[s].by_name), known[0] if known else None)
    position = None
    if struct and "path" in details:
        # Of the structs the peer was last sent, the one whose field there sends what msgspec says it got.
        walks = [_walk(schema, s, details["path"]) for s in dict.fromkeys(known)]
        struct, position, field = next((w for w in walks if _sends(schema, w, details.get("got"))), walks[0])
    elif struct and "expected" in details:
        struct, position, field = _by_length(schema, struct, int(details["expected"]), lengths)
    elif struct and field in schema.structs[struct].by_name:
        position = schema.structs[struct].by_name[field].position
    place = struct or "a message of the link"
    if position is not None:
        place += f" at position {position}" + (f" ({field})" if field else "")
    elif field:
        place += f" (field {field})"
    return Finding("schema", Severity.BREAKING, Code.READER_REJECTED,
                   f"the {side} under test could not decode {place} as {schema.release} sends it: "
                   f"{DETAIL.sub('', complaint)[:300]}",
                   struct=struct, field=field, position=position, candidate=complaint[:500], breaks=(reader,))


def _by_length(schema: Schema, named: str, expected: int, sent: Mapping[str, int]) -> tuple[str, int, str | None]:
    """rmp-serde names the message it was decoding, not the tuple struct inside it whose length it refused:
    that is the array-encoded struct, the named one or one nested in it, whose length as sent (else in
    ``schema``) is nearest the reader's ``expected`` (releases add or remove a field or two at a time)."""
    structs = [named, *_nested(schema, named)]
    lengths = {s: sent.get(s, len(schema.structs[s].fields)) for s in structs}
    struct = min((s for s in structs if lengths[s] != expected), key=lambda s: abs(lengths[s] - expected),
                 default=named)
    fields = schema.structs[struct].fields
    return struct, min(expected, lengths[struct]), fields[expected].name if expected < len(fields) else None


def _nested(schema: Schema, struct: str) -> list[str]:
    """The array-encoded structs inside ``struct``, breadth first."""
    seen, queue = [], [struct]
    while queue:
        for f in schema.structs[queue.pop(0)].fields:
            if f.struct in schema.structs and f.struct not in seen and f.struct != struct:
                seen.append(f.struct)
                queue.append(f.struct)
    return [s for s in seen if schema.structs[s].encoding == "array"]


def _sends(schema: Schema, walked: tuple[str, int | None, str | None], got: str | None) -> bool:
    """Whether the field ``walked`` reached sends a value of the kind msgspec says it ``got``."""
    struct, _, name = walked
    field = schema.structs[struct].by_name.get(name) if name else None
    if field is None or got is None:
        return False
    if field.struct in schema.structs and got in ("array", "object"):
        return (schema.structs[field.struct].encoding == "array") == (got == "array")
    return any(word in field.type for word in GOT.get(got, ()))


def _walk(schema: Schema, struct: str, path: str) -> tuple[str, int | None, str | None]:
    """msgspec's path (``[1][0][17]``, ``.block_size``) through ``struct``: the innermost struct, position
    and field it reaches. An index into a list of structs (``outputs[0]``) is passed over."""
    spec: StructSchema = schema.structs[struct]
    position = field = None
    steps = re.findall(r"\[(\d+)\]|\.(\w+)", path)
    i = 0
    while i < len(steps):
        index, key = steps[i]
        f = spec.fields[int(index)] if index and int(index) < len(spec.fields) else spec.by_name.get(key)
        if f is None:  # beyond the recorded fields: the position itself is the finding
            return struct, int(index) if index else None, key or None
        position, field = f.position, f.name
        i += 1
        if f.struct not in schema.structs:
            break  # what follows indexes into this field's value (0.34.0's prompt: [1][0], its dtype)
        if i < len(steps):
            if f.type.startswith(("list[", "tuple[", "set[")) and steps[i][0]:
                i += 1  # the item's index
            if i < len(steps):
                struct, spec, position, field = f.struct, schema.structs[f.struct], None, None
    return struct, position, field


def fold_consequences(findings: list[Finding], rules: Rules) -> list[Finding]:
    """``findings`` with the failures a reader's rejection explains moved under it: a failed replay or HTTP
    request whose message is a decoder's complaint (under the rejection it quotes), and every request's
    failure beside it (``REQUEST_FAILURES``, and what a request's outputs became: an engine whose input
    thread died on an ADD sends none): once a reader has refused a message of the link, what a request's
    user gets is no evidence of anything else (vllm-rs fails every request after the first, some with the
    complaint, some with an empty stream or none at all). With no rejection, ``findings`` as they are."""
    rejections = [f for f in findings if f.code is Code.READER_REJECTED]
    if not rejections:
        return findings
    under: dict[int, list[str]] = {id(r): [] for r in rejections}
    kept = []
    for f in findings:
        quotes = f.code in FAILED and rules.link_broke(f.message)
        of_a_request = f.code in REQUEST_FAILURES or f.category == "behaviour" and f.request_id is not None
        if quotes or of_a_request and f.severity >= Severity.REGRESSION:
            cause = next((r for r in rejections if DETAIL.sub("", r.candidate)[:80] in f.message), rejections[0])
            under[id(cause)].append(f"{f.code}" + (f" [{f.request_id}]" if f.request_id else "") + f": {f.message}")
        else:
            kept.append(f)
    return [msgspec.structs.replace(f, consequences=tuple(under[id(f)])) if id(f) in under else f for f in kept]
