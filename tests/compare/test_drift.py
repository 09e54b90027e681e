"""Drift between the two languages inside one release, from the shipped schemas of both (``schema drift``)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec

from replay_proxy.compare.drift import drift_findings
from replay_proxy.compare.findings import RUST_FRONTEND, PYTHON_FRONTEND, Severity
from replay_proxy.compare.rules import load_rules
from replay_proxy.wire.rust import pair_structs
from replay_proxy.wire.registry import load_rust_schema, load_schema

HANDLED = load_rules().frontend_handled_sampling_keys
HANDSHAKE = Path(__file__).parents[1] / "wire" / "fixtures" / "rust-0.34.0"


def drift(release: str) -> dict[tuple[str, str], object]:
    return {(f.struct, f.field): f for f in drift_findings(load_schema(release), load_rust_schema(release), HANDLED)}


def test_the_rust_structs_are_paired_with_the_python_classes_they_mirror():
    pairs = pair_structs(load_schema("0.34.0"), load_rust_schema("0.34.0"))
    assert pairs["EngineCoreOutputs"] == "WireEngineCoreOutputs"  # by name, Wire aside
    assert pairs["SamplingParams"] == "EngineCoreSamplingParams"  # EngineCore aside
    assert pairs["LogprobsLists"] == "WireLogprobs"  # through a field, and a wire form (MaybeWireLogprobs)


def test_vllm_pr_45557_a_registration_without_block_size_is_found_in_0_23_0():
    """The Rust EngineCoreReadyResponse lacked the required block_size: a Python frontend rejects a Rust-encoded
    registration (vLLM's mock engine found it by hand)."""
    found = drift("0.23.0")[("EngineCoreReadyResponse", "block_size")]
    assert found.severity is Severity.BREAKING and found.breaks == (PYTHON_FRONTEND,), found.message
    assert ("EngineCoreReadyResponse", "block_size") not in drift("0.24.0")


def test_vllm_pr_52703_a_sampling_parameter_only_python_had_is_found_until_0_28_0():
    found = drift("0.28.0")[("SamplingParams", "routed_experts_prompt_start")]
    assert found.severity is Severity.WARNING and "the engine applies its default" in found.message
    assert ("SamplingParams", "routed_experts_prompt_start") not in drift("0.29.0")
    # Keys a frontend handles itself are no such gap.
    assert drift("0.28.0")[("SamplingParams", "detokenize")].severity is Severity.INFO


def test_0_32_0_s_lora_request_is_misread_across_the_languages():
    """Python 0.32.0 removed LoRARequest.tensorizer_config_dict (position 4); its Rust frontend still sends it."""
    found = drift("0.32.0")[("LoRARequest", "load_inplace")]
    assert (found.code, found.position, found.severity) == ("position_differs", 4, Severity.BREAKING)
    assert ("LoRARequest", "load_inplace") not in drift("0.33.0")


def test_a_field_added_on_one_side_only_in_a_copy_of_a_release_s_source_is_named(tmp_path):
    source = tmp_path / "protocol"
    shutil.copytree(HANDSHAKE, source)
    handshake = source / "handshake.rs"
    text = handshake.read_text()
    anchor = "    pub enable_expert_parallel: bool,\n"
    assert anchor in text
    handshake.write_text(text.replace(anchor, anchor + "    /// A field Python never sends.\n"
                                                      "    pub weights_digest: String,\n", 1))
    result = subprocess.run([sys.executable, "-m", "replay_proxy", "schema", "drift", "--release", "0.34.0",
                             "--rust-src", str(source)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 3, result.stdout + result.stderr
    assert "EngineCoreReadyResponse.weights_digest" in result.stdout and "only_in_rust" in result.stdout
    unchanged = subprocess.run([sys.executable, "-m", "replay_proxy", "schema", "drift", "--release", "0.34.0",
                                "--rust-src", str(HANDSHAKE)], capture_output=True, text=True, timeout=60)
    assert unchanged.returncode == 0, unchanged.stdout + unchanged.stderr


def test_a_reader_that_rejects_only_what_the_other_language_writes_is_named():
    found = drift("0.23.0")[("EngineCoreReadyResponse", "block_size")]
    assert RUST_FRONTEND not in found.breaks  # vllm-rs reads Python's registration: the extra key is ignored


def test_a_value_of_a_python_enum_that_the_rust_enum_lacks_is_a_rejection_by_vllm_rs():
    """0.34.0's FinishReason and Rust's EngineCoreFinishReason agree (0 to 4); a Python enum grown by one value
    (as a release could) is an output finish reason the Rust frontend cannot read."""
    python, rust = load_schema("0.34.0"), load_rust_schema("0.34.0")
    assert ("EngineCoreOutput", "finish_reason") not in drift("0.34.0")
    grown = msgspec.structs.replace(python, enums={**python.enums, "FinishReason": {
        **python.enums["FinishReason"], "TIMEOUT": 5}})
    [found] = [f for f in drift_findings(grown, rust) if f.code == "enum_value_only_in_python"]
    assert (found.struct, found.field, found.severity, found.breaks) == (
        "EngineCoreOutput", "finish_reason", Severity.BREAKING, (RUST_FRONTEND,))
    assert "TIMEOUT (5)" in found.message and "EngineCoreFinishReason" in found.message


def test_a_python_string_that_rust_reads_as_a_closed_enum_is_a_warning_where_the_engine_writes_it():
    found = drift("0.34.0")
    dtype, backend = found[("EngineCoreReadyResponse", "dtype")], found[("StructuredOutputsParams", "_backend")]
    assert dtype.severity is Severity.WARNING and "one of float16, bfloat16, float32 in Rust" in dtype.message
    assert backend.severity is Severity.INFO  # the frontend writes requests: no Rust reader in production
