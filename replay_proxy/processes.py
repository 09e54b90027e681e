"""Child processes we start (peers under test, the proxy itself): bounded and killed by PID.

Each child gets its own process group (its PID is the group id), so that
stopping it also stops what it spawned (vLLM's engine and API-server
processes). Output goes to a log file kept for the report.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar
from pathlib import Path

from replay_proxy.errors import ReplayProxyError

T, R = TypeVar("T"), TypeVar("R")
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colour codes, as vLLM and vllm-rs write to a terminal-less log


class ChildError(ReplayProxyError):
    """A child process failed to start, exited early or did not become ready."""


_RUNNING: set[subprocess.Popen] = set()  # every child now (run_group's, each Child): what stop_groups stops
_STOPPED = threading.Event()  # set by stop_groups: no child starts after it (a worker thread's next replay)


def run_group(argv: list[str], timeout: float, *, env: dict[str, str] | None = None, text: bool = False
              ) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True)`` in a process group of its own, it and every process it
    started killed if it outlives ``timeout`` or its caller is stopped (SIGINT, or SIGTERM, which ``cli.run``
    turns into it): an install's pip stops with it, and never goes on writing into the cache that the next
    run removes and installs again. Each process by its PID as well as the group: GNU ``timeout``, which the
    set-up runs pip under, puts itself and pip in a group of their own. ``text``: its output as text."""
    if _STOPPED.is_set():
        raise ChildError(f"not started, the command is stopping: {argv[0]}")
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
                          start_new_session=True, text=text) as process:
        _RUNNING.add(process)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except BaseException:
            _kill(process)
            raise
        finally:
            _RUNNING.discard(process)
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def stop_groups() -> None:
    """Every child now (``run_group``'s, and each ``Child``: the peers of a replay a worker thread runs), and what
    it started, killed: what ``cli.run`` does first on SIGTERM, so that a command whose threads wait on replays
    (matrix, shrink) stops at once, not when they end, and none of them starts another."""
    _STOPPED.set()
    for process in list(_RUNNING):
        _kill(process)


def threaded(work: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """``work`` over ``items`` on ``workers`` threads, its results in order. Interrupted (Ctrl-C), it stops the
    groups the threads run (``stop_groups``), so that they end at once and the interrupt goes on: a pool waits
    for its threads, which would otherwise wait for their replays."""
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        try:
            return list(pool.map(work, items))
        except BaseException:
            stop_groups()
            raise


def _kill(process: subprocess.Popen) -> None:
    started = descendants(process.pid)  # (before any dies: its children would be orphans, out of reach)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5)


def descendants(pid: int) -> set[int]:
    """The processes ``pid`` started, and those they started, now (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # (gone meanwhile)
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def last_line(output: bytes, default: str = "no output") -> str:
    """What a failed command said last: the line that names why."""
    return (output.decode(errors="replace").strip().splitlines() or [default])[-1]


class Child:
    def __init__(self, argv: list[str], log_path: Path, *, env: dict[str, str] | None = None,
                 name: str | None = None, cwd: Path | None = None, owns: Path | None = None):
        """``owns``: a folder only this child writes to (its scratch files), removed once it has stopped."""
        self.name = name or Path(argv[0]).name
        if _STOPPED.is_set():
            raise ChildError(f"not started, the command is stopping: {self.name}")
        self.owns = owns
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self._log_start = log.tell()  # what an earlier child wrote to the same log is not this one's
        try:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, cwd=cwd, start_new_session=True)
        except OSError as exc:
            raise ChildError(f"could not start {self.name} ({argv[0]}): {exc}") from None
        finally:
            log.close()
        self.pid = self.process.pid
        _RUNNING.add(self.process)

    def running(self) -> bool:
        return self.process.poll() is None

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise ChildError(f"{self.name} (pid {self.pid}) still running after {timeout:g} s; "
                             f"log: {self.log_path}") from None

    def stop(self, timeout: float = 20.0, sig: int = signal.SIGTERM) -> int:
        """Signal the child's process group, wait for the child, then SIGKILL what is left of the group.

        What is left: a shell's background job, or a process that missed the signal while it
        was starting, can outlive the child that started it."""
        if self.running():
            self._signal_group(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)
        code = self.process.wait(10)
        _RUNNING.discard(self.process)
        if self.owns is not None:
            shutil.rmtree(self.owns, ignore_errors=True)
        return code

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The child's process group stopped (SIGSTOP) inside the block, and continued after it."""
        self._signal_group(signal.SIGSTOP)
        try:
            yield
        finally:
            self._signal_group(signal.SIGCONT)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def log_size(self) -> int:
        """Where the log ends now: what the child logs from here on is ``log_lines(log_size())``."""
        try:
            return self.log_path.stat().st_size
        except OSError:
            return self._log_start

    def log_lines(self, start: int | None = None) -> list[str]:
        """What this child has logged (from byte ``start`` of the log on), without terminal colour codes."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start if start is None else start)
                return ANSI.sub("", log.read().decode(errors="replace")).splitlines()
        except OSError:
            return []

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_lines()[-lines:])

    def wait_for_log(self, text: str, timeout: float) -> None:
        """Wait until ``text`` appears in what this child has logged; fail early if the child exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.log_lines()):
                return
            if not self.running():
                raise ChildError(f"{self.name} exited with {self.process.returncode} before "
                                 f"printing {text!r}:\n{self.log_tail()}")
            time.sleep(0.1)
        raise ChildError(f"{self.name} did not print {text!r} within {timeout:g} s:\n{self.log_tail()}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, from below the kernel's ephemeral range.

    A process that binds port 0 is handed a port from that range, and so are vLLM's own random ports (its
    get_open_port binds port 0, lets go, and binds again later) and libzmq's. A port taken from the same
    range could be handed to one of those between our check and its use: seen in CI, a frontend's HTTP
    port answered by a ZMQ socket. Below the range, only another caller of this function can pick it.
    """
    import random
    import socket

    low = ephemeral_ports().start
    for _ in range(1000):
        port = random.randrange(max(1024, low - 12_000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use, or in TIME_WAIT
                continue
        return port
    raise OSError(f"no free TCP port in the 12,000 below {low}")


def ephemeral_ports() -> range:
    """The ports the kernel hands out for port 0 (Linux's ip_local_port_range; its default elsewhere)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


class OtherLoad:
    """The share of the machine's CPU time that went to processes other than this one and its descendants,
    steal time included (a hypervisor's other tenants), between ``start`` and ``share`` (from /proc; 0 where
    there is none). A replay's timing is judged only on runs the machine gave it whole."""

    def __init__(self) -> None:
        self._machine = self._ours = None

    def start(self) -> OtherLoad:
        self._machine, self._ours = _machine_ticks(), _own_ticks()
        return self

    def share(self) -> float:
        if self._machine is None:
            return 0.0
        busy, total = (now - then for now, then in zip(_machine_ticks(), self._machine))
        ours = sum(ticks - self._ours.get(pid, 0) for pid, ticks in _own_ticks().items())
        return max(0.0, (busy - ours) / total) if total > 0 else 0.0


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine since boot: /proc/stat's first line (steal counts as busy)."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    user, nice, system, idle, iowait, irq, softirq, steal = values + [0] * (8 - len(values))
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def _own_ticks() -> dict[int, int]:
    """CPU ticks (user and system) of this process and each of its descendants, by PID."""
    parents, ticks = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # past "(command name)"
        except (OSError, IndexError):
            continue  # it ended meanwhile
        parents[int(entry.name)] = int(fields[1])
        ticks[int(entry.name)] = int(fields[11]) + int(fields[12])  # utime, stime
    ours, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        ours.add(pid)
        todo += [child for child, parent in parents.items() if parent == pid and child not in ours]
    return {pid: ticks[pid] for pid in ours if pid in ticks}
