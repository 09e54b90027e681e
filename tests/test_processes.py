"""Child processes are stopped as a whole process group; the ports handed to them are never ones the
kernel hands out for port 0."""

import os
import shlex
import socket
import sys
import time

from replay_proxy.processes import Child, ephemeral_ports, free_port

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


def test_a_free_port_is_bindable_and_never_one_the_kernel_hands_out_for_port_0():
    # vLLM's own random ports (bind port 0, let go, bind later) come from the ephemeral range: a port of ours
    # from there could be handed to a peer's ZMQ socket before the peer meant to have it binds it.
    ports = [free_port() for _ in range(200)]
    assert not [p for p in ports if p in ephemeral_ports()] and min(ports) >= 1024
    assert len(set(ports)) > 150  # spread out: two callers at once rarely pick the same
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))
