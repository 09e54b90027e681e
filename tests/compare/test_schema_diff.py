"""The real changes between shipped release schemas, pinned."""

import json
import subprocess
import sys

from replay_proxy.compare.findings import PYTHON_ENGINE, PYTHON_FRONTEND, RUST_FRONTEND, Severity
from replay_proxy.compare.schema_diff import diff_schemas, readers
from replay_proxy.wire.registry import load_schema


def breaking(old, new):
    return {(f.code, f.struct, f.field, f.position, f.breaks)
            for f in diff_schemas(load_schema(old), load_schema(new)) if f.severity == Severity.BREAKING}


def test_0_31_to_0_32():
    assert breaking("0.31.0", "0.32.0") == {
        ("field_appended", "EngineCoreOutputs", "weight_version", 8, (RUST_FRONTEND,)),
        ("field_removed", "LoRARequest", "tensorizer_config_dict", 4, (PYTHON_ENGINE,)),
        ("type_changed", "SamplingParams", "watermarking", None, (PYTHON_ENGINE,)),
        ("type_changed", "SamplingParams", "prompt_logprob_token_ids", None, (PYTHON_ENGINE,)),
        # profile() gained two parameters: a 0.32.0 frontend passing them fails on a 0.31.0 engine.
        ("utility_signature_changed", "utility_methods", "profile", None, (PYTHON_ENGINE,)),
    }


def test_0_30_to_0_31():
    # Appended to each output: vllm-rs 0.30.0 rejects it (it serves such outputs only from 0.31.0 on,
    # pinned in tests/real/test_readers_vllm.py), Python readers skip it.
    assert breaking("0.30.0", "0.31.0") == {
        ("field_appended", "EngineCoreOutput", "prompt_token_id_logprobs", 17, (RUST_FRONTEND,)),
    }
    compatible = {(f.code, f.struct, f.field) for f in diff_schemas(load_schema("0.30.0"), load_schema("0.31.0"))
                  if f.severity == Severity.INFO}
    # Appended to a request the Python engine reads: older engines skip it.
    assert ("field_appended", "EngineCoreRequest", "kv_hints") in compatible
    assert ("key_added", "EngineCoreReadyResponse", "effective_attention_block_size") in compatible


def test_readers_follow_the_direction_of_each_struct():
    schema = load_schema("0.32.0")
    assert readers(schema, "SamplingParams") == (PYTHON_ENGINE,)
    assert readers(schema, "EngineHandshakeMetadata") == (PYTHON_ENGINE,)
    assert RUST_FRONTEND in readers(schema, "EngineCoreOutput")
    assert RUST_FRONTEND in readers(schema, "EngineCoreReadyResponse")


def test_identical_releases_have_no_findings():
    assert diff_schemas(load_schema("0.32.0"), load_schema("0.32.0")) == []


def test_cli_exit_code_and_reports(tmp_path):
    result = subprocess.run([sys.executable, "-m", "replay_proxy", "schema", "diff", "0.31.0", "0.32.0",
                             "--report-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["exit_code"] == 3 and report["findings"][0]["severity"] == "breaking"
    assert "LoRARequest" in (tmp_path / "report.html").read_text()
    same = subprocess.run([sys.executable, "-m", "replay_proxy", "schema", "diff", "0.32.0", "0.32.0"],
                          capture_output=True, text=True, timeout=60)
    assert same.returncode == 0


def test_a_key_that_python_requires_breaks_vllm_rs_only_where_its_own_rust_struct_requires_it():
    """0.23.0 made block_size a required registration key; vllm-rs 0.23.0's Rust struct had no block_size yet
    (vLLM PR 45557), so a 0.22.1 engine's registration breaks the Python frontend only."""
    [added] = [f for f in diff_schemas(load_schema("0.22.1"), load_schema("0.23.0"))
               if (f.code, f.field) == ("key_added", "block_size")]
    assert added.breaks == (PYTHON_FRONTEND,) and "rust-frontend does not require it" in added.message
    [required] = [f for f in diff_schemas(load_schema("0.22.1"), load_schema("0.23.0"))
                  if (f.code, f.field) == ("became_required", "dtype")]
    assert required.breaks == (PYTHON_FRONTEND, RUST_FRONTEND)  # a ModelDtype, no Option, in handshake.rs
