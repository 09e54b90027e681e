"""Reading never writes: every reading command works on recordings it may not write (a read-only bind mount, as a
CI container mounts its fixtures), on an older recording (read through this version's layout, not migrated), and
on one a live writer holds (it reads what the writer committed)."""

import hashlib
import shlex
import shutil
import sqlite3
import subprocess

import pytest

from replay_proxy.processes import free_port
from tests.helpers import CLI, ROOT, cli, engines_command

DEMO = ROOT / "recordings" / "demo.db"
MATRIX = ROOT / "docs" / "compatibility.db"


def older_copy(path):
    """A copy of the demo recording at ``path`` laid out as a release before the engine's clock was a column of
    ``frames`` (and before the layout had a version)."""
    shutil.copy(DEMO, path)
    with sqlite3.connect(path) as db:
        for (view,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'view'").fetchall():
            db.execute(f"DROP VIEW [{view}]")
        db.execute("ALTER TABLE frames DROP COLUMN engine_time_s")
        db.execute("PRAGMA user_version = 0")
    db.close()
    return path


def in_read_only_mount(source, target, argv, cwd):
    """``argv`` run where ``target`` is ``source`` mounted read-only (a mount namespace of its own: the mount is
    gone with the command)."""
    mount = (f"mount --bind {shlex.quote(str(source))} {shlex.quote(str(target))} && "
             f"mount -o remount,ro,bind {shlex.quote(str(target))} && exec \"$@\"")
    return subprocess.run(["unshare", "-m", "sh", "-c", mount, "sh", *argv], capture_output=True, text=True,
                          timeout=180, cwd=cwd)


@pytest.fixture
def mounted(tmp_path):
    """A folder of the committed fixtures, ``ro``, read-only to the commands run with ``in_read_only_mount``."""
    fixtures, ro = tmp_path / "fixtures", tmp_path / "ro"
    fixtures.mkdir()
    ro.mkdir()
    for fixture in (DEMO, ROOT / "recordings" / "vllm-0.32.0-python.db", MATRIX):
        shutil.copy(fixture, fixtures)
    older_copy(fixtures / "older.db")
    probe = in_read_only_mount(fixtures, ro, ["touch", str(ro / "written")], tmp_path)
    if "Read-only file system" not in probe.stderr:
        pytest.skip(f"no read-only bind mount here (unshare -m needs CAP_SYS_ADMIN): {probe.stderr.strip()}")
    return fixtures, ro


def test_every_reading_command_works_on_a_read_only_mount(mounted, tmp_path):
    fixtures, ro = mounted
    out = tmp_path / "out"
    out.mkdir()
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in fixtures.iterdir()}
    listen = f"tcp://127.0.0.1:{free_port()}"
    commands = {
        "sessions": ["sessions", "--db", f"{ro}/demo.db"],
        "query": ["query", "--db", f"{ro}/demo.db", "--preset", "frames-by-kind"],
        "query an older recording": ["query", "--db", f"{ro}/older.db", "--preset", "slowest-requests"],
        "diff an older recording": ["diff", "--db", f"{ro}/older.db", "--baseline-db", f"{ro}/demo.db", "--baseline",
                                    "demo", "--candidate", "demo"],
        "replay": ["replay", "--db", f"{ro}/demo.db", "--session", "demo", "--against", "engine", "--listen", listen,
                   "--engine-cmd", engines_command(listen, engines=2), "--pace", "fast", "--out", f"{out}/replay.db"],
        "diff": ["diff", "--db", f"{ro}/demo.db", "--baseline", "demo", "--candidate", "demo"],
        "cut": ["cut", "--db", f"{ro}/demo.db", "--session", "demo", "--sample", "3", "--out", f"{out}/cut.db"],
        "export": ["export", "--db", f"{ro}/vllm-0.32.0-python.db", "--parquet", f"{out}/lake"],
        "redact": ["redact", "--db", f"{ro}/demo.db", "--out", f"{out}/redacted.db", "--key-file", f"{out}/key",
                   "--vocab-size", "1000"],
        "readers": ["readers", "--db", f"{ro}/vllm-0.32.0-python.db", "--session", "python-frontend"],
        "can-i-deploy": ["can-i-deploy", "--frontend", "vllm==0.32.0", "--engine", "vllm==0.32.0", "--db",
                         f"{ro}/compatibility.db"],
    }
    (out / "key").write_bytes(bytes(range(32)))
    for name, argv in commands.items():
        done = in_read_only_mount(fixtures, ro, [*CLI, *argv], out)
        assert done.returncode == 0, f"{name}: {done.stderr}"
        assert "observed" in done.stdout if name == "can-i-deploy" else True, done.stdout  # (the database was read)
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in fixtures.iterdir()} == before


def test_an_older_recording_is_read_in_this_versions_layout_and_left_as_it_was(tmp_path):
    older = older_copy(tmp_path / "older.db")
    before = hashlib.sha256(open(older, "rb").read()).hexdigest()
    done = cli("query", "--db", str(older), "--json",
               "SELECT COUNT(*) AS outputs, COUNT(engine_time_s) AS timed FROM outputs")
    assert done.returncode == 0, done.stderr
    assert '"timed": 0' not in done.stdout and '"outputs": 0' not in done.stdout, done.stdout  # (made from decoded)
    assert cli("sessions", "--db", str(older)).returncode == 0
    assert hashlib.sha256(open(older, "rb").read()).hexdigest() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["older.db"]


def test_a_recording_a_live_writer_holds_is_read_with_what_it_committed(tmp_path):
    live = shutil.copy(DEMO, tmp_path / "live.db")
    writer = sqlite3.connect(live)
    try:
        writer.execute("PRAGMA journal_mode = wal")
        writer.execute("PRAGMA wal_autocheckpoint = 0")  # (what it commits stays in the -wal, as a busy writer's)
        with writer:
            writer.execute("INSERT INTO sessions (name, mode, status) VALUES ('still-recording', 'record', "
                           "'recording')")
        done = cli("sessions", "--db", str(live))
        assert done.returncode == 0 and "still-recording" in done.stdout, done.stderr
    finally:
        writer.close()
