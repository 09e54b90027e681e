"""A reader's rejection named as the schema break it is, from what real readers said.

The complaints are real: vllm-rs's HTTP 500 bodies and vLLM's msgspec log lines, as the matrix's runs
kept them (docs/compatibility.db) and the real tests see them.
"""

from replay_proxy.compare.findings import RUST_FRONTEND, Finding, Severity, exit_code
from replay_proxy.compare.rejection import fold_consequences, read_as, reader_rejections
from replay_proxy.compare.rules import load_rules
from replay_proxy.errors import ExitCode
from replay_proxy.wire.messages import Kind, Message, Side
from replay_proxy.wire.registry import load_schema

RULES = load_rules()
V32 = load_schema("0.32.0")


def http_500(request: str, expected: int) -> str:
    return (f'the HTTP request failed: HTTP 500: {{"error":{{"message":"failed to submit completion request: '
            f"engine-core error: messagepack decode failed for vllm_engine_core_client::protocol::output::"
            f'EngineCoreOutputs: array had incorrect length, expected {expected}; value fallback: [0, [["{request}", '
            f'[17, 9]]]]"}}}}')


def rejections(*said: str, schema=V32, side=Side.FRONTEND, last_sent=()):
    """``last_sent``: kinds of message (or, for a utility call, messages), latest first."""
    return reader_rejections(said, schema, side, RULES,
                             [read_as(m if isinstance(m, Message) else Message(kind=m)) for m in last_sent])


def test_a_length_rmp_serde_refused_is_the_trailing_field_it_has_no_room_for():
    # vllm-rs 0.31.0 reads an EngineCoreOutputs of 8 elements; 0.32.0 appended weight_version at position 8.
    [finding] = rejections(http_500("cmpl-1-0", 8), http_500("cmpl-2-0", 8))  # one rejection, however many requests
    assert (finding.code, finding.severity, finding.category) == ("reader_rejected", Severity.BREAKING, "schema")
    assert (finding.struct, finding.position, finding.field) == ("EngineCoreOutputs", 8, "weight_version")
    assert finding.breaks == (RUST_FRONTEND,)
    assert "array had incorrect length, expected 8" in finding.message and "cmpl-1-0" not in finding.message


def test_a_length_refused_inside_the_named_message_is_found_in_the_nested_struct():
    # vllm-rs 0.30.0 names the message it decoded, EngineCoreOutputs, but refused each EngineCoreOutput (17
    # elements in 0.30.0, 18 in 0.32.0): the nested struct whose length is nearest the reader's.
    [finding] = rejections(http_500("cmpl-1-0", 17))
    assert (finding.struct, finding.position, finding.field) == ("EngineCoreOutput", 17, "prompt_token_id_logprobs")


def test_a_missing_registration_key_names_the_key():
    rust = ("frontend under test exited with code 1 during the replay:\nits log says: decode failed for "
            "vllm_engine_core_client::protocol::handshake::EngineCoreReadyResponse: missing field `supports_lora`; "
            "value fallback: {\"max_model_len\": 64}")
    python = "msgspec.ValidationError: Object missing required field `supports_lora`"
    # msgspec names no struct: it is the struct of a message the peer was last sent that has that field.
    last_sent = [Kind.READY, Kind.REGISTRATION, Kind.HELLO]
    for said in (rust, python):
        [finding] = rejections(said, schema=load_schema("0.31.0"), last_sent=last_sent)
        assert (finding.struct, finding.field) == ("EngineCoreReadyResponse", "supports_lora"), said


def test_a_path_msgspec_gives_is_walked_through_the_schema():
    said = "msgspec.ValidationError: Expected `int`, got `str` - at `$[1][0][6]`"
    [finding] = rejections(said, last_sent=[Kind.OUTPUTS])
    assert (finding.struct, finding.position, finding.field) == ("EngineCoreOutput", 6, "stop_reason")
    [request] = rejections("msgspec.ValidationError: Expected `array`, got `int` - at `$[2]`", side=Side.ENGINE,
                           last_sent=[Kind.ADD])
    assert (request.struct, request.position, request.field) == ("EngineCoreRequest", 2, "mm_features")


def test_a_lora_request_a_0_31_0_engine_refuses_is_named_in_the_add_and_in_the_add_lora_call():
    """vLLM 0.32.0 removed LoRARequest.tensorizer_config_dict (position 4). A 0.31.0 engine, sent 0.32.0's
    LoRARequest, says (real log lines) where it got a bool for that dict: inside an ADD, and as add_lora's
    argument, which its EngineCore converts to its own LoRARequest. Of the structs it was last sent, the
    complaint is about the one whose field there sends a bool: load_inplace, now at position 4."""
    add_lora = Message(kind=Kind.UTILITY, fields={"method": "add_lora", "args": []})
    assert read_as(add_lora) == "LoRARequest"
    last_sent = [Kind.ADD, add_lora, Kind.ADD]
    in_add, as_argument = rejections(
        "msgspec.ValidationError: Expected `object | null`, got `bool` - at `$[6][4]`",
        "(EngineCore pid=13324) ERROR msgspec.ValidationError: Expected `object | null`, got `bool` - at `$[4]`",
        side=Side.ENGINE, last_sent=last_sent)
    for finding in (in_add, as_argument):
        assert (finding.struct, finding.position, finding.field) == ("LoRARequest", 4, "load_inplace"), finding


def test_what_is_not_a_readers_complaint_is_no_rejection():
    assert rejections("OSError: It looks like the config file at '/tmp/m/config.json' is not a valid JSON file.",
                      "the HTTP request failed: URLError: <urlopen error [Errno 111] Connection refused>") == []


def test_the_failures_a_rejection_caused_are_listed_under_it_not_as_regressions():
    [rejection] = rejections(http_500("cmpl-1-0", 8))
    failed = [Finding("behaviour", Severity.REGRESSION, "http_failed", http_500(f"cmpl-{i}-0", 8), request_id=f"r{i}")
              for i in range(3)]
    # After the first rejection vllm-rs fails every request, not always with the complaint: an empty stream, an
    # ADD never sent. Those are its consequences too.
    empty = Finding("behaviour", Severity.REGRESSION, "http_response_differs", "the user got 0 tokens (None)",
                    request_id="r3")
    unsent = Finding("behaviour", Severity.REGRESSION, "request_unmatched", "no counterpart", request_id="r4")
    # What the frontend sends is its own doing, whatever it later could not read.
    sampling = Finding("behaviour", Severity.REGRESSION, "sampling_key_changed", "watermarking: another value",
                       struct="SamplingParams", field="watermarking")
    info = Finding("schema", Severity.INFO, "sampling_key_order", "another key order")
    before = [*failed, empty, unsent, sampling, info, rejection]
    assert exit_code(before) is ExitCode.SCHEMA_BREAKING  # the rejection already decides the exit code ...
    folded = fold_consequences(before, RULES)
    [named] = [f for f in folded if f.code == "reader_rejected"]
    assert [c.split(":")[0] for c in named.consequences] == [
        "http_failed [r0]", "http_failed [r1]", "http_failed [r2]", "http_response_differs [r3]",
        "request_unmatched [r4]"]
    assert folded == [sampling, info, named]  # ... and what it did not cause stays a finding of its own
    assert exit_code(folded) is ExitCode.SCHEMA_BREAKING
    assert fold_consequences([*failed, info], RULES) == [*failed, info]  # no rejection named: nothing moves


def test_the_length_that_was_sent_decides_where_it_was_not_the_schemas():
    # A frame whose EngineCoreOutputs had 10 elements though its release lays out 9 (a drifted engine): vllm-rs
    # 0.32.0 refusing it (expected 9) refused the sent EngineCoreOutputs, at the first element it has no room for.
    [finding] = rejections(http_500("cmpl-1-0", 9))
    assert finding.struct != "EngineCoreOutputs"  # by the schema alone, 9 is EngineCoreOutputs' own length
    [sent] = reader_rejections([http_500("cmpl-1-0", 9)], V32, Side.FRONTEND, RULES,
                               lengths={"EngineCoreOutputs": 10, "EngineCoreOutput": 18})
    assert (sent.struct, sent.position, sent.field) == ("EngineCoreOutputs", 9, None)
