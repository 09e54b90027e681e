"""A soak of 200,000 frames through `replay-proxy record`: every count exact, in every table.

The peers are scripts/bench/busy.py's (a minimal frontend and engine doing the
real 0.32.0 handshake); nothing here depends on how fast this machine is, only
on nothing being lost or counted twice.
"""

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.soak  # the full suite runs it; --fast does not

ROOT = Path(__file__).resolve().parents[2]
STEPS = 100_000  # engine steps, each with an ADD: 200,004 frames with the handshake


def test_200k_frames_through_record_are_all_recorded_and_counted_once(tmp_path):
    # --on-full block: lossless whatever this machine's speed (with drop, what is dropped is counted
    # exactly, but how much depends on the machine).
    db = tmp_path / "soak.db"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "busy.py"), "--frames", str(STEPS),
                          "--outputs", "4", "--rate", "20000", "--json", "--db", str(db), "--on-full", "block"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    # forwarded, every one (the proxy is stopped once the engine has every ADD)
    assert result["peers"] == {"adds_sent": STEPS, "adds_received": STEPS, "outputs_received": STEPS}
    assert result["proxy_exit"] == 0
    # The writer process was found and measured (by its module's name: a move of the module lost it once).
    assert result["writer_rss_mb_max"] and result["cpu_s_per_million_frames"].keys() >= {"proxy", "writer"}
    frames = 2 * STEPS + 4
    session = result["session"]
    assert (session["seen"], session["recorded"], session["dropped"], session["status"]) == (
        frames, frames, 0, "complete")
    tables = result["in_tables"]
    assert tables["frames"] + tables["undecoded"] == frames == session["recorded"]
    # Whatever the writer kept undecoded when it stopped, decode finishes; then every table is exact.
    decode = subprocess.run([sys.executable, "-m", "replay_proxy", "decode", "--db", str(db)], capture_output=True,
                            text=True, timeout=600, cwd=ROOT)
    assert decode.returncode == 0, decode.stderr
    connection = sqlite3.connect(db)
    counts = connection.execute(
        "SELECT (SELECT COUNT(*) FROM frames), (SELECT COUNT(DISTINCT seq) FROM frames), (SELECT SUM("
        "json_array_length(outputs)) FROM frame_outputs), (SELECT COUNT(*) FROM requests), (SELECT COUNT(*) FROM "
        "undecoded), (SELECT frames_undecoded "
        "FROM sessions)").fetchone()
    assert counts == (frames, frames, 4 * STEPS, STEPS, 0, 0)
    # Numbered as forwarded: no gap, no repeat.
    assert connection.execute("SELECT MIN(seq), MAX(seq) FROM frames").fetchone() == (1, frames)
