"""``bisect`` stopped by SIGTERM (a cancelled CI job) while it installs a release: nothing of it is left running,
and the next run installs again. The install is the real one (scripts/setup-vllm.sh and its pip) into an empty
cache, made slow by a package index that takes connections and never answers."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from replay_proxy.processes import descendants

ROOT = Path(__file__).resolve().parents[2]


def ignoring_sigint() -> None:
    """As a job a shell started in the background runs (a CI runner's step): SIGINT ignored, which its children
    inherit, so the command must not count on it to unwind from SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def command_of(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""  # (gone meanwhile)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def bisect_until_installing(cache: Path, index: socket.socket) -> subprocess.Popen:
    """A bisect over engine releases that are not installed, once its install has asked ``index`` (a package
    index of its own, that takes connections and never answers) for a package."""
    env = {**os.environ, "REPLAY_PROXY_CACHE": str(cache), "PIP_INDEX_URL": f"http://127.0.0.1:{index.getsockname()[1]}/",
           "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "", "PIP_NO_INDEX": "", "PIP_DEFAULT_TIMEOUT": "300"}
    process = subprocess.Popen(
        [sys.executable, "-m", "replay_proxy", "bisect", "--db", str(ROOT / "recordings" / "vllm-0.31.0-python.db"),
         "--session", "python-frontend", "--against", "engine", "--releases", "0.30.0..0.31.0"],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        preexec_fn=ignoring_sigint)
    index.settimeout(240)
    try:
        index.accept()  # (held open, unanswered, until the test ends)
    except TimeoutError:
        process.kill()
        raise AssertionError(f"no install reached the index in 240 s: {process.communicate()[1][-2000:]!r}")
    return process


def test_a_bisect_stopped_during_its_install_leaves_no_process_and_the_next_one_installs_again(tmp_path):
    runs, indexes = [], []
    try:
        for run in range(2):  # the second: it removed the half-made venv and began again
            indexes.append(socket.create_server(("127.0.0.1", 0)))  # (a new one: the first's backlog is the first's)
            process = bisect_until_installing(tmp_path / "cache", indexes[-1])
            runs.append(process)
            installing = descendants(process.pid)
            assert len(installing) >= 2, "the install (bash, pip) runs under bisect"
            process.send_signal(signal.SIGTERM)
            _, stderr = process.communicate(timeout=60)
            assert process.returncode == 130, stderr
            time.sleep(1)
            assert not [pid for pid in installing if alive(pid)], "a process of the stopped install is still running"
    finally:
        for index in indexes:
            index.close()
        for process in runs:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_shrink_stopped_while_its_replay_waits_for_a_peer_stops_the_replay_and_the_peer_at_once(tmp_path):
    """shrink (as matrix) starts each peer in a process group of its own: SIGTERM stops the peer first, so that
    the replay waiting for it ends at once, not after the peer's ready timeout."""
    process = subprocess.Popen(
        [sys.executable, "-m", "replay_proxy", "shrink", "--db", str(ROOT / "recordings" / "demo.db"), "--session",
         "demo", "--out", str(tmp_path / "shrunk"), "--against", "engine", "--engine-cmd", "sleep 600 {port}",
         "--ready-timeout", "600"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, preexec_fn=ignoring_sigint)
    try:
        deadline = time.monotonic() + 120
        while not any(b"sleep" in command_of(pid) for pid in descendants(process.pid)):
            assert time.monotonic() < deadline and process.poll() is None, "the peer never started"
            time.sleep(0.5)
        started = descendants(process.pid)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 130, stderr
        time.sleep(1)
        assert not [pid for pid in started if alive(pid)], "a replay or its peer is still running"
        assert not (tmp_path / "shrunk").exists()  # (the folder it made, removed)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
