"""Child processes are stopped as a whole process group."""

import os
import shlex
import sys
import time

from replay_proxy.processes import Child

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
