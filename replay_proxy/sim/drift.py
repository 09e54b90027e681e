"""Drift knobs: the ways a sim peer can differ from the release it claims.

Each knob reproduces a break from vLLM's history:
a required registration key missing, a field inserted into a positional
struct, a trailing field that only the Rust reader rejects, a sampling-params key
renamed or added, a finish reason or token stream that changed.
"""

from __future__ import annotations

import msgspec

from replay_proxy.wire.schema import Field, Schema


class EngineDrift(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    drop_registration_key: str | None = None  # e.g. "block_size": a required key goes missing
    add_registration_key: str | None = None
    insert_output_field: int | None = None  # a new field at this position of EngineCoreOutput
    # A trailing EngineCoreOutputs field, as 0.32.0 appended weight_version: Python readers skip it, vllm-rs
    # rejects it (an extra element in each EngineCoreOutput, vllm-rs skips too: readers.json).
    append_outputs_field: bool = False
    appended_value: int | str = 0  # what that trailing field carries
    finish_reason: str | None = None  # report this finish reason instead of the true one
    token_offset: int = 0  # shift every generated token id
    die_after_requests: int | None = None  # send ENGINE_CORE_DEAD after this many ADDs
    die_on_logprobs_over: int | None = None  # ... on an ADD asking for more logprobs than this (a poisoned request)
    die_when_together: tuple[str, str] | None = None  # ... once these two requests run at once
    step_time_fraction: float = 0.0  # each engine step takes this fraction longer (0.1: +10%), a known slowdown
    # Every logprob it returns scaled by 1 + this (0.05: a numerics change that keeps each token and sharpens
    # every distribution), in outputs and in prompt logprobs alike.
    logprob_scale: float = 0.0


class FrontendDrift(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    insert_request_field: int | None = None  # a new field at this position of EngineCoreRequest
    rename_sampling_key: tuple[str, str] | None = None  # (old, new)
    add_sampling_key: str | None = None
    require_registration_key: str | None = None  # a newer frontend requires a key older engines do not send


def with_inserted_field(schema: Schema, struct: str, position: int | None) -> Schema:
    """The schema with a new int field inserted into ``struct`` at ``position``."""
    if position is None:
        return schema
    spec = schema.structs[struct]
    inserted = Field(name="sim_inserted", position=position, type="int", kinds=("int",),
                     required=False, default=0)
    fields = (*spec.fields[:position], inserted,
              *(msgspec.structs.replace(f, position=f.position + 1) for f in spec.fields[position:]))
    structs = {**schema.structs, struct: msgspec.structs.replace(spec, fields=fields)}
    return msgspec.structs.replace(schema, structs=structs)
