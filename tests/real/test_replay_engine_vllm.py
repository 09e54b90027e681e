"""Replay a real recording against fresh real engines: the same release, then an older one.

The recording (recordings/vllm-0.32.0-python.db) was made by our recorder
between the Python frontend and a headless vLLM 0.32.0 engine.
"""

import pytest
import sqlite_utils

from replay_proxy.compare.rules import load_rules
from tests.real import peers

pytestmark = pytest.mark.real_vllm


def replay(tmp_path, release, baseline_release=None):
    port = peers.free_port()
    noise = ["--noise-runs", "1", "--baseline-cmd", peers.engine_command(port, baseline_release)] if baseline_release else []
    result, report = peers.replay_cli(tmp_path, "--against", "engine", "--listen", f"tcp://127.0.0.1:{port}",
                                      "--engine-cmd", peers.engine_command(port, release), *noise)
    return result, report, sqlite_utils.Database(tmp_path / "replay.db")


def significant(report, *categories):
    return [f for f in report["findings"] if f["category"] in categories and f["severity"] in ("breaking", "regression")]


def test_same_release_gives_the_same_tokens_and_abort_point(tmp_path):
    result, report, db = replay(tmp_path, "0.32.0")
    assert result.returncode in (0, 5), result.stderr  # 5: timing only, never asserted here
    assert significant(report, "schema", "behaviour", "replay") == []
    # The ABORT went at the recorded progress, however fast this machine's engine is.
    landed = {row["session_id"]: row["tokens_before_abort"] for row in db.query(
        "SELECT session_id, tokens_before_abort FROM abort_progress")}
    assert abs(landed[1] - landed[2]) <= load_rules()["abort_progress_tolerance_tokens"]
    [landing] = [f for f in report["findings"] if f["message_kind"] == "ABORT"]
    assert (landing["code"], landing["baseline"], landing["candidate"]) == ("abort_landed", landed[1], landed[2])
    replay_session = db["sessions"].get(2)
    assert (replay_session["mode"], replay_session["vllm_version"]) == ("replay", "0.32.0")


def test_an_older_engine_release_shows_its_real_differences_over_the_noise_floor(tmp_path):
    result, report, db = replay(tmp_path, "0.31.0", baseline_release="0.32.0")
    assert [(s["mode"], s["vllm_version"]) for s in db["sessions"].rows] == [
        ("record", "0.32.0"), ("replay", "0.32.0"), ("replay", "0.31.0")]
    assert report["noise"] == [f"{db['sessions'].get(2)['name']} (#2)"]
    codes = {(f["code"], f.get("struct"), f.get("position")) for f in report["findings"]}
    # 0.32.0 added EngineCoreOutputs.weight_version at position 8; a 0.31.0 engine sends 8 elements.
    assert ("array_shorter", "EngineCoreOutputs", 8) in codes
    (tmp_path / "findings.txt").write_text("\n".join(f"{f['severity']} {f['code']} {f['message']}"
                                                     for f in report["findings"]))
    print((tmp_path / "findings.txt").read_text())
