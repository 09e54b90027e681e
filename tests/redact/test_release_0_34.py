"""0.34.0's new fields through the redactor: the prompt array chained where it travels (inline, or in an aux
frame; either dtype), the prompt's block hashes dropped (with them anyone could check a guessed prompt), the
registration's prefix hash seed keyed to bytes of its length, its config hash keyed, its config dump dropped."""

import hashlib

import pytest

from replay_proxy.redact import frames
from replay_proxy.redact.policy import load_policy
from replay_proxy.redact.tokens import Key
from replay_proxy.wire.capture import CapturedFrame
from replay_proxy.wire.encode import encode, struct_value, token_ids
from replay_proxy.wire.messages import Channel, Direction, Kind, WireDecoder
from replay_proxy.wire.registry import load_schema
from replay_proxy.wire.values import decode_msgpack
from replay_proxy.wire.values import token_ids as read_token_ids

SCHEMA = load_schema("0.34.0")
VOCAB = 900
NONE_HASH = hashlib.sha256(b"the engine's seed").digest()


def redactor() -> frames.Redactor:
    return frames.Redactor(Key(b"the 0.34.0 test key, 32 bytes.."), load_policy(None), VOCAB, "0.34.0")


def add(seq: int, tokens: list[int], dtype: str) -> CapturedFrame:
    aux: list[bytes] = []
    field = SCHEMA.structs["EngineCoreRequest"].by_name["prompt_token_ids"]
    body = struct_value(SCHEMA, "EngineCoreRequest", {
        "request_id": f"req-{seq}", "prompt_token_ids": token_ids(field, tokens, aux, dtype), "mm_features": None,
        "sampling_params": struct_value(SCHEMA, "SamplingParams", {"max_tokens": 4}), "pooling_params": None,
        "arrival_time": 1.0, "lora_request": None, "cache_salt": None, "data_parallel_rank": None,
        "block_hashes": [hashlib.sha256(bytes(tokens[:16])).digest()]})
    return CapturedFrame(seq, seq, Channel.INPUT, Direction.TO_ENGINE, 0, 0, [b"\x00", encode(body), *aux])


def prompt_of(frame: CapturedFrame) -> tuple[list[int], dict]:
    message = WireDecoder(SCHEMA, fixed=True).decode(frame.channel, frame.direction, frame.parts)
    assert (message.kind, message.flags, message.error) == (Kind.ADD, (), None)
    return read_token_ids(message.fields["prompt_token_ids"]), message.fields


@pytest.mark.parametrize("dtype", ["<i4", "=u4"])
def test_a_prompt_array_is_chained_where_it_travels_and_its_block_hashes_dropped(dtype):
    short, long = [7, 8, 9, 10], [7, 8, 9, 10] + [(5 * i) % VOCAB for i in range(100)]  # a shared prefix
    plain = [add(1, short, dtype), add(2, long, dtype)]
    redacted = redactor().frames(plain)
    assert [len(f.parts) for f in redacted] == [2, 3]  # the long prompt stays in its aux frame
    (a, fields_a), (b, fields_b) = (prompt_of(f) for f in redacted)
    assert (len(a), len(b)) == (len(short), len(long)) and b[:4] == a and a != short
    assert sum(x == y for x, y in zip(b, long)) < 5  # (one in 900 by chance)
    assert fields_a["prompt_token_ids"].dtype == dtype
    assert fields_a["block_hashes"] == fields_b["block_hashes"] == []  # the engine hashes the prompt itself
    # The same prompt redacted apart (another redactor, one key) gives the same pseudonyms: replays agree.
    assert prompt_of(redactor().frames([add(3, short, dtype)])[0])[0] == a


def test_the_registrations_new_keys_follow_the_policy():
    value = struct_value(SCHEMA, "EngineCoreReadyResponse", {
        "max_model_len": 256, "num_gpu_blocks": 100, "block_size": 16, "dp_stats_address": None,
        "dtype": "float32", "vllm_version": "0.34.0", "world_size": 1, "data_parallel_size": 1,
        "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "decode_context_parallel_size": 1,
        "data_parallel_rank": 0, "max_num_seqs": 4, "max_num_batched_tokens": 256, "instance_id": "i-1",
        "supports_lora": False, "max_loras": 0, "vllm_config": {"model": "/srv/acme/secret-model"},
        "prefix_hash_config": {"hash_algo": "sha256", "hash_block_size": 16, "none_hash": NONE_HASH},
        "cache_config_info": {"block_size": "16"}, "config_hash": "abc123"})
    frame = CapturedFrame(0, 0, Channel.INPUT, Direction.TO_FRONTEND, 0, 0, [encode(value)])
    [redacted] = redactor().frames([frame])
    got = decode_msgpack(redacted.parts[0])
    config = got["prefix_hash_config"]
    assert (config["hash_algo"], config["hash_block_size"], len(config["none_hash"])) == ("sha256", 16, 32)
    assert config["none_hash"] != NONE_HASH and got["config_hash"].startswith("h-")
    assert got["vllm_config"] in (None, {}) and got["cache_config_info"] == {"block_size": "16"}
    registration = WireDecoder(SCHEMA).decode(Channel.INPUT, Direction.TO_FRONTEND, redacted.parts)
    assert (registration.kind, registration.flags) == (Kind.REGISTRATION, ())  # a frontend still reads it
