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


def test_a_release_being_added_is_read_by_vllm_rs_as_its_rust_structs_once_they_are_there(tmp_path, monkeypatch):
    """add-release writes a release's Python schema, judges against it, then writes its Rust schema: from then
    on vllm-rs's layout of it is the Rust one (0.34.0's files, under another release's name)."""
    import msgspec

    from replay_proxy.wire.registry import RUST_SCHEMAS, SCHEMAS, forget_schemas

    monkeypatch.setenv("REPLAY_PROXY_ADDED_RELEASES", str(tmp_path))
    for folder in ("schemas", "rust_schemas"):
        (tmp_path / folder).mkdir()
    as_added = lambda shipped: msgspec.json.encode({**msgspec.json.decode(  # noqa: E731
        (shipped / "0.34.0.json").read_bytes()), "release": "0.34.9"})
    (tmp_path / "schemas" / "0.34.9.json").write_bytes(as_added(SCHEMAS))
    forget_schemas()
    try:
        assert "vllm-rs" not in (reader_schema(RUST_FRONTEND, "0.34.9").extracted_from or "")
        assert verdict(RUST_FRONTEND, "extra_trailing_elements", "EngineCoreOutput", "0.34.9") == "rejects"
        (tmp_path / "rust_schemas" / "0.34.9.json").write_bytes(as_added(RUST_SCHEMAS))
        registration = reader_schema(RUST_FRONTEND, "0.34.9").structs["EngineCoreReadyResponse"]
        assert not registration.by_name["dp_stats_address"].required
        assert verdict(RUST_FRONTEND, "extra_trailing_elements", "EngineCoreOutput", "0.34.9") == "ignores"
    finally:
        monkeypatch.delenv("REPLAY_PROXY_ADDED_RELEASES")
        forget_schemas()
