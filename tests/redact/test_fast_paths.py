"""The fast paths against the walk: a busy engine's outputs (frames.PlainOutput, in C: _chain.c) and ADDs
whose fields but their prompt and ids are kept as they are (frames.PlainRequest).

Generated steps of outputs, one to three tokens each, some of them the requests' stop tokens, stop
reasons of every kind, finishes, ids out of the vocabulary and outputs of unknown requests; generated ADDs
with ids of every kind, prompts in and out of the vocabulary, and fields the walk drops. Two redactors
with one key take the same frames, one with the fast paths, one walking: the same bytes, and the same
contexts after (what is redacted next agrees too). The outputs' fast path reads and writes msgpack itself,
so msgpack it does not take, and longer forms of what it takes, are tried too.
"""

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from replay_proxy.redact import _chain, frames
from replay_proxy.redact.policy import load_policy
from replay_proxy.redact.tokens import Key
from replay_proxy.wire.capture import CapturedFrame
from replay_proxy.wire.encode import encode, struct_value
from replay_proxy.wire.messages import Channel, Direction
from replay_proxy.wire.registry import load_schema
from replay_proxy.wire.values import decode_msgpack

VOCAB = 50
STOP_TOKENS = [0, 1, 2]
SCHEMA = load_schema("0.32.0")
KEY = Key(b"the fast path's test key, 32 b.")
REQUESTS = [f"req-{i}" for i in range(4)]


def request(rid: str, **fields) -> list:
    return struct_value(SCHEMA, "EngineCoreRequest", {
        "request_id": rid, "prompt_token_ids": [5, 6, 7], "mm_features": None,
        "sampling_params": {"temperature": 0.0, "max_tokens": 8, "_eos_token_id": 0,
                            "_all_stop_token_ids": STOP_TOKENS},
        "pooling_params": None, "arrival_time": 1.0, "lora_request": None, "cache_salt": None,
        "data_parallel_rank": None, **fields})


def add(seq: int, rid: str, **fields) -> CapturedFrame:
    body = request(rid, **fields)
    return CapturedFrame(seq, seq, Channel.INPUT, Direction.TO_ENGINE, 0, 0, [b"\x00", encode(body)])


text = st.none() | st.sampled_from(["a", "b"]) | st.integers(0, 3)  # (an int is of no kind these fields take)
ADDS = st.lists(st.fixed_dictionaries({
    "rid": st.sampled_from(REQUESTS) | st.integers(0, 3),
    "prompt_token_ids": st.none() | st.lists(st.integers(0, VOCAB - 1) | st.just(VOCAB + 3), max_size=4)
    | st.just("a prompt"),
    "external_req_id": text, "cache_salt": text,
    "reasoning_parser_kwargs": st.none() | st.just({}) | st.just({"chat_template_kwargs": {}}),
    "mm_features": st.none() | st.just([]),
}), min_size=1, max_size=6)


# ints of every width, and each width's edges, which msgpack writes in different forms
INT64 = st.integers(-2 ** 63, 2 ** 63 - 1) | st.sampled_from(
    [edge + d for edge in (-2 ** 63, -2 ** 31, -2 ** 15, -2 ** 7, -2 ** 5, 2 ** 7, 2 ** 8, 2 ** 16, 2 ** 32, 2 ** 63)
     for d in (-1, 0) if -2 ** 63 <= edge + d < 2 ** 63])
output = st.fixed_dictionaries({
    "request_id": st.sampled_from(REQUESTS + ["unknown"]),
    "new_token_ids": st.lists(st.integers(0, VOCAB - 1) | st.just(VOCAB + 3), min_size=1, max_size=3),
    "finish_reason": st.none() | st.integers(0, 2),
    "stop_reason": st.none() | st.integers(0, VOCAB - 1) | st.sampled_from(["a stop string", "another"]) | INT64,
    "num_nans_in_logits": INT64,
})
STEPS = st.lists(st.lists(output, min_size=1, max_size=6), min_size=1, max_size=6)


def outputs_frame(seq: int, outputs: list[dict]) -> CapturedFrame:
    body = struct_value(SCHEMA, "EngineCoreOutputs", {
        "engine_index": 0, "timestamp": 1.0, "outputs": [struct_value(SCHEMA, "EngineCoreOutput", o) for o in outputs]})
    return CapturedFrame(seq, seq, Channel.OUTPUT, Direction.TO_FRONTEND, 0, 0, [encode(body)])


def redactor() -> frames.Redactor:
    return frames.Redactor(KEY, load_policy(None), VOCAB, "0.32.0")


NO_FAST_PATH = {("0.32.0", "EngineCoreOutput"): None, ("0.32.0", "EngineCoreRequest"): None}  # all walked


def same(fast: frames.Redactor, walked: frames.Redactor, captured: list[CapturedFrame]) -> None:
    for_fast, for_walk = fast.frames(captured) + fast.flush(), walked.frames(captured) + walked.flush()
    assert [f.parts for f in for_fast] == [f.parts for f in for_walk]
    assert (dict(fast.blanked), dict(fast.dropped)) == (dict(walked.blanked), dict(walked.dropped))
    assert fast.outputs_without_prompt == walked.outputs_without_prompt
    for requests in ("live", "ended"):  # (a request's end found by either)
        assert {rid: c.prefix.digest() for rid, c in getattr(fast, requests).items()} == \
            {rid: c.prefix.digest() for rid, c in getattr(walked, requests).items()}


@settings(max_examples=150, deadline=None)
@given(STEPS)
def test_the_fast_path_redacts_as_the_walk_does(steps):
    captured = [add(i + 1, rid) for i, rid in enumerate(REQUESTS)]
    captured += [outputs_frame(len(captured) + k + 1, step) for k, step in enumerate(steps)]
    fast, walked = redactor(), redactor()
    walked._plain = NO_FAST_PATH
    same(fast, walked, captured)


@settings(max_examples=150, deadline=None)
@given(ADDS, STEPS)
def test_the_fast_path_redacts_adds_as_the_walk_does(adds, steps):
    captured = [add(i + 1, **fields) for i, fields in enumerate(adds)]
    captured += [outputs_frame(len(captured) + k + 1, step) for k, step in enumerate(steps)]
    fast, walked = redactor(), redactor()
    walked._plain = NO_FAST_PATH
    same(fast, walked, captured)


def test_the_fast_path_is_taken_for_plain_outputs_and_not_for_others():
    fast = redactor()
    fast.frames([add(1, "req-0")])
    plain = struct_value(SCHEMA, "EngineCoreOutput", {"request_id": "req-0", "new_token_ids": [9]})
    redacted = decode_msgpack(fast._plain_outputs(encode([plain])))  # one token, of a request known
    assert redacted[0][0] == fast.hasher.text("req-0") and redacted[0][1] != [9]
    before = fast.live["req-0"].prefix.digest()
    for other in ([["req-0", [VOCAB], *plain[2:]]],  # not in the vocabulary
                  [["unknown", [9], *plain[2:]]],  # no ADD came
                  [["req-0", [9], [1, 2], *plain[3:]]],  # logprobs: walked, for their contexts
                  [plain[:-1]],  # another release's length
                  [["req-0", [9], *plain[2:5], True, *plain[6:]]]):  # a finish reason that is no int
        assert fast._plain_outputs(encode(other)) is None
    whole = encode([plain])
    for broken in (whole[:-1], whole + b"\xc0", b"\xc1", b""):  # cut short, more than one value, not msgpack
        assert fast._plain_outputs(broken) is None
    assert fast.live["req-0"].prefix.digest() == before  # and nothing was redacted on the way


def _uint16(n: int) -> bytes:
    return b"\xcd" + n.to_bytes(2, "big")


def test_outputs_written_in_longer_forms_come_out_as_the_walk_writes_them():
    """msgpack lets a writer spend more bytes than it needs (an int 9 as uint16, a short text as str8, a
    short array as array16); the fast path writes what the walk would, msgspec's shortest forms."""
    columns = frames.PlainOutput.of(SCHEMA, load_policy(None))
    rid_at, tokens_at, finish_at, stop_at, nans_at = columns.columns
    fields = [b"\xc0"] * columns.length
    fields[rid_at] = b"\xd9\x05req-0"
    fields[tokens_at] = b"\xdc\x00\x02" + _uint16(9) + _uint16(3)
    fields[finish_at] = b"\xd0\x01"  # int8
    fields[stop_at] = b"\xd3" + (-5).to_bytes(8, "big", signed=True)  # int64
    fields[nans_at] = b"\xcf" + (7).to_bytes(8, "big")  # uint64
    longer = b"\x91\xdc" + columns.length.to_bytes(2, "big") + b"".join(fields)
    fast, reference = redactor(), redactor()
    for one in (fast, reference):
        one.frames([add(1, "req-0")])
    output = decode_msgpack(longer)[0]
    assert [output[i] for i in columns.columns] == ["req-0", [9, 3], 1, -5, 7]
    assert fast._plain_outputs(longer) == reference._plain_outputs(encode(decode_msgpack(longer)))
    assert fast.live == {} and fast.ended.keys() == reference.ended.keys() == {"req-0"}  # finished
    assert fast.ended["req-0"].prefix.digest() == reference.ended["req-0"].prefix.digest()
    too_big = fields[:nans_at] + [b"\xcf" + (2 ** 63).to_bytes(8, "big")] + fields[nans_at + 1:]  # no int64
    assert redactor()._plain_outputs(b"\x91\xdc" + columns.length.to_bytes(2, "big") + b"".join(too_big)) is None


def test_the_fast_path_is_taken_for_plain_adds_and_not_for_others():
    fast = redactor()
    value = request("req-0", prompt_token_ids=[9, 10], external_req_id="ext-0")
    taken = list(value)
    assert fast._plain_request(frames.Walk([]), encode(taken), taken)  # ids hashed, the prompt chained, in place
    assert taken[0] == fast.hasher.text("req-0") and taken[1] != [9, 10] and "req-0" in fast.live
    at = SCHEMA.structs["EngineCoreRequest"].by_name
    for name, other in (("request_id", 7), ("external_req_id", 7),  # no kind the field takes: blanked by the walk
                        ("prompt_token_ids", "text"),
                        ("reasoning_parser_kwargs", {"chat_template_kwargs": {}}),  # dropped by the walk
                        ("mm_features", [["an item"]])):  # walked
        refused = list(value)
        refused[at[name].position] = other
        untouched = repr(refused)
        assert not fast._plain_request(frames.Walk([]), encode(refused), refused) and repr(refused) == untouched, name
    assert list(fast.live) == ["req-0"]  # and no context was entered on the way


SAMPLES = {"nil": [None], "int": [0, 3], "float": [1.5], "bool": [True], "str": ["", "text"], "bin": [b""],
           "array": [[], [1], ["text"]], "map": [{}, {"key": 1}]}  # values of each kind
ANY = [value for values in SAMPLES.values() for value in values]


def of_its_kinds(field) -> st.SearchStrategy:
    kinds = SAMPLES if "any" in field.kinds else [kind for kind in field.kinds if kind in SAMPLES]
    return st.sampled_from([None] + [value for kind in kinds for value in SAMPLES[kind]])


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["SchedulerStats", "PrefixCacheStats", "SamplingParams", "PoolingParams", "LoRARequest",
                        "EngineZmqAddresses", "EngineHandshakeMetadata"]), st.data())
def test_what_the_check_gives_back_unchanged_the_walk_gives_back_too(name, data):
    """Redactor._unchanged says yes only where the whole walk, with nothing taken as kept, gives
    the value back equal, blanking and dropping nothing. Each field holds a value of a kind its schema
    takes, but for up to two of any kind."""
    spec = SCHEMA.structs[name]
    values = {field.name: data.draw(of_its_kinds(field), label=field.name) for field in spec.fields}
    for other in data.draw(st.sets(st.sampled_from([field.name for field in spec.fields]), max_size=2)):
        values[other] = data.draw(st.sampled_from(ANY), label=other)
    value = values if spec.encoding == "map" else list(values.values())
    walked = redactor()
    walked._kept_of = lambda struct: None  # nothing is taken as kept: every field is walked
    checked = redactor()
    assert (_chain.unchanged(encode(value), checked._shape_of(name)) is not False) == checked._unchanged(name, value)
    if checked._unchanged(name, value):
        assert walked._struct(frames.Walk([b""]), name, copy.deepcopy(value)) == value
        assert not walked.blanked and not walked.dropped
