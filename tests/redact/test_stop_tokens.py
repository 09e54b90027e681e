"""A request's stop tokens are fixed points where the engine generates, never in its prompt."""

from replay_proxy.redact import frames
from replay_proxy.redact.policy import load_policy
from replay_proxy.redact.tokens import Key
from replay_proxy.wire.capture import CapturedFrame
from replay_proxy.wire.encode import encode, struct_value
from replay_proxy.wire.messages import Channel, Direction, WireDecoder
from replay_proxy.wire.registry import load_schema

VOCAB = 50
SCHEMA = load_schema("0.32.0")


def add(seq: int, rid: str, prompt: list[int], stops: list[int]) -> CapturedFrame:
    body = struct_value(SCHEMA, "EngineCoreRequest", {
        "request_id": rid, "prompt_token_ids": prompt, "mm_features": None,
        "sampling_params": {"temperature": 0.0, "max_tokens": 8, "stop_token_ids": stops},
        "pooling_params": None, "arrival_time": 1.0, "lora_request": None, "cache_salt": None,
        "data_parallel_rank": None})
    return CapturedFrame(seq, seq, Channel.INPUT, Direction.TO_ENGINE, 0, 0, [b"\x00", encode(body)])


def output(seq: int, rid: str, tokens: list[int]) -> CapturedFrame:
    body = struct_value(SCHEMA, "EngineCoreOutputs", {"engine_index": 0, "timestamp": 1.0, "outputs": [
        struct_value(SCHEMA, "EngineCoreOutput", {"request_id": rid, "new_token_ids": tokens, "finish_reason": 0,
                                                 "stop_reason": tokens[-1]})]})
    return CapturedFrame(seq, seq, Channel.OUTPUT, Direction.TO_FRONTEND, 0, 0, [encode(body)])


def fields(frame: CapturedFrame) -> dict:
    return WireDecoder(SCHEMA).decode(frame.channel, frame.direction, frame.parts).fields


def test_prompts_hide_their_stop_tokens_and_outputs_stop_where_they_did():
    redactor = frames.Redactor(Key(b"the stop tokens' test key, 32 b."), load_policy(None), VOCAB, "0.32.0")
    everything = list(range(3, VOCAB))
    a, b, c, stopped = redactor.frames([add(1, "a", [5, 6, 7, 8], []), add(2, "b", [5, 6, 7, 8], [7]),
                                        add(3, "c", everything, everything), output(4, "b", [9, 7])])
    prompts = [fields(f)["prompt_token_ids"] for f in (a, b, c)]
    assert prompts[0] == prompts[1] != [5, 6, 7, 8]  # equal prompts stay equal, whatever their stop lists
    assert sum(x == y for x, y in zip(prompts[2], everything)) <= 3  # a vocabulary of stop tokens hides all the same
    assert fields(b)["sampling_params"]["stop_token_ids"] == [7]  # the stop list stays, ...
    [out] = fields(stopped)["outputs"]
    assert out["new_token_ids"][-1] == out["stop_reason"] == 7  # ... and the engine's stop at it
