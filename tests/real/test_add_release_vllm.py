"""`replay-proxy add-release` for 0.34.0 as if it had just shipped: its schema extracted into the added
releases' folder (never the package), the changes since 0.33.0 said, its Rust frontend's schema read from its
sdist and the drift between its two languages said, its vllm-rs recorded against the sim
engine of 0.34.0 (no installed engine reads its prompt arrays), every message read by its own schema, and
its cell with a real 0.32.0 engine observed: breaks, the engine's decode error as evidence."""

import json
import os
import subprocess
import sys

import pytest
import sqlite_utils

from replay_proxy.wire.registry import RUST_SCHEMAS, SCHEMAS
from tests.real import peers

pytestmark = pytest.mark.real_vllm


def test_a_release_is_added_on_its_day_and_used_from_then_on(tmp_path):
    added, db = tmp_path / "added", tmp_path / "matrix.db"
    env = {**os.environ, "REPLAY_PROXY_ADDED_RELEASES": str(added)}
    shipped = (SCHEMAS / "0.34.0.json").read_bytes()
    result = subprocess.run([sys.executable, "-m", "replay_proxy", "add-release", "0.34.0", "--engines", "0.32.0",
                             "--db", str(db), "--report-dir", str(tmp_path / "work"), "--json",
                             "--ready-timeout", str(peers.READY_TIMEOUT_S)],
                            capture_output=True, text=True, timeout=peers.REPLAY_S + 300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    said = json.loads(result.stdout)
    assert (SCHEMAS / "0.34.0.json").read_bytes() == shipped  # the package untouched
    assert json.loads((added / "schemas" / "0.34.0.json").read_text()) == json.loads(shipped)
    assert said["previous"] == "0.33.0" and {"type_changed", "field_appended"} <= {c["code"] for c in said["changes"]}
    # Its Rust frontend's schema, read from its sdist, as the package ships it; no drift between its two languages
    # breaks a reader.
    assert json.loads((added / "rust_schemas" / "0.34.0.json").read_text()) == json.loads(
        (RUST_SCHEMAS / "0.34.0.json").read_text())
    assert said["drift"] and not [d for d in said["drift"] if d["severity"] >= 3]
    assert "[breaking] EngineCoreRequest.prompt_token_ids changed type list[int] | None -> ndarray | None" \
        in result.stderr
    assert said["engine"] == "sim 0.34.0" and said["unread"] == []
    assert [said["answers"][k] for k in ("completion", "chat", "stream", "seeded")] == ["ok"] * 4
    recording = sqlite_utils.Database(added / "recordings" / "vllm-0.34.0-vllm-rs.db")
    assert recording.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 5  # logprobs too (the sim has none)
    assert next(recording.query("SELECT frontend_release, frontend_source FROM sessions")) == {
        "frontend_release": "0.34.0", "frontend_source": "given"}
    [cell] = said["cells"]
    assert (cell["frontend"], cell["engine"], cell["observed"]["verdict"]) == ("vllm-rs:0.34.0", "0.32.0", "breaks")
    assert any("Expected `int`, got `str` - at `$[1][0]`" in e["message"] for e in cell["observed"]["evidence"])
    # From then on, every command reads it from there: can-i-deploy answers from the observed cell.
    answer = subprocess.run([sys.executable, "-m", "replay_proxy", "can-i-deploy", "--frontend", "vllm-rs==0.34.0",
                             "--engine", "vllm==0.32.0", "--db", str(db)], capture_output=True, text=True,
                            timeout=120, env=env)
    assert answer.returncode == 3 and "breaks (observed" in answer.stdout
