"""Replay a real recording against real frontends, with no engine running: the proxy is the engine.

The recording (recordings/vllm-0.32.0-python.db) was made by our recorder
between the Python frontend and a headless vLLM 0.32.0 engine.
"""

import json

import msgspec
import pytest

from replay_proxy.compare.rejection import REQUEST_FAILURES
from tests.helpers import edit_frames
from tests.real import peers

pytestmark = pytest.mark.real_vllm


def replay(tmp_path, argv, edit=None):
    http, rpc = peers.free_port(), peers.free_port()
    result, report = peers.replay_cli(tmp_path, "--against", "frontend", "--upstream", f"tcp://127.0.0.1:{rpc}",
                                      "--http", f"http://127.0.0.1:{http}",
                                      "--frontend-cmd", peers.command(argv(http, rpc)), edit=edit)
    return result, {(f["code"], f.get("field")): f for f in report["findings"]}


def test_the_python_frontend_against_its_own_recording_gives_nothing(tmp_path):
    result, findings = replay(tmp_path, peers.python_frontend_argv)
    assert result.returncode in (0, 5), result.stdout + result.stderr  # 5: timing only, never judged here
    assert [k for k, f in findings.items() if f["severity"] != "info" and f["category"] != "performance"] == []


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_vllm_rs_accepts_the_registration_and_serves_the_recorded_tokens(tmp_path, version):
    result, findings = replay(tmp_path, lambda http, rpc: peers.rust_frontend_argv(http, rpc, version))
    assert not any(code in ("replay_failed", "http_failed", "http_response_differs", "request_unexpected")
                   for code, _ in findings), result.stdout + result.stderr
    # The real differences between the Python and Rust frontends' requests, classified:
    assert findings[("sampling_key_order", None)]["severity"] == "info"  # another key order: compatible
    for key in ("top_k", "min_tokens", "routed_experts_prompt_start"):  # defaults Rust always sends
        assert findings[("sampling_key_default_sent", key)]["severity"] == "info"
    assert findings[("sampling_key_handled_by_the_frontend", "output_kind")]["severity"] == "info"
    assert findings[("sampling_key_f32", "temperature")]["severity"] == "info"
    # vllm-rs sends watermarking=true where the Python frontend sends false
    assert findings[("sampling_key_changed", "watermarking")]["severity"] == "regression"
    assert findings[("utility_call_missing", "reset_mm_cache")]["severity"] == "warning"
    assert result.returncode == 4


def without_registration_key(key):
    """Edit a recording as if its engine had not sent ``key`` in its registration (vLLM's real break)."""
    def without(parts):
        registration = msgspec.msgpack.decode(parts[0])
        del registration[key]
        return [msgspec.msgpack.encode(registration)]

    def edit(path):
        edit_frames(path, "kind = 'REGISTRATION'", without)
    return edit


def test_vllm_rs_rejecting_a_registration_is_a_finding_that_names_it(tmp_path):
    result, findings = replay(tmp_path, lambda http, rpc: peers.rust_frontend_argv(http, rpc, "0.32.0"),
                              edit=without_registration_key("block_size"))
    assert result.returncode == 3, result.stdout + result.stderr  # a schema break, not a replay that could not run
    rejected = findings[("reader_rejected", "block_size")]
    assert rejected["struct"] == "EngineCoreReadyResponse" and "missing field `block_size`" in rejected["message"]
    [stopped] = rejected["consequences"]
    assert "REGISTRATION (engine 0, API server 0)" in stopped and "its log says: " in stopped


def test_vllm_rs_031_rejecting_032s_outputs_is_one_schema_break_its_http_failures_under_it(tmp_path):
    # 0.32.0 appended weight_version to EngineCoreOutputs; vllm-rs 0.31.0 reads 8 elements and refuses 9. Before
    # replay named the rejection, this replay exited 4 with 11 behaviour regressions and no schema finding.
    result, findings = replay(tmp_path, lambda http, rpc: peers.rust_frontend_argv(http, rpc, "0.31.0"))
    assert result.returncode == 3, result.stdout + result.stderr
    rejected = findings[("reader_rejected", "weight_version")]
    assert (rejected["struct"], rejected["position"], rejected["severity"]) == ("EngineCoreOutputs", 8, "breaking")
    assert "array had incorrect length, expected 8" in rejected["message"]
    # Each request's failure (its HTTP 500, and its ADD never sent once the reader's client had failed) is a
    # consequence; what is left is what differs between the two frontends' requests, as for 0.32.0 above.
    assert len(rejected["consequences"]) >= 10, rejected
    assert {c.split(" ")[0] for c in rejected["consequences"]} <= set(REQUEST_FAILURES)
    report = json.loads((tmp_path / "report.json").read_text())
    assert not [f for f in report["findings"] if f.get("request_id") and f["severity"] == "regression"]
