"""Frames of every kind the classifier knows, made with the 0.32.0 schema: the classifier's cases, and the
fuzzer's seeds."""

from replay_proxy.wire.encode import encode, struct_value
from replay_proxy.wire.messages import Channel, Direction, Kind
from replay_proxy.wire.registry import load_schema

SCHEMA = load_schema("0.32.0")
TO_ENGINE, TO_FRONTEND = Direction.TO_ENGINE, Direction.TO_FRONTEND


def request_body(**extra):
    return encode(struct_value(SCHEMA, "EngineCoreRequest", {
        "request_id": "cmpl-1-abcd", "prompt_token_ids": [5, 6, 7], "mm_features": None,
        "sampling_params": {"temperature": 0.0, "max_tokens": 4}, "pooling_params": None,
        "arrival_time": 12.5, "lora_request": None, "cache_salt": None, "data_parallel_rank": None,
        **extra,
    }))


CASES = [
    (Channel.HANDSHAKE, TO_FRONTEND, [encode({"status": "HELLO", "local": False, "headless": True})], Kind.HELLO),
    (Channel.HANDSHAKE, TO_FRONTEND, [encode({"status": "READY", "local": False, "headless": True})], Kind.READY),
    (Channel.HANDSHAKE, TO_ENGINE, [encode({"addresses": {"inputs": ["tcp://a:1"], "outputs": ["tcp://a:2"]},
                                           "parallel_config": {}})], Kind.INIT),
    (Channel.INPUT, TO_FRONTEND, [b""], Kind.REGISTRATION),
    (Channel.INPUT, TO_ENGINE, [b"\x00", request_body()], Kind.ADD),
    (Channel.INPUT, TO_ENGINE, [b"\x01", encode(["cmpl-1-abcd", "cmpl-2-efgh"])], Kind.ABORT),
    (Channel.INPUT, TO_ENGINE, [b"\x03", encode([0, 99, "get_supported_tasks", []])], Kind.UTILITY),
    (Channel.COORDINATOR_INPUT, TO_ENGINE, [b"\x02", encode([3, b"\x01\x00"])], Kind.START_DP_WAVE),
    (Channel.COORDINATOR_INPUT, TO_ENGINE, [b"READY"], Kind.COORDINATOR_READY),
    (Channel.COORDINATOR_INPUT, TO_FRONTEND, [b"\x01"], Kind.SUBSCRIBE),
    (Channel.COORDINATOR_INPUT, TO_FRONTEND, [b"\x00"], Kind.UNSUBSCRIBE),  # the engine went away
    (Channel.COORDINATOR_INPUT, TO_FRONTEND, [b"\x05"], Kind.UNKNOWN),
    (Channel.OUTPUT, TO_FRONTEND, [encode(struct_value(SCHEMA, "EngineCoreOutputs", {
        "outputs": [{"request_id": "cmpl-1-abcd", "new_token_ids": [9]}]}))], Kind.OUTPUTS),
    (Channel.OUTPUT, TO_FRONTEND, [encode(struct_value(SCHEMA, "EngineCoreOutputs", {
        "utility_output": {"call_id": 99, "result": [None, ["generate"]]}}))], Kind.UTILITY_OUTPUT),
    (Channel.OUTPUT, TO_FRONTEND, [b"ENGINE_CORE_DEAD"], Kind.ENGINE_CORE_DEAD),
    (Channel.COORDINATOR_OUTPUT, TO_FRONTEND, [encode(struct_value(SCHEMA, "EngineCoreOutputs", {
        "wave_complete": 2}))], Kind.OUTPUTS),
    (Channel.INPUT, TO_ENGINE, [b"\x07", b"\x90"], Kind.UNKNOWN),
    (Channel.OUTPUT, TO_FRONTEND, [b"\xc1"], Kind.UNKNOWN),
    (Channel.HANDSHAKE, TO_FRONTEND, [encode({"status": "BYE"})], Kind.UNKNOWN),
    (Channel.HANDSHAKE, TO_FRONTEND, [], Kind.UNKNOWN),
]
