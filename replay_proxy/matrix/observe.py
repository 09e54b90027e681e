"""A cell's observation: two real replays, one per direction (docs/matrix.md: "Why a composed cell is sound").

* to the engine: frontend F's recording replayed against a real engine E
  (``replay-proxy replay --against engine``). E rejecting a request, dying
  or never registering is a break; the tokens its users get, compared with
  what E gives its own release's frontend for the same request (E's
  recording), say whether it is degraded.
* to the frontend: engine E's recording replayed against a real frontend F
  (``--against frontend``): F rejecting E's registration or outputs, or an
  HTTP request failing, is a break; a user getting other tokens than E sent
  is degraded.

Each kind of request recorded on both sides gets its own two replays, of its
own workload's recordings, the peer serving that kind (``peers.SERVING``).
Each replay is the project's own ``replay`` command in a process of its own,
on a copy of the recording, bounded by its ready and finish timeouts and by
``leg_s``; its peer is started and stopped by PID there. Every cell replays
its own frontend's recording, never another release's that sends the same:
the evidence of a cell is of its own release.

An engine takes 15-40 s to start here, longer than most replays take. So the
replays of one kind to one engine release (``EngineBatch``) run one after
another in this process against one engine, kept between them
(``replay.run.KeptEngine``: the same handshake, the prefix cache emptied), and
started again only after a replay that did not end clean (not for LoRA:
``peers.Serving.keep_engine``). The longest work goes to the workers first.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import msgspec

from replay_proxy import peers
from replay_proxy.compare.behaviour import batched
from replay_proxy.compare.report import ASKED_KEYS
from replay_proxy.compare.tokens import deterministic
from replay_proxy.compare.findings import exit_code, report_json
from replay_proxy.compare.rules import load_rules
from replay_proxy.errors import ExitCode, ReplayProxyError
from replay_proxy.matrix import KINDS, Evidence, Frontend, Judgement, Verdict, engine_recording, recording_of, worst
from replay_proxy.processes import free_port, run_group
from replay_proxy.releases import ReleaseError
from replay_proxy.replay.player import PeerUnderTest, ReplayOptions
from replay_proxy.replay.run import KeptEngine, replay_session
from replay_proxy.store.copy import copy_session
from replay_proxy.store.session import decode_and_load, load_session, match_requests
from replay_proxy.wire.messages import Direction, Side

# A replay's wait for its peer to finish, and what it may take beyond its waits (set-up, comparison).
FINISH_S, SLACK_S = 60, 120
# What a replay's failure finding means for the cell. A verdict rests on the protocol only: a failure is
# a break when what the peer said shows the link broke (rules.json: link_broke_patterns; a decode error
# naming a struct, a rejected registration), else the cell is unknown, the reason quoted (the peer could
# not run: its model, its memory, a port). An engine's ENGINE_CORE_DEAD is on the wire itself, and so is a
# reader's rejection that the replay named (compare/rejection.py: the failures it caused are under it).
FAILING_CODES = {Direction.TO_ENGINE: {"replay_failed", "peer_not_reached", "finish_timeout"},
                 Direction.TO_FRONTEND: {"replay_failed", "peer_not_reached", "http_failed"}}
WIRE_CODES = {Direction.TO_ENGINE: {"engine_dead", "reader_rejected"}, Direction.TO_FRONTEND: {"reader_rejected"}}
DEGRADING_CODES = {Direction.TO_FRONTEND: {"http_response_differs"}}
# What differs between the frontend under test and the one that made a recording, not between F and E.
UNRELATED = "the replay's other findings compare the peer under test with the recorded one, not F with E"


class Leg:
    """One replay of one direction, run once and shared by the cells it stands for; a to-engine leg given an
    engine kept from the leg before (``EngineBatch``) runs in this process."""

    def __init__(self, direction: Direction, recording: tuple[Path, str], workdir: Path, *, engine: str | None = None,
                 frontend: Frontend | None = None, ready_s: float = peers.READY_S, kind: str = "completion",
                 shown: str | None = None):
        """``shown``: how the evidence names ``workdir`` (relative to the report folder the user chose; None:
        it is not kept)."""
        self.direction, self.recording, self.workdir = direction, recording, workdir
        self.shown = shown
        self.engine, self.frontend, self.ready_s, self.kind = engine, frontend, ready_s, kind
        self.result: Judgement | None = None

    def run(self, kept: KeptEngine | None = None) -> Judgement:
        if self.result is None:
            started = time.monotonic()
            try:
                self.result = self._run(kept)
            except ReleaseError as exc:
                self.result = Judgement(Verdict.UNKNOWN, [Evidence(Verdict.UNKNOWN, self.direction, str(exc))])
            self.result.seconds = round(time.monotonic() - started, 1)
        return self.result

    def _run(self, kept: KeptEngine | None) -> Judgement:
        code, report, report_path = replay(self.direction, self.recording, self.workdir, engine=self.engine,
                                           frontend=self.frontend, ready_s=self.ready_s, kind=self.kind, kept=kept)
        if report is None:
            return Judgement(Verdict.UNKNOWN, [Evidence(Verdict.UNKNOWN, self.direction, report_path)])
        db = self.workdir / "replay.db"
        source = f"{self.shown}/report.json" if self.shown else "the replay's report (not kept: give --report-dir)"
        evidence = failure_evidence(self.direction, report["findings"], source)
        evidence += [Evidence(Verdict.DEGRADED, self.direction, f["message"], rule=f["code"], source=source)
                     for f in report["findings"] if f["code"] in DEGRADING_CODES.get(self.direction, ())]
        if self.direction is Direction.TO_ENGINE and not evidence:
            evidence += self._against_own_frontend(db, report["candidate"])
        if not evidence:
            evidence.append(Evidence(Verdict.WORKS, self.direction, f"replayed clean: {report['candidate']}",
                                     source=source))
        how = f"{self.recording[0].name} replayed against {self.peer} (exit {code}); {UNRELATED}"
        return Judgement(worst(e.verdict for e in evidence), evidence, how)

    @property
    def peer(self) -> str:
        return f"engine {self.engine}" if self.direction is Direction.TO_ENGINE else str(self.frontend)

    def _against_own_frontend(self, db: Path, replay_name: str) -> list[Evidence]:
        """Greedy or seeded requests, each run alone, whose tokens or finish reason differ from what engine E
        gives its own frontend."""
        own = engine_recording(self.engine, self.recording[0].parent, self.kind)
        if own is None:
            return []
        replay_id = replay_name.rsplit("(#", 1)[1].rstrip(")")  # "name (#2)", as reports name sessions
        baseline, candidate = load_session(own[0], own[1]), decode_and_load(db, replay_id)
        evidence = []
        # Batched requests do not reproduce on vLLM's CPU build (compare/behaviour.py): not compared.
        noisy = batched(baseline) | batched(candidate)
        # (the replay asked each request for the judging's logprobs: matched without them)
        keys = [k for k in load_rules().match_sampling_keys if k not in ASKED_KEYS]
        for before, after in match_requests(baseline, candidate, keys).pairs:
            if before.abort_progress is not None or after.abort_progress is not None:
                continue  # where an abort lands is the replay's own finding
            if {before.request_id, after.request_id} & noisy or not deterministic(baseline, before):
                continue
            if (before.tokens, before.finish_reason) != (after.tokens, after.finish_reason):
                evidence.append(Evidence(
                    Verdict.DEGRADED, self.direction,
                    f"request {after.request_id}: {len(after.tokens)} tokens ({after.finish_reason}), engine "
                    f"{self.engine} gives its own frontend {len(before.tokens)} ({before.finish_reason}) for the "
                    f"same prompt and sampling values; first tokens {after.tokens[:6]} vs {before.tokens[:6]}",
                    rule="tokens_differ_from_own_frontend"))
        failed = [u["method"] for u in candidate.utility if u.get("failure_message")]
        evidence += [Evidence(Verdict.DEGRADED, self.direction, f"utility {m} failed on engine {self.engine}",
                              field=m, rule="utility_failed") for m in failed]
        return evidence


def failure_evidence(direction: Direction, findings: list[dict], source: str) -> list[Evidence]:
    """A replay's failures as evidence: breaks where what the peer said shows the link broke (or the
    engine died on the wire), unknown where it could not run or was never reached."""
    rules = load_rules()

    def verdict(finding: dict) -> Verdict:
        if finding["code"] in WIRE_CODES[direction]:
            return Verdict.BREAKS
        on_the_wire = finding["code"] != "peer_not_reached" and rules.link_broke(finding["message"])
        return Verdict.BREAKS if on_the_wire else Verdict.UNKNOWN

    return [Evidence(verdict(f), direction, f["message"], struct=f.get("struct"), field=f.get("field"),
                     rule=f["code"], source=source)
            for f in findings if f["code"] in FAILING_CODES[direction] | WIRE_CODES[direction]]


class EngineBatch:
    """The to-engine legs of one engine release and kind, run one after another against one kept engine."""

    def __init__(self, legs: list[Leg]):
        self.legs = legs

    def run(self, done: Callable[[Leg], None] = lambda leg: None) -> None:
        """Run each leg, then call ``done`` with it."""
        kept = KeptEngine()
        try:
            for leg in self.legs:
                leg.run(kept)
                done(leg)
        finally:
            kept.stop()


def batched_legs(legs: list[Leg]) -> list[Leg | EngineBatch]:
    """What the workers run: the to-engine legs of each engine release and kind as one batch where its engine
    can be kept, every other leg on its own; the longest first, so that none is left running alone at the end:
    the batches, then what starts an engine or a Python frontend (imports of 10-20 CPU-s), then vllm-rs's."""
    batches: dict[tuple[str, str], list[Leg]] = {}
    alone = []
    for leg in legs:
        if leg.direction is Direction.TO_ENGINE and peers.SERVING[leg.kind].keep_engine:
            batches.setdefault((leg.engine, leg.kind), []).append(leg)
        else:
            alone.append(leg)
    alone.sort(key=lambda leg: (leg.direction is not Direction.TO_ENGINE,
                                leg.frontend is not None and leg.frontend.kind == "vllm-rs"))
    return [EngineBatch(b) for b in sorted(batches.values(), key=len, reverse=True)] + alone


def replay(direction: Direction, recording: tuple[Path, str], workdir: Path, *, engine: str | None = None,
           frontend: Frontend | None = None, ready_s: float = peers.READY_S, kind: str = "completion",
           kept: KeptEngine | None = None) -> tuple[int, dict | None, str]:
    """``replay-proxy replay`` of ``recording`` (into ``workdir``/replay.db) against a real engine ``engine``
    (direction to-engine) or frontend ``frontend`` serving ``kind``'s requests, installed first if need be,
    waiting ``ready_s`` for it to be ready: (exit code, its report, the report's path) or (exit code, None,
    why there is no report). With ``kept``, the engine it holds (or one started for this replay, kept there
    after it) runs it, in this process."""
    workdir.mkdir(parents=True, exist_ok=True)
    scratch = peers.scratch_dir()  # the peer's own files: gone with the replay (an engine's are 150 MB)
    serving = peers.SERVING[kind]
    if direction is Direction.TO_ENGINE:
        peers.ready_engine(engine, serving)
        port = free_port()
        command = peers.command(peers.engine_argv(port, engine), scratch, serving)
        if kept is not None:
            return replay_on_kept(recording, f"tcp://127.0.0.1:{port}", command, scratch, ready_s, workdir, kept)
        target = ["--against", "engine", "--listen", f"tcp://127.0.0.1:{port}", "--engine-cmd", command]
    else:
        peers.ready_frontend(frontend, serving)
        http, rpc = free_port(), peers.handshake_port(frontend)
        target = ["--against", "frontend", "--upstream", f"tcp://127.0.0.1:{rpc}", "--http", f"http://127.0.0.1:{http}",
                  "--frontend-cmd", peers.command(peers.frontend_argv(frontend, http, rpc), scratch, serving)]
    argv = [sys.executable, "-m", "replay_proxy", "replay", "--db", str(recording[0]), "--session", recording[1],
            *target, "--ready-timeout", str(ready_s), "--finish-timeout", str(FINISH_S), "--report-dir", str(workdir)]
    leg_s = ready_s + FINISH_S + SLACK_S
    try:
        done = run_group(argv, leg_s, text=True)
    except subprocess.TimeoutExpired:
        return -1, None, f"the replay took over {leg_s:g} s"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = workdir / "report.json"
    if not report.exists():  # it did not get as far as its report: its own output says why
        output = workdir / "replay.log"
        output.write_text(done.stdout + done.stderr)
        said = [line.strip() for line in done.stderr.splitlines() if any(c.isalnum() for c in line)] or ["no output"]
        return done.returncode, None, f"the replay ended with {done.returncode}: {said[-1]} (its output: {output})"
    return done.returncode, json.loads(report.read_text()), str(report)


def replay_on_kept(recording: tuple[Path, str], listen: str, command: str, scratch: Path, ready_s: float,
                   workdir: Path, kept: KeptEngine) -> tuple[int, dict | None, str]:
    """``replay``'s to-engine leg in this process, against ``kept``'s engine if it can serve it, else one started
    with ``command`` (its files in ``scratch``, removed once it has stopped), into ``workdir``/replay.db as the
    command would, its report.json there too."""
    peer = PeerUnderTest(side=Side.ENGINE, address=listen, command=command)
    options = ReplayOptions(ready_timeout_s=ready_s, finish_timeout_s=FINISH_S, report_dir=workdir)
    db = workdir / "replay.db"
    try:
        session = copy_session(*recording, db)
        report, _ = replay_session(db, session, peer, options, kept=kept)
    except ReplayProxyError as exc:  # the command's one line: why there is no report
        return int(ExitCode.REPLAY_FAILED), None, f"the replay could not run: {exc}"
    finally:
        if kept.child is not None and kept.child.owns is None:  # started here and kept: its files go with it
            kept.child.owns = scratch
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    path = workdir / "report.json"
    path.write_bytes(report_json(report))
    return int(exit_code(report.findings)), json.loads(path.read_bytes()), str(path)


Legs = dict[str, tuple[Leg, Leg]]  # a cell's two legs for each kind of request recorded on both sides


def legs_of(cells: list[tuple[Frontend, str]], recordings: Path, folder: Path, ready_s: float = peers.READY_S,
            kinds: list[str] | None = None, *, keep: bool = True) -> dict[tuple[Frontend, str], Legs | None]:
    """The two legs of each kind (of ``kinds``, default all) of each cell (None: a recording of the first kind
    is missing), an engine leg shared only by the cells of one recording; each waits ``ready_s`` for its peer,
    and works in a folder of its own under ``folder``/replays/ (named from ``folder`` in its evidence when it
    is ``keep``-t there)."""
    kinds = kinds or list(KINDS)

    def leg(direction: Direction, recording: tuple[Path, str], name: str, **peer) -> Leg:
        name = f"replays/{name}".replace(":", "-")
        return Leg(direction, recording, folder / name, ready_s=ready_s, shown=name if keep else None, **peer)

    engine_legs: dict[tuple[str, str, str], Leg] = {}
    legs: dict[tuple[Frontend, str], Legs | None] = {}
    for frontend, engine in cells:
        by_kind: Legs = {}
        for kind in kinds:
            suffix = KINDS[kind]
            sent, got = recording_of(frontend, recordings, kind), engine_recording(engine, recordings, kind)
            if sent is None or got is None:
                continue
            key = (sent[0], engine, kind)
            if key not in engine_legs:
                engine_legs[key] = leg(Direction.TO_ENGINE, sent, f"{frontend}{suffix}-to-engine-{engine}",
                                       engine=engine, kind=kind)
            by_kind[kind] = (engine_legs[key], leg(Direction.TO_FRONTEND, got, f"engine-{engine}{suffix}-to-{frontend}",
                                                   frontend=frontend, kind=kind))
        legs[(frontend, engine)] = by_kind if kinds[0] in by_kind else None
    return legs


def judge(legs: Legs) -> Judgement:
    """The cell's observed verdict: the worst of its kinds' two directions."""
    results = [(kind, leg.run()) for kind, pair in legs.items() for leg in pair]
    evidence = [msgspec.structs.replace(e, kind=kind) for kind, j in results for e in j.evidence]
    return Judgement(worst(e.verdict for e in evidence), evidence, "; ".join(j.how for _, j in results),
                     round(sum(j.seconds or 0 for _, j in results), 1), kinds=tuple(legs))
