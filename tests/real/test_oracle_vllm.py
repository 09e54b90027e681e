"""vLLM 0.32.0's own classes as the oracle: what they encode, we decode to the same values; what our
sim peers encode, vLLM's decoder reads back to the values we meant."""

import json
from pathlib import Path

import pytest
import sqlite_utils
import trio

from replay_proxy.sim.engine import token_at
from replay_proxy.wire.encode import encode, struct_value
from replay_proxy.wire.messages import Channel, Direction, Kind, WireDecoder
from replay_proxy.wire.registry import load_schema
from replay_proxy.wire.handshake import engine_identity
from replay_proxy.wire.values import token_ids
from tests.helpers import RecordedSession
from tests.real.vllm_reads import oracle, read_as_vllm_does, same

pytestmark = pytest.mark.real_vllm



def test_frames_vllm_encodes_decode_to_the_same_named_values():
    made = oracle("encode")
    decoder = WireDecoder(load_schema("0.32.0"))
    request = decoder.decode(Channel.INPUT, Direction.TO_ENGINE,
                             [b"\x00", *(bytes.fromhex(f) for f in made["request"]["frames"])])
    assert (request.kind, request.flags, request.error) == (Kind.ADD, (), None)
    expected = made["request"]["values"]
    for key in ("request_id", "prompt_token_ids", "arrival_time", "cache_salt", "client_index", "priority"):
        assert request.fields[key] == expected[key], key
    for key, value in expected["sampling_params"].items():
        assert request.fields["sampling_params"][key] == value, key
    frames = [bytes.fromhex(f) for f in made["outputs"]["frames"]]
    assert len(frames) == 3  # ids (640 bytes) and logprobs (320 bytes) are over the 256-byte threshold
    outputs = decoder.decode(Channel.OUTPUT, Direction.TO_FRONTEND, frames)
    assert (outputs.kind, outputs.flags, outputs.error) == (Kind.OUTPUTS, (), None)
    expected = made["outputs"]["values"]
    output = outputs.fields["outputs"][0]
    assert (outputs.fields["engine_index"], output["request_id"], output["new_token_ids"], output["finish_reason"]) \
        == (expected["engine_index"], expected["request_id"], expected["new_token_ids"], expected["finish_reason"])
    logprobs = output["new_logprobs"]
    assert (logprobs["logprob_token_ids"].aux_frame, logprobs["logprobs"].aux_frame) == (1, 2)
    assert logprobs["logprob_token_ids"].values == expected["logprob_token_ids"]
    assert logprobs["logprobs"].values == expected["logprobs"] and logprobs["sampled_token_ranks"].values == [3]
    utility = outputs.fields["utility_output"]
    assert (utility["call_id"], utility["failure_message"]) == (expected["call_id"], expected["failure_message"])


def test_frames_the_sim_peers_encode_decode_under_vllms_decoder():
    schema = load_schema("0.32.0")
    request = struct_value(schema, "EngineCoreRequest", {
        "request_id": "sim-1", "prompt_token_ids": [1, 2, 3], "mm_features": None,
        "sampling_params": struct_value(schema, "SamplingParams", {"temperature": 0.0, "max_tokens": 5, "seed": 9}),
        "pooling_params": None, "arrival_time": 1.0, "lora_request": None, "cache_salt": None,
        "data_parallel_rank": None, "client_index": 1})
    token = token_at([1, 2, 3], 9, 0)
    outputs = struct_value(schema, "EngineCoreOutputs", {
        "engine_index": 1, "timestamp": 2.0,
        "outputs": [{"request_id": "sim-1", "new_token_ids": [token], "finish_reason": 1}]})
    got = oracle("decode", json.dumps({"request": [encode(request).hex()], "outputs": [encode(outputs).hex()]}))
    assert got == {"request_id": "sim-1", "prompt_token_ids": [1, 2, 3], "client_index": 1, "max_tokens": 5,
                   "temperature": 0.0, "seed": 9, "output_request_id": "sim-1", "new_token_ids": [token],
                   "finish_reason": 1, "engine_index": 1}


def test_multimodal_features_vllm_encodes_are_named_value_by_value():
    # No multimodal model runs on vLLM's CPU build here (docs/real-vllm.md): these frames are vLLM's own
    # encoding of an ADD with image features, and each value we name is what its own decoder reads back.
    made = oracle("multimodal")
    frames = [bytes.fromhex(f) for f in made["frames"]]
    request = WireDecoder(load_schema("0.32.0")).decode(Channel.INPUT, Direction.TO_ENGINE, [b"\x00", *frames])
    assert (request.kind, request.flags, request.error) == (Kind.ADD, (), None)
    ours, theirs = request.fields["mm_features"], made["values"]["mm_features"]
    fields = {}  # a field as sent is [factory, its keywords]; vLLM reads it back as that factory's dataclass
    for feature, expected in zip(ours, theirs, strict=True):
        for key, elem in (feature["data"] or {}).items():
            fields[key], keywords = elem.pop("field")
            assert keywords == expected["data"][key].pop("field"), key
    same(ours, theirs, "$.mm_features")
    assert fields == {"pixel_values": "batched", "image_sizes": "batched", "patches": "shared"}
    pixels, sizes = ours[0]["data"]["pixel_values"]["data"], ours[0]["data"]["image_sizes"]["data"]
    assert (pixels.dtype, pixels.shape, pixels.aux_frame, sizes.aux_frame) == ("float32", [3, 8, 8], 1, None)
    assert [t.dtype for t in ours[0]["data"]["patches"]["data"]] == ["bfloat16", "int32"]
    assert ours[1]["data"] is None and ours[1]["mm_position"] == {"offset": 6, "length": 4, "is_embed": None}



@pytest.mark.parametrize("recording", ["vllm-0.32.0-python.db", "vllm-0.32.0-vllm-rs.db", "vllm-0.32.0-staging.db"])
def test_every_value_of_the_shipped_0_32_0_recordings_is_what_vllms_decoder_reads(recording):
    kinds = {kind for kind, _ in read_as_vllm_does(Path(__file__).parents[2] / "recordings" / recording)}
    assert {"ADD", "OUTPUTS"} <= kinds


def test_0_34_0_frames_vllm_encodes_cross_record_byte_identical_and_decode_to_its_values(tmp_path):
    """0.34.0's own MsgpackEncoder: prompts as int32 and uint32 arrays, inline (5 tokens) and in an aux frame
    (200), through a recording relay to a sim engine of 0.34.0; the registration and an output likewise named."""
    made = oracle("arrays", release="0.34.0")
    schema, db = load_schema("0.34.0"), tmp_path / "recording.db"
    requests = {name: [b"\x00", *(bytes.fromhex(f) for f in r["frames"])] for name, r in made["requests"].items()}
    assert {name: len(parts) for name, parts in requests.items()} == {
        "5-<i4": 2, "5-<u4": 2, "200-<i4": 3, "200-<u4": 3}

    async def send():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                session = await RecordedSession(nursery, db, frontend_release="0.34.0",
                                                engine_release="0.34.0").start()
                for parts in requests.values():
                    await session.frontend.inputs[0].send([engine_identity(0), *parts])
                await session.frontend.wait_for(lambda: len(session.frontend.finish_reasons) == len(requests))
                nursery.cancel_scope.cancel()
        session.recorder.close()
        return session

    session = trio.run(send)
    received = [frames for _, frames in session.engines[0].received if frames[0] == b"\x00"]
    assert received == list(requests.values())  # byte-identical, aux frames included
    database = sqlite_utils.Database(db)
    rows = {r["request_id"]: r for r in database.query("SELECT * FROM requests")}
    for name, request in made["requests"].items():
        assert (rows[name]["prompt_len"], json.loads(rows[name]["prompt_token_ids"])) == (
            len(request["tokens"]), request["tokens"])
        assert (rows[name]["temperature"], rows[name]["top_p"], rows[name]["max_tokens"]) == (0.7, 0.9, 3)
        message = WireDecoder(schema).decode(Channel.INPUT, Direction.TO_ENGINE, requests[name])
        assert (message.kind, message.flags, message.error) == (Kind.ADD, (), None)
        assert token_ids(message.fields["prompt_token_ids"]) == request["tokens"]
        assert [h.hex() for h in message.fields["block_hashes"]] == request["block_hashes"]
    assert database["sessions"].get(1)["frontend_release"] == "0.34.0"
    assert database.execute("SELECT COUNT(*) FROM frames WHERE decode_error IS NOT NULL OR flags IS NOT NULL"
                            ).fetchone()[0] == 0
    decoder = WireDecoder(schema)
    registration = decoder.decode(Channel.INPUT, Direction.TO_FRONTEND, [bytes.fromhex(made["registration"])])
    assert (registration.kind, registration.flags) == (Kind.REGISTRATION, ())
    assert registration.fields["prefix_hash_config"] == {"hash_algo": "sha256", "hash_block_size": 16,
                                                         "none_hash": b"\x02" * 32, "num_lookahead_tokens": 0}
    assert (registration.fields["config_hash"], registration.fields["cache_config_info"]) == (
        "c0ffee", {"block_size": "16"})
    outputs = decoder.decode(Channel.OUTPUT, Direction.TO_FRONTEND, [bytes.fromhex(f) for f in made["outputs"]])
    assert (outputs.kind, outputs.flags) == (Kind.OUTPUTS, ())
    assert outputs.fields["outputs"][0]["watermarking"] is True
