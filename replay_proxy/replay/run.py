"""``replay-proxy replay``: replay a recorded session against a new build, then compare.

The peer under test (``PeerUnderTest``: ``--engine-cmd`` / ``--frontend-cmd``) runs in its own
process group with its log kept, and is stopped by PID at the end; if it
exits during the replay, the replay fails at once rather than waiting out
its timeouts. The replay is recorded as a session of its own (mode
``replay``, pointing at the recorded one) in the same database, and compared
with the recording by the same code as ``replay-proxy diff``.

An engine under test can be kept for the next replay (``KeptEngine``): an
engine takes 15-40 s to start, and replaying many recordings against one
release (the matrix) would spend most of its time starting engines. It is
kept only while each replay ends clean, and used again only for a session
whose handshake would be the same, once its prefix cache is emptied
(``play_frontend``: what a kept engine's replay reports of the handshake).
"""

from __future__ import annotations

import collections
import datetime
import re
import shlex
from pathlib import Path
from typing import Callable, NamedTuple

import msgspec
import trio
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from replay_proxy.compare.codes import Code
from replay_proxy.compare.findings import Finding, Report, Severity, worst_first
from replay_proxy.compare.rejection import FAILED, fold_consequences, read_as, reader_rejections, sent_lengths
from replay_proxy.compare.report import Comparison, Replayed, build_report
from replay_proxy.compare.rules import Rules
from replay_proxy.errors import leaf
from replay_proxy.processes import Child
from replay_proxy.replay.play_engine import EnginePlayer
from replay_proxy.replay.play_frontend import EngineNotReset, FrontendPlayer, FrontendSockets
from replay_proxy.replay.player import PeerUnderTest, Player, ReplayError, ReplayOptions, ReplayOutcome
from replay_proxy.recorder import Recorder, SessionInfo
from replay_proxy.store.session import Session, SessionError, decode_and_load
from replay_proxy.store.tables import open_database
from replay_proxy.wire.capture import CapturedFrame, EngineLoss
from replay_proxy.wire.messages import Direction, Message, Side, WireDecoder
from replay_proxy.wire.values import to_json


class KeptEngine:
    """An engine under test started by one replay and kept for the next (``replay_session(kept=...)``), as
    long as each ends clean: every request finished or aborted, every call answered, the engine running.
    The caller stops it (``stop``) when done."""

    def __init__(self) -> None:
        self.child: Child | None = None  # None with a link: an engine the user started
        self.link: FrontendSockets | None = None

    def take(self, session: Session, timeout_s: float) -> bool:
        """Whether it can serve ``session``'s replay: running, the same handshake
        (``FrontendSockets.serves``), its prefix cache emptied. If not, it is stopped, and the replay starts an
        engine of its own."""
        if self.link is None:
            return False
        if (self.child is None or self.child.running()) and self.link.serves(session):
            try:
                trio.run(self.link.reset, timeout_s)
                return True
            except EngineNotReset:
                pass
        self.stop()
        return False

    def hand_back(self, child: Child | None, link: FrontendSockets | None, clean: bool) -> None:
        """After a replay that was given this to keep: the engine it ran, kept if the replay ended ``clean`` and
        the engine still runs, else stopped."""
        self.child, self.link = child, link
        if not (clean and (child is None or child.running())):
            self.stop()

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop(timeout=30)
        if self.link is not None:
            self.link.close()
        self.child = self.link = None


UNCLEAN = (Code.FINISH_TIMEOUT, Code.ENGINE_DEAD)  # a replay that ends with these leaves its engine unfit to keep


def replay_session(db: Path, session: str, peer: PeerUnderTest, options: ReplayOptions, *,
                   console: Console | None = None,
                   kept: KeptEngine | None = None) -> tuple[Report, ReplayOutcome | None]:
    """Play the other side of ``session`` against ``peer``, the new build; return the report.

    With ``options.noise_runs`` N, the session is replayed N times against the baseline build and N times against
    the candidate, interleaved and counterbalanced (baseline, candidate, candidate, baseline, ...), so that load
    which comes and goes on the machine falls on both: what varies between the baseline's runs is the noise floor,
    not regression. Against an engine, the first run of each build is scored (teacher-forced; the baseline's
    twice), and every request asks for the judging's logprobs. A ``console`` is told each run as it starts and
    ends; on a terminal, a progress bar shows while it runs. With ``kept`` (against an engine), the engine it holds
    is used if it can be for the candidate's first run, and that engine is kept there if the run ended clean (every
    other run starts an engine of its own). The peers' logs go to ``options.report_dir``; without one, to the
    folder ``<db>-logs`` beside the replay's database, kept as the findings that name them are."""
    if kept is not None and peer.side is not Side.ENGINE:
        raise ReplayError("only an engine under test can be kept for the next replay")
    logs = options.report_dir or db.with_name(f"{db.stem}-logs")
    return _replay(db, session, peer, options, logs, console, kept)


def _replay(db: Path, session: str, peer: PeerUnderTest, options: ReplayOptions, logs: Path,
            console: Console | None, kept: KeptEngine | None) -> tuple[Report, ReplayOutcome | None]:
    recording = decode_and_load(db, session)
    if recording.init is None:
        raise SessionError(f"session {recording.name!r} has no INIT: the handshake was not recorded")
    title = f"replay against {peer.side}"
    stamp = f"{datetime.datetime.now():%Y%m%d-%H%M%S}"
    judging = peer.side is Side.ENGINE and options.rules.judging.top_logprobs > 0
    baseline_peer = msgspec.structs.replace(peer, command=options.baseline_command)  # the build it was recorded with
    runs: dict[bool, list[Session]] = {True: [], False: []}  # by candidate: the runs of each build, in order
    first: OneRun | None = None  # the candidate's first run, the one the report is of
    other_cpu: dict[str, float] = {}  # each run's session: the machine's CPU share other processes took
    schedule = _schedule(options.noise_runs)
    for started, (i, candidate) in enumerate(schedule, 1):
        if console is not None:  # a line a run: minutes of silence look like a hang in a CI log
            build = "the build under test" if candidate else "the baseline build"
            console.print(f"run {started} of {len(schedule)}: {build}", highlight=False)
        if candidate:
            name = f"{recording.name}-replay-{stamp}" + (f"-{i}" if i > 1 else "")
            run = _replay_once(recording, peer, options, name, logs / f"{peer.side}{f'-{i}' if i > 1 else ''}.log",
                               console, kept if i == 1 else None,
                               scoring_passes=judging and i == 1 and options.noise_runs > 0)
        else:
            name = f"{recording.name}-noise-{stamp}-{i}"
            run = _replay_once(recording, baseline_peer, options, name, logs / f"baseline-{i}.log", console,
                               scoring_passes=(2 if i == 1 else 1) * judging)
        if run.failure is not None and candidate:
            return _failed(title, recording.name, name, fold_consequences([*run.rejections, run.failure],
                                                                          options.rules), db), None
        if run.failure is not None:
            return _failed(title, recording.name, name, [msgspec.structs.replace(run.failure, message=(
                f"noise run {i} against the baseline build: {run.failure.message}"))], db), None
        played = decode_and_load(db, str(run.session_id))
        runs[candidate].append(played)
        other_cpu[played.label] = run.outcome.other_cpu if run.outcome else 0.0
        first = first or (run if candidate else None)
    assert first is not None and first.outcome is not None  # (the schedule runs the candidate once at least)
    outcome = first.outcome
    cost = [Finding("behaviour", Severity.INFO, Code.JUDGING_COST, (
        f"judging asked every request for its top {options.rules.judging.top_logprobs} logprobs"
        + (f"; teacher-forced scoring took {outcome.scoring_seconds:.1f} s of the candidate's run, whose "
           f"session took {outcome.send_seconds:.1f} s to send" if options.noise_runs else "")),
        field="judging_cost")] if judging else []
    report = build_report(Comparison(
        title=title, baseline=recording, candidate=runs[True][0], baseline_runs=tuple(runs[False]),
        candidate_runs=tuple(runs[True][1:]), other_cpu=other_cpu, recorded_in=str(db),
        replayed=Replayed(peer.side, held_lengths=options.hold_lengths, asked_logprobs=judging)),
        options.rules, [*cost, *outcome.findings, *first.rejections])
    save_findings(db, first.session_id, recording.id, report.findings)
    return report, outcome


def _schedule(noise_runs: int) -> list[tuple[int, bool]]:
    """The runs of a replay in order, (run number of its build, whether it is the candidate's): with noise runs,
    counterbalanced (baseline, candidate, candidate, baseline, ...), so that load which comes and goes with the
    period of two runs falls on both builds alike, where strict alternation would put it on one build's every
    run; without, the candidate's one run."""
    if not noise_runs:
        return [(1, True)]
    return [(i, candidate) for i in range(1, noise_runs + 1) for candidate in ((False, True) if i % 2 else
                                                                              (True, False))]


class OneRun(NamedTuple):
    """One replay of a session: the session it was recorded as, what the player did, why it failed (None: it
    ran), and the peer's reader's rejections of what it was sent."""

    session_id: int
    outcome: ReplayOutcome | None
    failure: Finding | None
    rejections: list[Finding]


class RecordedRun:
    """One run's recording: a session of the recording's database (mode ``replay``, pointing at the recorded
    one), the recorder writing it, and the observer the player reports to (``LastSent``), which remembers what
    the peer was sent last. ``close`` ends the session, failed if the run did."""

    def __init__(self, recording: Session, name: str, peer: PeerUnderTest):
        # As in a recording: listen, where the engines dial the proxy (playing the frontend); upstream, where the
        # proxy dials the frontend's handshake (playing the engines). Its writer yields the CPU to the peer under
        # test and the player (recorder/writer_process.py: SCHED_IDLE).
        address = {"listen": peer.address} if peer.side is Side.ENGINE else {"upstream": peer.address}
        self.recorder = Recorder(recording.db_path, SessionInfo(name=name, mode="replay",
                                                                baseline_session_id=recording.id, **address))
        self.observer = LastSent(self.recorder, peer.side.reads)

    def close(self, failure: Finding | None) -> int:
        """End the session (failed, with why, if ``failure``); its id."""
        self.recorder.close("failed" if failure else "complete", failure and failure.message)
        return self.recorder.session_id


def classify_failure(error: ReplayError, sent: LastSent, side: Side, child: Child | None, log: Path,
                     log_from: int | None, rules: Rules) -> Finding:
    """A replay that stopped with ``error``, as a finding: ``peer_not_reached`` when no frame of the link had
    reached the peer (it cannot have rejected one: it could not run), else ``replay_failed``; either says what
    the peer was sent last and quotes what its log says of the link, else why it could not run."""
    why = f"{error}\n{sent.describe(side)}"
    if child is not None:
        said = child.log_lines(log_from)
        said = peer_line(said, rules.link_broke_patterns) or peer_line(said, rules.peer_cannot_run_patterns)
        why += (f"\nits log says: {said}" if said else "") + f"\n(log: {log})"
    return Finding("replay", Severity.REGRESSION, Code.REPLAY_FAILED if sent.events else Code.PEER_NOT_REACHED, why)


def _replay_once(recording: Session, peer: PeerUnderTest, options: ReplayOptions, name: str, log: Path,
                 console: Console | None, kept: KeptEngine | None = None, scoring_passes: int = 0,
                 ) -> OneRun:
    """One replay, recorded as session ``name`` (``RecordedRun``), against a kept engine if ``kept`` holds one
    that serves it (``KeptEngine.take``), else a peer started for it; a failure classified
    (``classify_failure``). ``scoring_passes``: teacher-forced scoring passes after it (against an engine)."""
    reuse = kept is not None and kept.take(recording, options.ready_timeout_s)
    recorded = RecordedRun(recording, name, peer)
    player: Player  # plays the other side: the recorded frontend to an engine, the recorded engines to a frontend
    if peer.side is Side.ENGINE:
        player = FrontendPlayer(recording, peer.address, recorded.observer, options,
                                link=kept.link if kept is not None and reuse else None, keep=kept is not None,
                                scoring_passes=scoring_passes)
    else:
        player = EnginePlayer(recording, peer.address, peer.http, recorded.observer, options)
    child = kept.child if kept is not None and reuse else None
    log_from = child.log_size() if child is not None else None  # a kept engine's log: this replay's part
    outcome = failure = None
    try:
        if peer.command and child is None:  # ZMQ connects retry, so the peer may start before or after the player
            child = Child(shlex.split(peer.command), log, name=f"{peer.side} under test")
        outcome = trio.run(_play, player, child, log_from, options, console)
        sent, finished, total, tokens = player.tally()
        outcome.summary = (f"replayed {total} recorded requests: {sent} sent, {finished} finished, {tokens:,} tokens"
                           + (f"; scored in {outcome.scoring_seconds:.1f} s" if scoring_passes else ""))
        if console is not None:
            console.print(f"  {outcome.summary}", highlight=False)
    except BaseException as exc:  # (a ReplayError arrives wrapped by the nurseries)
        if not isinstance(error := leaf(exc), ReplayError):
            raise
        failure = classify_failure(error, recorded.observer, peer.side, child, log, log_from, options.rules)
    finally:
        try:
            session_id = recorded.close(failure)
        finally:  # (a recording that could not be closed leaves no peer running)
            if reuse and child is not None and log != child.log_path:  # this replay's part of the kept engine's log
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text(f"# {child.name} (pid {child.pid}), started for an earlier replay and kept; its "
                               f"whole log: {child.log_path}\n"
                               + "".join(f"{line}\n" for line in child.log_lines(log_from)))
            if kept is not None:
                kept.hand_back(child, player.link, clean=outcome is not None and not any(
                    f.code in UNCLEAN for f in outcome.findings))
            elif child is not None:
                child.stop(timeout=30)
    rejections = []
    sent = recorded.observer.events
    if sent:  # what the peer said of the link, once it had been sent something of it
        said = child.log_lines(log_from) if child is not None else []
        said += [f.message for f in (outcome.findings if outcome else [failure]) if f is not None and f.code in FAILED]
        rejections = reader_rejections(said, recording.schema, peer.side, options.rules,
                                       [read_as(recorded.observer.message(f)) for f in reversed(sent)],
                                       sent_lengths(recording))
    return OneRun(session_id, outcome, failure, rejections)


async def _play(player: Player, child: Child | None, log_from: int | None, options: ReplayOptions,
                console: Console | None) -> ReplayOutcome:
    """The player's run, with the peer under test watched (its exit or a broken link fails the run at once) and,
    on a terminal, a progress bar."""
    async with trio.open_nursery() as nursery:
        async def play() -> None:
            await player.run()
            nursery.cancel_scope.cancel()  # done: stop watching the peer

        if child is not None:
            rejected = player.peer_rejected if isinstance(player, FrontendPlayer) else None
            nursery.start_soon(_watch, child, log_from, options.rules.link_broke_patterns, rejected)
        nursery.start_soon(play)
        if console is not None and console.is_terminal:
            nursery.start_soon(_show_progress, console, player)
    return player.outcome


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
        return f"last messages sent to the {peer}: " + ", ".join(map(self._name, self.events))

    @staticmethod
    def message(frame: CapturedFrame) -> Message:
        return WireDecoder().decode(frame.channel, frame.direction, frame.parts)

    def _name(self, frame: CapturedFrame) -> str:
        """``REGISTRATION (engine 0, API server 1)``"""
        where = ", ".join(f"{name} {i}" for name, i in (("engine", frame.engine_index),
                                                        ("API server", frame.client_index)) if i is not None)
        return f"{self.message(frame).kind.name} ({where})"


def peer_line(lines: list[str], patterns: list[str]) -> str | None:
    """The first of the peer's log ``lines`` that matches one of ``patterns``."""
    found = re.compile("|".join(patterns))
    return next((line.strip()[:300] for line in lines if found.search(line)), None)


def _failed(title: str, baseline: str, candidate: str, findings: list[Finding], db: Path) -> Report:
    return Report(title=title, baseline=baseline, candidate=candidate, findings=findings, recorded_in=str(db))


def save_findings(db: Path, session_id: int, baseline_session_id: int, findings: list[Finding]) -> None:
    """Keep a replay's findings beside its frames (table ``findings``, preset ``findings``)."""
    rows = []
    for f in worst_first(findings):
        row = msgspec.to_builtins(f)
        rows.append({**row, "severity": f.severity.name.lower(), "session_id": session_id,
                     "baseline_session_id": baseline_session_id, "breaks": ",".join(f.breaks) or None,
                     "baseline": to_json(f.baseline), "candidate": to_json(f.candidate),
                     "change": to_json(row.get("change")),
                     "consequences": to_json(row.get("consequences"))})
    database = open_database(db)
    database["findings"].insert_all(rows)
    database.close()


async def _show_progress(console: Console, player: Player) -> None:
    """A progress bar on the terminal: requests sent and finished, tokens."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[detail]}"), console=console, transient=True) as bar:
        task = bar.add_task("replaying", total=None, detail="")
        while True:
            sent, finished, total, tokens = player.tally()
            bar.update(task, completed=finished, total=total,
                       detail=f"sent {sent}, finished {finished}, {tokens:,} tokens")
            await trio.sleep(0.25)


async def _watch(child: Child, log_from: int | None, patterns: list[str],
                 rejected: Callable[[str], None] | None) -> None:
    """Fail the replay as soon as the peer under test exits, instead of waiting out the timeouts; and tell
    ``rejected`` once its log (from ``log_from``) says it could not read something of the link."""
    while child.running():
        if rejected is not None and (said := peer_line(child.log_lines(log_from), patterns)):
            rejected(said)
            rejected = None
        await trio.sleep(0.5)
    raise ReplayError(f"{child.name} exited with code {child.process.returncode} during the replay:\n"
                      f"{child.log_tail(5)}")
