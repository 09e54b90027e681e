"""A cut of a real recording replays alone against a real engine: what a CI fixture made by `cut` does."""

import sqlite3

import pytest

from replay_proxy.store.cut import Selection, cut_database
from tests.real import peers

pytestmark = pytest.mark.real_vllm


def test_a_cut_of_five_requests_replays_against_a_real_engine_with_nothing_regressed(tmp_path):
    source = tmp_path / "source.db"
    source.write_bytes(peers.RECORDING.read_bytes())
    requests = [r for (r,) in sqlite3.connect(source).execute("SELECT request_id FROM requests ORDER BY seq")]
    assert len(requests) > 5  # a cut, not the whole session
    cut = tmp_path / "cut.db"
    cut_database(source, cut, "python-frontend", Selection(requests=requests[:5]), name="python-frontend")
    port = peers.free_port()
    result, report = peers.replay_cli(tmp_path, "--against", "engine", "--listen", f"tcp://127.0.0.1:{port}",
                                      "--engine-cmd", peers.engine_command(port), recording=cut)
    regressed = [f for f in report["findings"] if f["category"] in ("replay", "schema", "behaviour")
                 and f["severity"] in ("breaking", "regression")]
    assert regressed == [], result.stderr[-2000:]
    assert result.returncode in (0, 5)  # 5: timing only, never judged here
    replayed = sqlite3.connect(tmp_path / "replay.db").execute(
        "SELECT COUNT(*) FROM requests WHERE session_id = (SELECT MAX(id) FROM sessions)").fetchone()[0]
    assert replayed == 5
