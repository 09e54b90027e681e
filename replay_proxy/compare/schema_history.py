"""A struct's fields across every shipped release: when each appeared, when it went, how it moved.

``schema diff`` answers "what breaks between these two releases"; this
answers "since when, and until when", the question behind a compatibility
range: a field that appeared in one release and moved in another.
"""

from __future__ import annotations

from typing import Any

import msgspec

from replay_proxy.wire.schema import Field, Schema


class FieldChange(msgspec.Struct, frozen=True):
    release: str  # the first release with the new value
    what: str  # "position", "type", "required", "default", "removed", "added again"
    before: object
    after: object


class FieldHistory(msgspec.Struct, frozen=True):
    struct: str
    field: str
    first: str  # the first shipped release that has it
    last: str  # the last one that has it
    position: int | None  # in the last release that has it (None: a map key)
    type: str  # likewise
    changes: tuple[FieldChange, ...]


def _facts(field: Field, array: bool) -> dict[str, object]:
    return {"position": field.position if array else None, "type": field.type, "required": field.required,
            "default": field.default}


def struct_history(schemas: list[Schema], struct: str, field: str | None = None) -> list[FieldHistory]:
    """Every field of ``struct`` (or only ``field``) over ``schemas``, oldest first; in order of first
    appearance, then position."""
    having = [s for s in schemas if struct in s.structs]
    if not having:
        raise KeyError(struct)
    seen: dict[str, dict[str, Any]] = {}  # field -> first, last, facts, changes, still present
    order: list[str] = []
    for schema in having:
        spec = schema.structs[struct]
        array = spec.encoding == "array"
        for f in spec.fields:
            facts = _facts(f, array)
            state = seen.get(f.name)
            if state is None:
                seen[f.name] = {"first": schema.release, "last": schema.release, "facts": facts, "changes": [],
                                "present": True}
                order.append(f.name)
                continue
            if not state["present"]:
                state["changes"].append(FieldChange(schema.release, "added again", None, facts["type"]))
            for what, value in facts.items():
                if value != state["facts"][what]:
                    state["changes"].append(FieldChange(schema.release, what, state["facts"][what], value))
            state.update(last=schema.release, facts=facts, present=True)
        for name, state in seen.items():
            if state["present"] and name not in spec.by_name:
                state["changes"].append(FieldChange(schema.release, "removed", state["facts"]["type"], None))
                state["present"] = False
    if field is not None:
        if field not in seen:
            raise KeyError(f"{struct}.{field}")
        order = [field]
    return [FieldHistory(struct, name, seen[name]["first"], seen[name]["last"], seen[name]["facts"]["position"],
                         seen[name]["facts"]["type"], tuple(seen[name]["changes"])) for name in order]
