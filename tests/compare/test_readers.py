"""The readers' rules: vllm-rs's, where a Rust struct's declaration decides them, read from its release's source."""

from replay_proxy.compare.findings import PYTHON_FRONTEND, RUST_FRONTEND
from replay_proxy.compare.readers import reader_schema, source, verdict


def test_vllm_rs_ignores_an_outputs_extra_elements_from_the_release_that_reads_it_through_allow_trailing_fields():
    """0.31.0's output.rs reads EngineCoreOutputs.outputs as Vec<AllowTrailingFields<EngineCoreOutput>>;
    0.30.0's does not, and neither lets EngineCoreOutputs itself run long (pinned by the real binaries:
    tests/real/test_readers_vllm.py)."""
    rule = "extra_trailing_elements"
    assert verdict(RUST_FRONTEND, rule, "EngineCoreOutput", "0.30.0") == "rejects"
    assert verdict(RUST_FRONTEND, rule, "EngineCoreOutput", "0.31.0") == "ignores"
    assert "AllowTrailingFields" in source(RUST_FRONTEND, rule, "EngineCoreOutput", "0.31.0")
    assert verdict(RUST_FRONTEND, rule, "EngineCoreOutputs", "0.31.0") == "rejects"
    assert verdict(PYTHON_FRONTEND, rule, "EngineCoreOutputs", "0.31.0") == "ignores"


def test_vllm_rs_requires_what_its_rust_struct_requires():
    """The registration as each reader of 0.34.0 lays it out: an Option in Rust is not required where Python
    requires it (dp_stats_address), and the keys only Python declares are no part of vllm-rs's layout."""
    python, rust = (reader_schema(r, "0.34.0").structs["EngineCoreReadyResponse"] for r in (PYTHON_FRONTEND,
                                                                                            RUST_FRONTEND))
    assert python.by_name["dp_stats_address"].required and not rust.by_name["dp_stats_address"].required
    assert rust.by_name["block_size"].required
    assert set(python.by_name) - set(rust.by_name) == {"coord_store_port", "coordinator_input_address",
                                                       "coordinator_output_address", "mamba_block_size"}
