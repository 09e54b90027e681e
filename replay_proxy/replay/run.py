"""``replay-proxy replay``: replay a recorded session against a new build, then compare.

The peer under test (``--engine-cmd`` / ``--frontend-cmd``) runs in its own
process group with its log kept, and is stopped by PID at the end; if it
exits during the replay, the replay fails at once rather than waiting out
its timeouts. The replay is recorded as a session of its own (mode
``replay``, pointing at the recorded one) in the same database, and compared
with the recording by the same code as ``replay-proxy diff``.
"""

from __future__ import annotations

import collections
import datetime
import functools
import re
import shlex
import tempfile
from pathlib import Path

import msgspec
import trio
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from replay_proxy.compare.findings import Finding, Report, Severity, worst_first
from replay_proxy.compare.report import build_report
from replay_proxy.compare.rules import load_rules
from replay_proxy.errors import leaf
from replay_proxy.processes import Child
from replay_proxy.replay import Against
from replay_proxy.replay.play_engine import EnginePlayer
from replay_proxy.replay.play_frontend import FrontendPlayer
from replay_proxy.replay.player import Player, ReplayError, ReplayOutcome
from replay_proxy.store.recorder import Recorder, SessionInfo
from replay_proxy.store.session import Session, SessionError, load_session
from replay_proxy.store.tables import open_database
from replay_proxy.wire.capture import CapturedFrame, EngineLoss
from replay_proxy.wire.messages import Direction, WireDecoder
from replay_proxy.wire.values import to_json


def replay_session(db: Path, session: str, against: Against, address: str, *,
                   http: str | None = None, command: str | None = None, pace: str = "original",
                   ready_timeout: float = 300.0, finish_timeout: float = 120.0, rules_path: Path | None = None,
                   logs: Path | None = None, console: Console | None = None, noise_runs: int = 0,
                   baseline_command: str | None = None) -> tuple[Report, ReplayOutcome | None]:
    """Play the other side of ``session`` against a new engine (at ``address``, the handshake it dials)
    or a new frontend (at ``address``, its handshake; ``http``, its API); return the report.

    With ``noise_runs``, the session is first replayed that many times against the baseline build
    (``baseline_command``); what varies between those runs is the noise floor, not regression.
    With a terminal ``console``, a progress bar shows while it runs."""
    if noise_runs and not baseline_command:
        raise ValueError("noise runs need the baseline build's command")
    against = Against(against)
    recording = load_session(db, session)
    if recording.init is None:
        raise SessionError(f"session {recording.name!r} has no INIT: the handshake was not recorded")
    rules = load_rules(rules_path)
    title = f"replay against {against}"
    logs = logs or Path(tempfile.mkdtemp(prefix="replay-proxy-replay-"))
    stamp = f"{datetime.datetime.now():%Y%m%d-%H%M%S}"
    run = functools.partial(_replay_once, recording, against, address, http=http, pace=pace,
                            ready_timeout=ready_timeout, finish_timeout=finish_timeout, rules=rules, console=console)
    noise = []
    for i in range(1, noise_runs + 1):
        name = f"{recording.name}-noise-{stamp}-{i}"
        session_id, _, failure = run(name, baseline_command, logs / f"baseline-{i}.log")
        if failure:
            return _failed(title, recording.name, name, f"noise run {i} against the baseline build: {failure}"), None
        noise.append(load_session(db, str(session_id)))
    name = f"{recording.name}-replay-{stamp}"
    session_id, outcome, failure = run(name, command, logs / f"{against}.log")
    if failure:
        return _failed(title, recording.name, name, failure), None
    report = build_report(title, load_session(db, str(recording.id)), load_session(db, str(session_id)), rules, noise,
                          frontend_under_test=against is Against.FRONTEND, replayed_noise=True)
    report.findings += outcome.findings
    save_findings(db, session_id, recording.id, report.findings)
    return report, outcome


def _replay_once(recording: Session, against: Against, address: str, name: str, command: str | None, log: Path, *,
                 http: str | None, pace: str, ready_timeout: float, finish_timeout: float, rules: dict,
                 console: Console | None) -> tuple[int, ReplayOutcome | None, str | None]:
    """One replay, recorded as session ``name``: (its id, the outcome, why it failed or None)."""
    # Its writer yields the CPU to the peer under test and the player (recorder.py: WRITER_NICENESS).
    recorder = Recorder(recording.db_path, SessionInfo(name=name, mode="replay", listen=address,
                                                       baseline_session_id=recording.id))
    observer = LastSent(recorder, Direction.TO_ENGINE if against is Against.ENGINE else Direction.TO_FRONTEND)
    player: Player
    if against is Against.ENGINE:
        player = FrontendPlayer(recording, address, observer, pace=pace, ready_timeout=ready_timeout,
                                finish_timeout=finish_timeout)
    else:
        player = EnginePlayer(recording, address, http, observer, pace=pace, ready_timeout=ready_timeout,
                              finish_timeout=finish_timeout, rules=rules)
    peer = None

    async def main():
        nonlocal peer
        async with trio.open_nursery() as nursery:
            async def play() -> None:
                await player.run()
                nursery.cancel_scope.cancel()  # done: stop watching the peer

            if command:  # ZMQ connects retry, so the peer may start before or after us
                peer = Child(shlex.split(command), log, name=f"{against} under test")
                nursery.start_soon(_watch, peer)
            nursery.start_soon(play)
            if console is not None and console.is_terminal:
                nursery.start_soon(_show_progress, console, player)
        return player.outcome

    outcome = failure = None
    try:
        outcome = trio.run(main)
        sent, finished, total, tokens = player.progress()
        outcome.summary = f"replayed {total} recorded requests: {sent} sent, {finished} finished, {tokens:,} tokens"
    except BaseException as exc:  # noqa: BLE001 - ReplayError arrives wrapped by the nurseries
        if not isinstance(leaf(exc), ReplayError):
            raise
        failure = f"{leaf(exc)}\n{observer.describe(against)}"
        if peer is not None:
            rejected = peer_error(peer, rules["peer_error_patterns"])
            failure += (f"\nits log says: {rejected}" if rejected else "") + f"\n(log: {log})"
    finally:
        recorder.close("failed" if failure else "complete", failure)
        if peer is not None:
            peer.stop(timeout=30)
    return recorder.session_id, outcome, failure


class LastSent:
    """The players' observer: the recorder, remembering the last frames sent to the peer under test,
    so that a peer that rejects something is told which messages it had just been sent."""

    capture, capture_hwm = None, 0  # no forwarders: the players report every frame themselves

    def __init__(self, recorder: Recorder, toward: Direction, keep: int = 3):
        self.recorder, self.toward = recorder, toward
        self.events: collections.deque[CapturedFrame] = collections.deque(maxlen=keep)

    def frame(self, frame: CapturedFrame) -> None:
        if frame.direction is self.toward:
            self.events.append(frame)
        self.recorder.frame(frame)

    def engine_lost(self, loss: EngineLoss) -> None:
        self.recorder.engine_lost(loss)

    def describe(self, peer: str) -> str:
        if not self.events:
            return f"nothing had been sent to the {peer}"
        return f"last messages sent to the {peer}: " + ", ".join(map(_name, self.events))


def _name(frame: CapturedFrame) -> str:
    """``REGISTRATION (engine 0, API server 1)``"""
    kind = WireDecoder().decode(frame.channel, frame.direction, frame.parts).kind.name
    where = ", ".join(f"{name} {i}" for name, i in (("engine", frame.engine_index),
                                                    ("API server", frame.client_index)) if i is not None)
    return f"{kind} ({where})"


def peer_error(peer: Child, patterns: list[str]) -> str | None:
    """The first line of the peer's log that reports a decode or validation error."""
    found = re.compile("|".join(patterns))
    return next((line.strip()[:300] for line in peer.log_lines() if found.search(line)), None)


def _failed(title: str, baseline: str, candidate: str, why: str) -> Report:
    return Report(title=title, baseline=baseline, candidate=candidate,
                  findings=[Finding("replay", Severity.REGRESSION, "replay_failed", why)])


def save_findings(db: Path, session_id: int, baseline_session_id: int, findings: list[Finding]) -> None:
    """Keep a replay's findings beside its frames (table ``findings``, preset ``findings``)."""
    rows = []
    for f in worst_first(findings):
        row = msgspec.to_builtins(f)
        rows.append({**row, "severity": f.severity.name.lower(), "session_id": session_id,
                     "baseline_session_id": baseline_session_id, "breaks": ",".join(f.breaks) or None,
                     "baseline": to_json(f.baseline), "candidate": to_json(f.candidate),
                     "change": to_json(row.get("change"))})
    database = open_database(db)
    database["findings"].insert_all(rows)
    database.close()


async def _show_progress(console: Console, player: Player) -> None:
    """A progress bar on the terminal: requests sent and finished, tokens."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[detail]}"), console=console, transient=True) as bar:
        task = bar.add_task("replaying", total=None, detail="")
        while True:
            sent, finished, total, tokens = player.progress()
            bar.update(task, completed=finished, total=total,
                       detail=f"sent {sent}, finished {finished}, {tokens:,} tokens")
            await trio.sleep(0.25)


async def _watch(child: Child) -> None:
    """Fail the replay as soon as the peer under test exits, instead of waiting out the timeouts."""
    while child.running():
        await trio.sleep(0.5)
    raise ReplayError(f"{child.name} exited with code {child.process.returncode} during the replay:\n"
                      f"{child.log_tail(5)}")
