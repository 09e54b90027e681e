"""Child processes are stopped as a whole process group and wait for their own log lines; the ports handed
to them are never ones the kernel hands out for port 0."""

import os
import shlex
import socket
import sys
import time

import pytest

from replay_proxy.processes import Child, ChildError, ephemeral_ports, free_port

IGNORES_SIGTERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print('up', flush=True); time.sleep(60)")


def group_gone(pgid: int, within: float = 10) -> bool:
    """True once no process of the group is left (killed ones are reaped by init, not at once)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_stop_leaves_nothing_of_the_group_behind(tmp_path):
    """The shell exits on SIGTERM at once; its background job ignores SIGTERM and must still go."""
    job = shlex.join([sys.executable, "-c", IGNORES_SIGTERM])
    child = Child(["bash", "-c", f"{job} & wait"], tmp_path / "child.log")
    child.wait_for_log("up", timeout=30)
    child.stop(timeout=1)
    assert group_gone(child.pid)  # the job would sleep 60 s


def test_a_child_waits_for_its_own_line_not_one_an_earlier_child_left_in_the_same_log(tmp_path):
    """Benchmarks start a case's process again each round with the same log: a line from the round before
    must not pass for this round's (forward.py read a writer's CPU before the writer had started)."""
    log = tmp_path / "case.log"
    first = Child([sys.executable, "-c", "print('listening', flush=True)"], log)
    first.wait(timeout=30)
    second = Child([sys.executable, "-c", "import time; time.sleep(60)"], log)
    try:
        with pytest.raises(ChildError, match="did not print 'listening' within"):
            second.wait_for_log("listening", timeout=1)
    finally:
        second.stop(timeout=5)
    third = Child([sys.executable, "-c", "import time; print('listening', flush=True); time.sleep(60)"], log)
    try:
        third.wait_for_log("listening", timeout=30)
    finally:
        third.stop(timeout=5)


def test_a_free_port_is_bindable_and_never_one_the_kernel_hands_out_for_port_0():
    # vLLM's own random ports (bind port 0, let go, bind later) come from the ephemeral range: a port of ours
    # from there could be handed to a peer's ZMQ socket before the peer meant to have it binds it.
    ports = [free_port() for _ in range(200)]
    assert not [p for p in ports if p in ephemeral_ports()] and min(ports) >= 1024
    assert len(set(ports)) > 150  # spread out: two callers at once rarely pick the same
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))


def test_once_stopping_no_group_starts_and_those_running_stop_with_what_they_started():
    """What cli.run does on SIGTERM, in a process of its own (it stops that process's groups for good): the running
    group and its child go at once, and a worker thread's next run_group is refused, not started."""
    import subprocess

    script = """
import threading, time
from replay_proxy.processes import ChildError, descendants, run_group, stop_groups
done = []
worker = threading.Thread(target=lambda: done.append(run_group(["sh", "-c", "sleep 600 & wait"], 600)))
worker.start()
time.sleep(1)
stop_groups()
worker.join(30)
try:
    run_group(["true"], 10)
except ChildError as exc:
    print("refused:", exc)
print("joined:", not worker.is_alive(), done[0].returncode if done else None)
"""
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert "refused: not started, the command is stopping: true" in ran.stdout, ran.stdout + ran.stderr
    assert "joined: True -15" in ran.stdout or "joined: True -9" in ran.stdout, ran.stdout + ran.stderr


def test_ctrl_c_stops_the_groups_a_pool_of_threads_runs_at_once():
    """matrix and shrink --jobs wait on replays in threads: Ctrl-C stops those replays (and what they started), so
    the pool ends at once and the interrupt goes on, instead of waiting for every replay to end."""
    import signal
    import subprocess

    from replay_proxy.processes import descendants

    script = """
from replay_proxy.processes import run_group, threaded
try:
    threaded(lambda _: run_group(["sleep", "600"], 600), [1, 2], 2)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 30
        while len(descendants(process.pid)) < 2:
            assert time.monotonic() < deadline, "the two groups never started"
            time.sleep(0.1)
        sleeps = descendants(process.pid)
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=30)
        assert out == "interrupted\n"
        assert not [pid for pid in sleeps if os.path.exists(f"/proc/{pid}") and
                    open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
    finally:
        process.kill()
