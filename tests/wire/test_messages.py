"""Bytes in, messages out: every kind the classifier knows."""

import msgspec
import pytest

from replay_proxy.wire.encode import encode, struct_value, tensor
from replay_proxy.wire.messages import Channel, Kind, WireDecoder
from replay_proxy.wire.registry import load_schema
from replay_proxy.wire.values import Ext, Tensor
from tests.wire.cases import CASES, SCHEMA, TO_ENGINE, TO_FRONTEND, request_body


def decode(channel, direction, frames):
    return WireDecoder(SCHEMA).decode(channel, direction, frames)



@pytest.mark.parametrize("channel, direction, frames, kind", CASES, ids=[f"{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_every_kind_is_classified(channel, direction, frames, kind):
    message = decode(channel, direction, frames)
    assert message.kind is kind
    assert (message.error is not None) == (kind is Kind.UNKNOWN)


def test_add_names_positions_and_keeps_omitted_sampling_keys_omitted():
    fields = decode(Channel.INPUT, TO_ENGINE, [b"\x00", request_body(client_index=1, priority=3)]).fields
    assert fields["request_id"] == "cmpl-1-abcd"
    assert fields["arrival_time"] == 12.5
    assert fields["client_index"] == 1 and fields["priority"] == 3
    assert fields["sampling_params"] == {"temperature": 0.0, "max_tokens": 4}
    assert list(fields)[:3] == ["request_id", "prompt_token_ids", "mm_features"]


def test_utility_and_abort_fields():
    utility = decode(Channel.INPUT, TO_ENGINE, [b"\x03", encode([1, 2**63, "profile", [True]])]).fields
    assert utility == {"client_index": 1, "call_id": 2**63, "method": "profile", "args": [True]}
    abort = decode(Channel.INPUT, TO_ENGINE, [b"\x01", encode(["a-1", "b-2"])]).fields
    assert abort == {"request_ids": ["a-1", "b-2"]}


def test_add_loras_argument_is_named_as_the_lora_request_each_release_reads():
    """vLLM's engine converts add_lora's argument to its own LoRARequest: named as that struct, a LoRARequest
    from 0.32.0 (tensorizer_config_dict removed at position 4) is flagged where a 0.31.0 engine refuses it."""
    call = [b"\x03", encode([1, 77, "add_lora", [["tiny-lora", 1, "/adapters/tiny", None, False, False]]])]
    named = decode(Channel.INPUT, TO_ENGINE, call)
    assert (named.kind, named.flags) == (Kind.UTILITY, ())
    assert named.fields["args"] == [{"lora_name": "tiny-lora", "lora_int_id": 1, "lora_path": "/adapters/tiny",
                                     "base_model_name": None, "load_inplace": False, "is_3d_lora_weight": False}]
    older = WireDecoder(load_schema("0.31.0")).decode(Channel.INPUT, TO_ENGINE, call)
    [flag] = older.flags
    assert (flag.struct, flag.position, flag.field, flag.issue, flag.got) == (
        "LoRARequest", 4, "tensorizer_config_dict", "type_mismatch", "bool")
    other = decode(Channel.INPUT, TO_ENGINE, [b"\x03", encode([1, 78, "pin_lora", [1]])])
    assert other.fields["args"] == [1]  # an argument no struct is converted to stays as it came


def test_inserted_request_field_is_flagged_at_its_position():
    # A frontend from before prompt_is_token_ids existed sends client_index at position 10.
    names = [f.name for f in SCHEMA.structs["EngineCoreRequest"].fields]
    body = msgspec.msgpack.decode(request_body())
    body[names.index("prompt_is_token_ids")] = 1
    message = decode(Channel.INPUT, TO_ENGINE, [b"\x00", encode(body)])
    assert message.kind is Kind.ADD
    [flag] = message.flags
    assert (flag.issue, flag.field, flag.position, flag.got) == ("type_mismatch", "prompt_is_token_ids", 10, "int")


def test_extra_trailing_positions_are_kept_and_flagged():
    body = msgspec.msgpack.decode(request_body()) + ["new", 7]
    message = decode(Channel.INPUT, TO_ENGINE, [b"\x00", encode(body)])
    n = len(SCHEMA.structs["EngineCoreRequest"].fields)
    assert message.fields[f"${n}"] == "new" and message.fields[f"${n + 1}"] == 7
    assert [(f.issue, f.position) for f in message.flags] == [("extra_position", n), ("extra_position", n + 1)]


def test_missing_required_position_and_registration_key_are_flagged():
    short = decode(Channel.INPUT, TO_ENGINE, [b"\x00", encode(["only-an-id"])])
    assert {f.field for f in short.flags if f.issue == "missing_required"} >= {"prompt_token_ids", "arrival_time"}
    registration = decode(Channel.INPUT, TO_FRONTEND, [encode({"max_model_len": 256})])
    missing = {f.field for f in registration.flags if f.issue == "missing_required"}
    assert {"block_size", "vllm_version", "num_gpu_blocks"} <= missing


def test_unknown_sampling_key_is_flagged():
    message = decode(Channel.INPUT, TO_ENGINE, [b"\x00", request_body(sampling_params={"temperatur": 0.5})])
    [flag] = message.flags
    assert (flag.struct, flag.issue, flag.field) == ("SamplingParams", "unknown_key", "temperatur")


def test_inline_and_aux_frame_tensors_resolve():
    aux: list[bytes] = []
    ids = (3).to_bytes(8, "little") * 40  # 320 bytes: over the threshold, goes to an aux frame
    logprobs = struct_value(SCHEMA, "LogprobsLists", {
        "logprob_token_ids": tensor("<i8", [1, 40], ids, aux),
        "logprobs": tensor("<f4", [1, 2], b"\x00\x00\x80\xbf" * 2, aux),
        "sampled_token_ranks": tensor("<i8", [1], (1).to_bytes(8, "little"), aux),
        "cu_num_generated_tokens": None,
    })
    body = encode(struct_value(SCHEMA, "EngineCoreOutputs", {
        "outputs": [{"request_id": "r", "new_token_ids": [3], "new_logprobs": logprobs}]}))
    message = decode(Channel.OUTPUT, TO_FRONTEND, [body, *aux])
    resolved = message.fields["outputs"][0]["new_logprobs"]
    assert resolved["logprob_token_ids"] == Tensor("<i8", [1, 40], 320, aux_frame=1, values=[3] * 40)
    assert resolved["logprobs"].values == [-1.0, -1.0] and resolved["logprobs"].aux_frame is None
    assert resolved["sampled_token_ranks"].values == [1]


def test_tensor_with_missing_aux_frame_reports_it():
    missing = ["<i8", [1], 5]  # refers to aux frame 5 of a one-frame message
    body = encode(struct_value(SCHEMA, "EngineCoreOutputs", {
        "outputs": [{"request_id": "r", "new_token_ids": [3],
                     "new_logprobs": [missing, missing, missing, None]}]}))
    resolved = decode(Channel.OUTPUT, TO_FRONTEND, [body]).fields["outputs"][0]["new_logprobs"]
    assert "aux frame 5" in resolved["logprob_token_ids"].error


def test_pickle_ext_types_stay_opaque():
    # ext 1 = pickle: a payload that would run code if unpickled
    evil = b"cos\nsystem\n(S'echo pwned'\ntR."
    body = encode([0, 5, "collective_rpc", [msgspec.msgpack.Ext(1, evil), msgspec.msgpack.Ext(2, b"cloud")]])
    fields = decode(Channel.INPUT, TO_ENGINE, [b"\x03", body]).fields
    assert fields["args"] == [Ext(1, evil), Ext(2, b"cloud")]


def test_a_registration_is_named_with_the_release_it_announces():
    # 0.28.0's registration lacks max_loras, which the newest schema requires: no flag under its own.
    sample = {"int": 1, "str": "x", "bool": False, "float": 1.0, "nil": None, "map": {}, "array": [], "any": None}
    registration = {f.name: sample[f.kinds[0]] for f in load_schema("0.28.0").structs["EngineCoreReadyResponse"].fields}
    message = WireDecoder().decode(Channel.INPUT, TO_FRONTEND, [encode({**registration, "vllm_version": "0.28.0"})])
    assert (message.kind, message.flags) == (Kind.REGISTRATION, ())


def test_registration_switches_to_the_engines_release():
    decoder = WireDecoder()
    assert decoder.schema.release == "0.34.0" and not decoder.schema_exact  # the newest, until told
    decoder.decode(Channel.INPUT, TO_FRONTEND, [encode({"vllm_version": "0.31.0+cpu"})])
    assert (decoder.vllm_version, decoder.schema.release, decoder.schema_exact) == ("0.31.0+cpu", "0.31.0", True)
    decoder.decode(Channel.INPUT, TO_FRONTEND, [encode({"vllm_version": "0.31.7"})])
    assert (decoder.schema.release, decoder.schema_exact) == ("0.31.0", False)
