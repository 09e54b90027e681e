"""0.34.0's prompt, a 32-bit int ndarray (inline below 256 bytes, else in an aux frame), read into the same
token ids and prompt length as every older release's msgpack array, typed or not; and the frontend's release
found from what it writes, so that each side's frames are named with their writer's release."""

import struct

import msgspec
import pytest

from replay_proxy.store.rows import Rows
from replay_proxy.store.tables import written
from replay_proxy.wire.capture import CapturedFrame
from replay_proxy.wire.encode import encode, struct_value, token_ids
from replay_proxy.wire.messages import Channel, Direction, FrontendSource, Kind, WireDecoder
from replay_proxy.wire.registry import load_schema
from replay_proxy.wire.typed import typed_requests
from replay_proxy.wire.values import RAW_VIEW, Tensor, resolve_tensor
from replay_proxy.wire.values import token_ids as read_token_ids

TO_ENGINE = Direction.TO_ENGINE
REQUEST_COLUMNS = written("requests")


def add(release: str, tokens: list[int], dtype: str = "<i4", **more) -> list[bytes]:
    """An ADD as ``release``'s frontends send it (its prompt encoded as the release does)."""
    schema, aux = load_schema(release), []
    field = schema.structs["EngineCoreRequest"].by_name["prompt_token_ids"]
    body = struct_value(schema, "EngineCoreRequest", {
        "request_id": "cmpl-1", "prompt_token_ids": token_ids(field, tokens, aux, dtype), "mm_features": None,
        "sampling_params": struct_value(schema, "SamplingParams", {"max_tokens": 4}), "pooling_params": None,
        "arrival_time": 1.5, "lora_request": None, "cache_salt": None, "data_parallel_rank": None, **more})
    return [b"\x00", encode(body), *aux]


def request_row(parts: list[bytes], decoder: WireDecoder) -> dict:
    rows = Rows()
    rows.add(1, CapturedFrame(1, 1_000, Channel.INPUT, TO_ENGINE, 0, 0, parts), decoder)
    [row] = rows.tables["requests"]
    return dict(zip(REQUEST_COLUMNS, row)) | {"flagged": rows.flagged}


@pytest.mark.parametrize("length", [1, 63, 64, 300])
@pytest.mark.parametrize("dtype", ["<i4", "=u4"])  # the Python frontend's, vllm-rs's
def test_a_prompt_array_is_read_as_its_tokens_typed_or_not(length, dtype):
    schema, tokens = load_schema("0.34.0"), [(7 * i + 3) % 900 for i in range(length)]
    parts = add("0.34.0", tokens, dtype)
    assert len(parts) == (2 if 4 * length < 256 else 3)  # VLLM_MSGPACK_ZERO_COPY_THRESHOLD
    generic = WireDecoder(schema).decode(Channel.INPUT, TO_ENGINE, parts)
    assert (generic.kind, generic.flags, generic.error) == (Kind.ADD, (), None)
    assert typed_requests(schema).read(parts) == generic
    prompt = generic.fields["prompt_token_ids"]
    assert (prompt.dtype, prompt.shape, prompt.aux_frame) == (dtype, [length], None if len(parts) == 2 else 1)
    assert read_token_ids(prompt) == tokens
    row = request_row(parts, WireDecoder(schema))
    assert (row["prompt_len"], msgspec.json.decode(row["prompt_token_ids"])) == (length, tokens)


def test_an_older_release_prompt_makes_the_same_row():
    tokens = [5, 6, 7, 8]
    old, new = (request_row(add(r, tokens), WireDecoder(load_schema(r))) for r in ("0.33.0", "0.34.0"))
    assert (old["prompt_len"], old["prompt_token_ids"]) == (new["prompt_len"], new["prompt_token_ids"]) == (
        4, "[5,6,7,8]")


def test_a_prompt_array_of_any_byte_order_and_a_broken_one():
    data = struct.pack(">3i", 1, 2, 70000)
    assert resolve_tensor([">i4", [3], msgspec.msgpack.Ext(RAW_VIEW, data)], []).values == [1, 2, 70000]
    short = resolve_tensor(["<i4", [3], msgspec.msgpack.Ext(RAW_VIEW, data[:10])], [])
    assert short.values is None and "10 bytes" in short.error and read_token_ids(short) is None
    floats = resolve_tensor(["<f4", [1], msgspec.msgpack.Ext(RAW_VIEW, struct.pack("<f", 0.5))], [])
    assert floats.values == [0.5] and read_token_ids(floats) is None  # not token ids
    missing = WireDecoder(load_schema("0.34.0")).decode(Channel.INPUT, TO_ENGINE, add("0.34.0", list(range(80)))[:2])
    assert missing.fields["prompt_token_ids"].error == "aux frame 1 not in message of 1 frames"


def test_a_prompt_array_read_whole_however_long():
    tokens = list(range(5000))  # over the values kept of other tensors (logprobs)
    decoded = WireDecoder(load_schema("0.34.0")).decode(Channel.INPUT, TO_ENGINE, add("0.34.0", tokens))
    assert read_token_ids(decoded.fields["prompt_token_ids"]) == tokens


def test_each_releases_reader_flags_the_others_prompt():
    """What a 0.32.0 engine's decoder raises on (a numpy triple where ints belong), and what a 0.34.0 one does
    (ints where [dtype, shape, data] belongs), are flags, not a silent misreading."""
    old_reads_new = WireDecoder(load_schema("0.32.0"), fixed=True).decode(Channel.INPUT, TO_ENGINE,
                                                                           add("0.34.0", [1, 2, 3, 4], "=u4"))
    assert {(f.field, f.issue, f.got, f.path) for f in old_reads_new.flags} == {
        ("prompt_token_ids", "type_mismatch", "str", "$[1][0]"), (None, "extra_position", "nil", "$[22]")}
    new_reads_old = WireDecoder(load_schema("0.34.0"), fixed=True).decode(Channel.INPUT, TO_ENGINE,
                                                                           add("0.32.0", [1, 2, 3, 4]))
    assert [(f.field, f.issue, f.expected) for f in new_reads_old.flags] == [
        ("prompt_token_ids", "type_mismatch", "ndarray | None")]


@pytest.mark.parametrize("frontend, engines, found, source", [
    ("0.34.0", "0.32.0", "0.34.0", FrontendSource.NEWEST),  # a rolling upgrade: the frontend first
    ("0.32.0", "0.34.0", "0.33.0", FrontendSource.NEWEST),  # ... the engines first (0.33.0 reads as 0.32.0)
    ("0.32.0", "0.32.0", "0.32.0", FrontendSource.ENGINES),
    ("0.34.0", "0.34.0", "0.34.0", FrontendSource.ENGINES),
])
def test_the_frontends_release_is_found_from_its_first_add(frontend, engines, found, source):
    tokens = [9, 8, 7]
    decoder = WireDecoder(load_schema(engines))
    row = request_row(add(frontend, tokens), decoder)
    assert (decoder.frontend_release, decoder.frontend_source) == (found, source)
    assert (row["prompt_len"], row["prompt_token_ids"]) == (3, "[9,8,7]")  # read as written
    # What the engines' release does not read of it is drift, once, against the engines' schema.
    assert [(schema.release, {f.field for f in flags}) for _, _, flags, schema in row["flagged"]] == (
        [] if frontend == engines else [(engines, {"prompt_token_ids", None} if frontend > engines
                                         else {"prompt_token_ids"})])
    second = request_row(add(frontend, tokens), decoder)
    assert second["flagged"] == [] and decoder.frontend_release == found


def test_a_frontend_no_release_reads_is_said_and_named_with_the_engines_release():
    decoder = WireDecoder(load_schema("0.32.0"))
    row = request_row(add("0.32.0", [1, 2], session_id="s", unknown_field=1), decoder)
    assert (decoder.frontend_release, decoder.frontend_source) == (None, FrontendSource.UNREAD)
    [(_, _, flags, schema)] = row["flagged"]  # the ADD's own flag, against the engines' schema
    assert (schema.release, [f.issue for f in flags]) == ("0.32.0", ["extra_position"])


def test_a_given_frontend_release_is_used_as_given():
    decoder = WireDecoder(load_schema("0.32.0"), frontend_release="0.34.0")
    row = request_row(add("0.34.0", [4, 5]), decoder)
    assert (decoder.frontend_source, row["prompt_token_ids"], row["flagged"]) == (FrontendSource.GIVEN, "[4,5]", [])
    assert isinstance(decoder.decode(Channel.INPUT, TO_ENGINE, add("0.34.0", [4, 5])).fields["prompt_token_ids"],
                      Tensor)


@pytest.mark.parametrize("prompt, tokens", [
    (["<i4", [1], msgspec.msgpack.Ext(1, b"a pickle")], None),  # never unpickled: not a tensor, not tokens
    (["<i4", [2], 5], None),  # an aux frame the message lacks
    (["<i4", [1, 1], msgspec.msgpack.Ext(RAW_VIEW, b"\0" * 4)], None),  # two-dimensional: read, no token ids
    ([1, 2, 3], [1, 2, 3]),  # 0.33.0's form: flagged (a 0.34.0 engine refuses it), but token ids
])
def test_an_odd_prompt_array_is_named_alike_typed_or_not(prompt, tokens):
    schema = load_schema("0.34.0")
    value = msgspec.msgpack.decode(add("0.34.0", [1])[1])
    parts = [b"\x00", encode([value[0], prompt, *value[2:]])]
    generic = WireDecoder(schema, fixed=True).decode(Channel.INPUT, TO_ENGINE, parts)
    assert typed_requests(schema).read(parts) in (None, generic)  # (None: left to the generic path)
    assert read_token_ids(generic.fields["prompt_token_ids"]) == tokens
