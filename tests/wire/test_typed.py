"""The typed fast path gives exactly the rows of the generic decoder, and only reads what conforms.

Frames: every EngineCoreOutputs of the real 0.32.0 recordings (made with our
recorder), then hypothesis variations of a conforming one (a position more
or less, another kind in a field, logprobs, events), each decoded both ways.
"""

import sqlite3
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from replay_proxy.store.rows import Rows
from replay_proxy.wire.capture import CapturedFrame
from replay_proxy.wire.encode import encode, struct_value
from replay_proxy.wire.messages import Channel, Direction, WireDecoder
from replay_proxy.wire.schema import load_schema
from replay_proxy.wire.typed import typed_outputs
from replay_proxy.wire.values import decode_msgpack

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = load_schema("0.32.0")


def both_ways(parts: list[bytes]) -> tuple[dict, dict, bool]:
    """The rows of one output frame by ``Rows.add`` (fast where it can) and by the generic decoder only."""
    frame = CapturedFrame(7, 1_000, Channel.OUTPUT, Direction.TO_FRONTEND, 0, 0, parts)
    fast, generic = Rows(), Rows()
    fast.add(1, frame, WireDecoder(SCHEMA))
    decoder = WireDecoder(SCHEMA)
    generic.add_frame(1, frame, decoder.decode(frame.channel, frame.direction, parts), SCHEMA)
    return dict(fast.tables), dict(generic.tables), typed_outputs(SCHEMA).read(parts) is not None


def recorded_output_frames() -> list[list[bytes]]:
    frames = []
    for name in ("vllm-0.32.0-python.db", "vllm-0.32.0-vllm-rs.db"):
        connection = sqlite3.connect(ROOT / "recordings" / name)
        frames += [decode_msgpack(raw) for (raw,) in connection.execute(
            "SELECT raw FROM frames WHERE kind IN ('OUTPUTS', 'UTILITY_OUTPUT')")]
        connection.close()
    return frames


def test_real_engine_frames_are_read_typed_with_the_same_rows():
    frames = recorded_output_frames()
    typed = 0
    for parts in frames:
        fast, generic, was_typed = both_ways(parts)
        assert fast == generic
        typed += was_typed
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
    fast, generic, _ = both_ways([encode(body)])
    assert fast == generic
