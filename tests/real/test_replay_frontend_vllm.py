"""Replay a real recording against real frontends, with no engine running: the proxy is the engine.

The recording (recordings/vllm-0.32.0-python.db) was made by our recorder
between the Python frontend and a headless vLLM 0.32.0 engine.
"""

import msgspec
import pytest
import sqlite_utils

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
    def edit(path):
        db = sqlite_utils.Database(path)
        row = next(db.query("SELECT session_id, seq, raw FROM frames WHERE kind = 'REGISTRATION'"))
        [payload] = msgspec.msgpack.decode(row["raw"])
        registration = msgspec.msgpack.decode(payload)
        del registration[key]
        db["frames"].update((row["session_id"], row["seq"]), {
            "raw": msgspec.msgpack.encode([msgspec.msgpack.encode(registration)])})
    return edit


def test_vllm_rs_rejecting_a_registration_is_a_finding_that_names_it(tmp_path):
    result, findings = replay(tmp_path, lambda http, rpc: peers.rust_frontend_argv(http, rpc, "0.32.0"),
                              edit=without_registration_key("block_size"))
    assert result.returncode == 6, result.stdout + result.stderr
    message = findings[("replay_failed", None)]["message"]
    assert "REGISTRATION (engine 0, API server 0)" in message
    assert "its log says: " in message and "block_size" in message
    print(message)
