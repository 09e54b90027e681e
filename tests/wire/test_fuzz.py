"""Nothing from the wire raises out of wire/ (h11's fuzz target, for msgpack)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from replay_proxy.wire.encode import encode
from replay_proxy.wire.messages import Channel, Direction, Kind, Message, RequestType, WireDecoder, request_type
from replay_proxy.wire.registry import load_schema
from tests.strategies import msgpack_values
from tests.wire.cases import CASES

channels = st.sampled_from(list(Channel))
directions = st.sampled_from(list(Direction))


def check(channel, direction, frames):
    """Three properties of the decoder on any input: it returns a Message (never raises); it writes
    nothing into the buffers it is given (the recorder keeps them, the relay forwards them: here
    they are mutable, so a write would show); and a frame it cannot classify carries its error."""
    buffers = [bytearray(f) for f in frames]
    message = WireDecoder(load_schema("0.32.0")).decode(channel, direction, buffers)
    assert isinstance(message, Message)
    assert [bytes(b) for b in buffers] == [bytes(f) for f in frames]
    as_bytes = WireDecoder(load_schema("0.32.0")).decode(channel, direction, [bytes(f) for f in frames])
    assert (message.kind, bool(message.error)) == (as_bytes.kind, bool(as_bytes.error))  # as bytes decode
    if message.kind is Kind.UNKNOWN:
        assert message.error


@settings(max_examples=400)
@given(channels, directions, st.lists(st.binary(max_size=64), max_size=4))
def test_arbitrary_bytes_never_raise(channel, direction, frames):
    check(channel, direction, frames)


@settings(max_examples=400)
@given(channels, directions, st.sampled_from([b"\x00", b"\x01", b"\x02", b"\x03"]), msgpack_values)
def test_any_msgpack_body_never_raises(channel, direction, request_type, body):
    check(channel, direction, [request_type, encode(body)])
    check(channel, direction, [encode(body)])


@settings(max_examples=400)
@given(st.sampled_from(CASES), st.data())
def test_mutated_real_frames_never_raise(case, data):
    channel, direction, frames, _ = case
    if not frames:
        return
    index = data.draw(st.integers(0, len(frames) - 1))
    frame = bytearray(frames[index])
    for _ in range(data.draw(st.integers(1, 4))):
        if frame:
            frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    mutated = [*frames[:index], bytes(frame), *frames[index + 1:]]
    check(channel, direction, mutated)


def test_truncated_outputs_give_unknown_with_the_error():
    body = encode([0, [["r", [1, 2, 3]]]])
    message = WireDecoder().decode(Channel.OUTPUT, Direction.TO_FRONTEND, [body[:-2]])
    assert message.kind is Kind.UNKNOWN and "truncated" in message.error
    # Only the truncation made it unknown: the whole frame decodes, its output named.
    whole = WireDecoder().decode(Channel.OUTPUT, Direction.TO_FRONTEND, [body])
    assert whole.kind is Kind.OUTPUTS and whole.error is None
    assert (whole.fields["outputs"][0]["request_id"], whole.fields["outputs"][0]["new_token_ids"]) == ("r", [1, 2, 3])


@given(value=msgpack_values | st.lists(msgpack_values, max_size=30), data=st.data())
@settings(max_examples=300)
def test_a_field_read_by_name_is_the_value_at_its_place_in_its_release_or_none(value, data):
    """``Schema.read``, what rotation, cut, the redactor and the replays read a field with: on any value, the
    element at the field's position of an array, its key of a map, else None; never an exception."""
    schema = load_schema(data.draw(st.sampled_from(["0.27.0", "0.32.0", "0.34.0"])))
    struct = data.draw(st.sampled_from(sorted(schema.structs)))
    spec = schema.structs[struct]
    name = data.draw(st.sampled_from([f.name for f in spec.fields] + ["not_a_field"]))
    field, got = spec.by_name.get(name), schema.read(value, struct, name)
    if field is not None and isinstance(value, list):
        assert got is (value[field.position] if field.position < len(value) else None)
    elif field is not None and isinstance(value, dict):
        assert got is value.get(name)
    else:
        assert got is None
    assert schema.read(value, "NotAStruct", name) is None


@given(channels, directions, st.lists(st.binary(max_size=3), max_size=3))
def test_an_input_says_what_it_asks_from_its_first_frame_alone(channel, direction, parts):
    asks = request_type(channel, direction, parts)
    to_engine = channel is Channel.INPUT and direction is Direction.TO_ENGINE
    assert asks == (RequestType(parts[0]) if to_engine and parts and parts[0] in {t.value for t in RequestType}
                    else None)
