"""A really full filesystem: forwarding goes on, and the session still ends honestly.

A WAL-mode commit needs free space on the filesystem itself, which SQLite's own page cap
(`--max-db-mb`, tests/recorder/test_recorder.py) does not take away: so the recording goes to a real,
small tmpfs. The peers are scripts/bench/busy.py's (the real 0.32.0 handshake). Nothing here depends
on this machine's speed: a slower writer fills the filesystem later, or drops more, and either way the
session must end with its counts.
"""

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# As a user found it: 1,000 steps a second of 32 outputs into a 30 MB filesystem, full within about 10 s. The file
# is 0.4x the wire since (store/raw.py: the frames' bytes compressed; a row of outputs a step), so the filesystem is
# 16 MB (8 of them the room kept for the session's end); rotating, 30 MB, room for two files' ends.
# Before the room kept for the session's end (store/reserve.py), the writer's last transaction failed, then the
# recorder's, and the session stayed 'recording' with every count 0.
SECONDS, RATE, MEGABYTES, ROTATING_MEGABYTES = 15, 1000, 16, 30


@contextlib.contextmanager
def small_filesystem(folder: Path, megabytes: int):
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(folder)],
                             capture_output=True, text=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs could be mounted here ({mounted.stderr.strip()}): a full disk needs a real one")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], timeout=30, check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_filesystem_keeps_forwarding_and_the_session_ends_counted(tmp_path):
    steps = SECONDS * RATE
    with small_filesystem(tmp_path / "small", MEGABYTES) as small:
        db = small / "full.db"
        run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "busy.py"), "--seconds", str(SECONDS),
                              "--rate", str(RATE), "--outputs", "32", "--json", "--db", str(db)],
                             capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert run.returncode == 0, run.stderr[-2000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        # Forwarding never waited for the disk: every step and ADD crossed.
        assert result["peers"] == {"adds_sent": steps, "adds_received": steps, "outputs_received": steps}
        assert result["proxy_exit"] == 1  # an incomplete recording (docs/commands.md), not a crash
        # The session's end was written, with what crossed and what could not be kept: not left 'recording'.
        session = sqlite3.connect(db).execute(
            "SELECT status, frames_seen, frames_recorded, frames_dropped, error FROM sessions").fetchone()
        status, seen, recorded, dropped, error = session
        assert (status, seen) == ("incomplete", 2 * steps + 4), session
        assert 0 < recorded < seen and dropped == seen - recorded, session
        assert "full" in error, session
        assert not (small / "full.db.reserve").exists()  # given back to the session's end


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_filesystem_at_a_rotation_keeps_forwarding_and_every_file_ends_counted(tmp_path):
    """Rotating every second into a filesystem that fills: the rotations that find no room fail, are counted and
    tried again, forwarding goes on, and every file's session ends with its counts, which add up to what crossed."""
    steps = SECONDS * RATE
    with small_filesystem(tmp_path / "small", ROTATING_MEGABYTES) as small:
        db = small / "rotating.db"
        run = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "busy.py"), "--seconds", str(SECONDS),
                              "--rate", str(RATE), "--outputs", "32", "--json", "--db", str(db),
                              "--rotate-every", "1s"], capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert run.returncode == 0, run.stderr[-2000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert result["peers"] == {"adds_sent": steps, "adds_received": steps, "outputs_received": steps}
        assert result["proxy_exit"] == 1  # incomplete: frames were lost to the full disk (never to forwarding)
        summary, session = result["summary"], result["session"]
        assert summary["rotations"] >= 1 and summary["rotations_failed"] >= 1, summary
        # Each file that a rotation began is there, ended (none left 'recording', no half-made one), and the
        # files' counts add up to what crossed.
        assert result["files"] == summary["rotations"] + 1
        assert "recording" not in session["status"] and "incomplete" in session["status"], session
        assert session["seen"] == summary["frames_seen"] == 2 * steps + 4
        assert session["recorded"] + session["dropped"] == session["seen"] and session["dropped"] > 0
        assert session["recorded"] == summary["frames_recorded"]
