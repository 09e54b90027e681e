"""``replay-proxy replay``: replay a recorded session against a new build, then compare.

The replay is recorded as a session of its own (mode ``replay``, pointing at
the recorded one) in the same database, and compared with the recording by
the same code as ``replay-proxy diff``.
"""

from __future__ import annotations

import datetime
import shlex
import tempfile
from pathlib import Path

import trio

from replay_proxy.compare.findings import Finding, Report, Severity
from replay_proxy.compare.sessions import build_report, load_rules, load_session
from replay_proxy.errors import leaf
from replay_proxy.processes import Child
from replay_proxy.replay.engine import EngineReplay, ReplayError, ReplayOutcome
from replay_proxy.replay.recording import load_recording
from replay_proxy.store.writer import Recorder, SessionInfo


def replay_against_engine(db: Path, session: str, listen: str, *, engine_cmd: str | None = None,
                          pace: str = "original", ready_timeout: float = 300.0, finish_timeout: float = 120.0,
                          rules_path: Path | None = None, logs: Path | None = None,
                          on_started=None) -> tuple[Report, ReplayOutcome | None]:
    """Play the frontend of ``session`` against an engine; return the comparison report."""
    recording = load_recording(db, session)
    rules = load_rules(rules_path)
    name = f"{recording.name}-replay-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    recorder = Recorder(db, SessionInfo(name=name, mode="replay", listen=listen,
                                        baseline_session_id=recording.session_id))
    logs = logs or Path(tempfile.mkdtemp(prefix="replay-proxy-replay-"))
    engine = None
    replay = EngineReplay(recording, listen, recorder, pace=pace, ready_timeout=ready_timeout,
                          finish_timeout=finish_timeout)
    outcome, failure = None, None
    async def main() -> ReplayOutcome:
        nonlocal engine
        async with trio.open_nursery() as nursery:
            async def play() -> None:
                await replay.run()
                nursery.cancel_scope.cancel()  # done: stop watching the engine

            nursery.start_soon(play)
            await replay.listening.wait()
            if on_started is not None:
                on_started(replay.listen)
            if engine_cmd:
                engine = Child(shlex.split(engine_cmd), logs / "engine.log", name="engine under test")
                nursery.start_soon(_watch, engine)
        return replay.outcome

    try:
        outcome = trio.run(main)
    except BaseException as exc:  # noqa: BLE001 - ReplayError arrives wrapped by the nurseries
        if not isinstance(leaf(exc), ReplayError):
            raise
        failure = str(leaf(exc))
    finally:
        recorder.close("failed" if failure else "complete", failure)
        if engine is not None:
            engine.stop(timeout=30)
    if failure:
        where = f" (engine log: {engine.log_path})" if engine else ""
        report = Report(title="replay against engine", baseline=recording.name, candidate=name,
                        findings=[Finding("replay", Severity.REGRESSION, "replay_failed", failure + where)])
        return report, None
    report = build_report("replay against engine", load_session(db, str(recording.session_id), rules),
                          load_session(db, str(recorder.session_id), rules), rules)
    report.findings += outcome_findings(outcome, finish_timeout)
    return report, outcome


async def _watch(child: Child) -> None:
    """Fail the replay as soon as the peer under test exits, instead of waiting out the timeouts."""
    while child.running():
        await trio.sleep(0.5)
    raise ReplayError(f"{child.name} exited with code {child.process.returncode} during the replay:\n"
                      f"{child.log_tail(5)}")


def outcome_findings(outcome: ReplayOutcome, finish_timeout: float) -> list[Finding]:
    findings = []
    if outcome.timed_out:
        findings.append(Finding(
            "replay", Severity.INFO, "finish_timeout",
            f"stopped waiting after {finish_timeout:g} s: {len(outcome.unfinished)} request(s) unfinished, "
            f"{outcome.utility_unanswered} utility call(s) unanswered", candidate=outcome.unfinished[:10]))
    for engine in outcome.dead_engines:
        findings.append(Finding("behaviour", Severity.REGRESSION, "engine_dead",
                                f"ENGINE_CORE_DEAD on the output socket of API server {engine}"))
    return findings
