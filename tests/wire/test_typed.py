"""The typed fast path gives exactly the rows of the generic decoder, and only reads what conforms.

Frames: every EngineCoreOutputs and every request (ADD, ABORT, UTILITY) of
the real 0.32.0 recordings (made with our recorder: plain, LoRA, pooling,
structured outputs and prompt embeds, fan-out), then hypothesis variations
of a conforming one (a position more or less, another kind in a field,
logprobs, events, nested structs, tensors), each decoded both ways.
"""

import contextlib
import sqlite3
from pathlib import Path

import msgspec

from hypothesis import given, settings
from hypothesis import strategies as st

from replay_proxy.store.raw import frames_with_bytes
from replay_proxy.store.rows import Rows
from replay_proxy.wire.capture import CapturedFrame
from replay_proxy.wire.encode import encode, struct_value
from replay_proxy.wire.messages import Channel, Direction, WireDecoder
from replay_proxy.wire.registry import load_schema
from replay_proxy.wire.typed import typed_outputs, typed_requests
from replay_proxy.wire.values import Tensor

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = load_schema("0.32.0")


def both_ways(parts: list[bytes], channel: Channel = Channel.OUTPUT,
              direction: Direction = Direction.TO_FRONTEND) -> tuple[dict, dict]:
    """The rows of one frame by ``Rows.add`` (fast where it can) and by the generic decoder only."""
    frame = CapturedFrame(7, 1_000, channel, direction, 0, 0, parts)
    fast, generic = Rows(), Rows()
    fast.add(1, frame, WireDecoder(SCHEMA))
    decoder = WireDecoder(SCHEMA)
    generic.add_frame(1, frame, decoder.decode(frame.channel, frame.direction, parts), SCHEMA)
    return dict(fast.tables), dict(generic.tables)


def recorded_frames(where: str) -> list[list[bytes]]:
    frames = []
    for path in sorted((ROOT / "recordings").glob("vllm-0.32.0-*.db")):
        with contextlib.closing(sqlite3.connect(path)) as connection:
            frames += [row["parts"] for row in frames_with_bytes(connection, where)]
    return frames


def recorded_output_frames() -> list[list[bytes]]:
    return recorded_frames("kind IN ('OUTPUTS', 'UTILITY_OUTPUT')")


def test_real_engine_frames_are_read_typed_with_the_same_rows():
    frames = recorded_output_frames()
    typed = 0
    for parts in frames:
        fast, generic = both_ways(parts)
        assert fast == generic
        typed += typed_outputs(SCHEMA).read(parts) is not None
    # The first output of a request carries events (log stats on) and goes the generic way; most do not.
    assert len(frames) > 40 and typed > len(frames) // 2


def conforming(outputs: int = 2) -> list:
    return struct_value(SCHEMA, "EngineCoreOutputs", {
        "engine_index": 0, "timestamp": 12.5, "scheduler_stats": struct_value(SCHEMA, "SchedulerStats", {}),
        "outputs": [struct_value(SCHEMA, "EngineCoreOutput", {"request_id": f"r{k}", "new_token_ids": [k, 7]})
                    for k in range(outputs)]})


def test_a_conforming_frame_is_read_typed_and_a_drifted_one_is_not():
    body = conforming()
    assert typed_outputs(SCHEMA).read([encode(body)]) is not None
    longer = [*body, None]  # a position more (what the Rust reader rejects)
    shorter = body[:-1]  # a 0.31.0 engine's 8 positions
    output_longer = [*body[:1], [body[1][0] + [0]], *body[2:]]
    assert [typed_outputs(SCHEMA).read([encode(b)]) for b in (longer, shorter, output_longer)] == [None] * 3
    assert typed_outputs(SCHEMA).read([encode(body), b"aux"]) is None


edits = st.sampled_from([
    ("frame", 0, True), ("frame", 3, 7), ("frame", 3, "x"), ("frame", 5, ["r0"]), ("frame", 6, 2),
    ("frame", 8, "w1"), ("frame", 2, {"num_running_reqs": "many"}), ("frame", 4, [1, "m", None]),
    ("frame", 2, {"num_running_reqs": 3, "unknown": None}), ("frame", 2, {"kv_cache_usage": 1}),
    ("frame", 2, {"prefix_cache_stats": {"reset": 1}}), ("frame", 2, {"prefix_cache_stats": {"hits": 2}}),
    ("frame", 2, {"iteration_details": {"iteration_index": 1}}), ("frame", 2, None), ("frame", 2, [1]),
    ("frame", 5, "r0"), ("frame", 5, None),
    ("output", 0, 5), ("output", 1, [1.5]), ("output", 1, "tokens"), ("output", 2, [[[1]], [[-0.5]], [[1]]]),
    ("output", 5, 1), ("output", 5, "length"), ("output", 6, 13), ("output", 6, "stop!"),
    ("output", 7, [[1, 2.5, None]]), ("output", 8, {"k": 1}), ("output", 13, 3), ("output", 13, None),
])


@settings(max_examples=300, deadline=None)
@given(st.lists(edits, max_size=3), st.integers(0, 3))
def test_any_edit_gives_the_same_rows_typed_or_not(changes, outputs):
    body = conforming(outputs)
    for where, position, value in changes:
        if where == "frame":
            body[position] = value
        elif body[1]:
            body[1][0][position] = value
    fast, generic = both_ways([encode(body)])
    assert fast == generic


def request_rows(parts: list[bytes]) -> tuple[dict, dict]:
    return both_ways(parts, Channel.INPUT, Direction.TO_ENGINE)


def test_real_requests_are_read_typed_with_the_same_rows():
    frames = recorded_frames("channel = 'input' AND direction = 'to_engine'")
    read = [typed_requests(SCHEMA).read(parts) for parts in frames]
    for parts in frames:
        fast, generic = request_rows(parts)
        assert fast == generic
    kinds = {message.kind for message in read if message is not None}
    assert kinds == {"ADD", "ABORT", "UTILITY"}
    # All but an add_lora call (its argument is a LoRARequest); a prompt of embeddings (a tensor in an aux
    # frame) too, its tensor named by the Namer.
    untyped = [WireDecoder(SCHEMA).decode(Channel.INPUT, Direction.TO_ENGINE, parts)
               for parts, message in zip(frames, read) if message is None]
    assert len(frames) > 80 and [message.fields["method"] for message in untyped] == ["add_lora"]
    embeds = [m for p, m in zip(frames, read) if len(p) > 2]
    assert embeds and all(isinstance(m.fields["prompt_embeds"], Tensor) for m in embeds)


ADD = struct_value(SCHEMA, "EngineCoreRequest", {
    "request_id": "cmpl-1", "prompt_token_ids": [1, 2, 3], "mm_features": None,
    "sampling_params": {"temperature": 0.0, "max_tokens": 16, "stop": [], "_all_stop_token_ids": [1],
                        "structured_outputs": {"regex": "[a-z]+", "_backend": "xgrammar"}},
    "pooling_params": None, "arrival_time": 1.5, "lora_request": None, "cache_salt": None,
    "data_parallel_rank": None})
TENSOR = ["float32", [1, 2], msgspec.msgpack.Ext(3, b"\0" * 8)]


def test_a_conforming_request_is_read_typed_and_a_drifted_one_is_not():
    read = typed_requests(SCHEMA).read
    assert read([b"\x00", encode(ADD)]).fields["sampling_params"]["structured_outputs"]["regex"] == "[a-z]+"
    assert read([b"\x01", encode(["cmpl-1", "cmpl-2"])]).fields == {"request_ids": ["cmpl-1", "cmpl-2"]}
    assert read([b"\x03", encode([0, 2**64 - 1, "get_supported_tasks", []])]).fields["call_id"] == 2**64 - 1
    with_aux = [b"\x00", encode(ADD), b"aux"]  # (an aux frame no field refers to: the generic path names none)
    assert read(with_aux) == WireDecoder(SCHEMA).decode(Channel.INPUT, Direction.TO_ENGINE, with_aux)
    assert [read(parts) for parts in ([b"\x00", encode([*ADD, None])], [b"\x00", encode(ADD[:-1])],
                                      [b"\x00", encode([ADD[0], [1, "2"], *ADD[2:]])],
                                      [b"\x01", encode(["r", 1])],
                                      [b"\x03", encode([0, 1, "add_lora", [["a", 1, "/a"]]])])] == [None] * 5


sampling_edits = st.sampled_from([
    ("n", 2), ("n", "2"), ("temperature", 1), ("temperature", True), ("stop", "\n"), ("stop", ["a", 1]),
    ("seed", None), ("unknown", 1), ("structured_outputs", None), ("structured_outputs", {"choice": ["a"]}),
    ("structured_outputs", {"regex": 5}), ("structured_outputs", {"mystery": True}), ("structured_outputs", "x"),
    ("prompt_logprob_token_ids", TENSOR), ("prompt_logprob_token_ids", None), ("logit_bias", {1: 0.5}),
    ("repetition_detection", {"min_count": 2}), ("repetition_detection", {"min_count": 2.5}),
])
request_edits = st.sampled_from([
    (0, 5), (1, None), (1, "tokens"), (2, [{"modality": "image"}]), (3, None), (3, [1]), (4, [True, 4]),
    (4, [None, None, None, None, "embed", False, None, None, None, 1]), (5, 7), (5, "now"), (6, ["a", 1, "/a"]),
    (6, ["a", "1"]), (7, 3), (8, 1), (9, TENSOR), (9, ["float32", [1, 2], 1]), (10, [True]), (11, -1),
    (13, 1.5), (14, {"traceparent": "00"}), (15, 0), (16, None), (17, None), (18, {"x": [1]}), (21, {"a": 1}),
])


@settings(max_examples=300, deadline=None)
@given(st.lists(sampling_edits, max_size=3), st.lists(request_edits, max_size=3), st.booleans())
def test_any_request_edit_gives_the_same_rows_typed_or_not(sampling, edits, aux):
    body = list(ADD)
    body[3] = {**body[3], **dict(sampling)}
    for position, value in edits:
        body[position] = value
    fast, generic = request_rows([b"\x00", encode(body), *([b"\0" * 8] if aux else [])])
    assert fast == generic


@given(st.lists(st.one_of(st.text(max_size=3), st.integers(-2**63, 2**64 - 1), st.none()), max_size=3),
       st.sampled_from([[0, 1, "reset_prefix_cache", []], [0, 1, "add_lora", [["a", 1]]], [0, "1", "m", []],
                        [0, 1, "m"], [0, 1, 2, []], [0, 1, "m", {}], [0, -5, "is_sleeping", [1.5, None]]]))
def test_any_abort_or_utility_gives_the_same_rows_typed_or_not(request_ids, call):
    for parts in ([b"\x01", encode(request_ids)], [b"\x03", encode(call)]):
        fast, generic = request_rows(parts)
        assert fast == generic
