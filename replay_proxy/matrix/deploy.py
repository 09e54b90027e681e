"""``can-i-deploy`` (Pact's question for this link) and ``bisect``.

can-i-deploy answers for one frontend x engine cell and the kinds of request
a deployment uses (every kind judged, by default): each kind from the matrix
database where the cell was observed for it, from the prediction otherwise,
or from a fresh observation (``verify``); and it says which. The upgrade
order comes from the two cells a one-side-at-a-time upgrade passes through,
judged for the same kinds.

bisect replays one recorded session against the releases of a range, in
bisection order, and names the first whose replay regresses against the
recording: a breaking schema finding, a behaviour regression or a replay
that could not finish (timing is left out: it is not a release's fault on a
shared machine). It assumes, as bisection must, that a range has one
boundary; the releases it tried are listed so that a user can see it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import msgspec

from replay_proxy.matrix import (KINDS, Cell, Evidence, Frontend, MatrixError, RECORDINGS, Verdict, engine_recording,
                                 recording_of, releases_in)
from replay_proxy.matrix import database
from replay_proxy.matrix.observe import replay
from replay_proxy.matrix.predict import predict
from replay_proxy.matrix.run import build
from replay_proxy.peers import READY_S
from replay_proxy.releases import ReleaseError
from replay_proxy.store.queries import find_session, open_recording
from replay_proxy.wire.messages import Side
from replay_proxy.wire.schema import release_key
from replay_proxy.wire.registry import shipped_releases


class Answer(msgspec.Struct):
    cell: Cell
    source: str  # where an observation comes from: "observed" (when), "verified now"; or "predicted"
    upgrade: list[str]  # the order that keeps every step working, one line per step
    uses: list[str]  # the kinds of request asked about (KINDS)

    @property
    def verdict(self) -> Verdict:
        return self.cell.verdict_for(self.uses)

    def by_kind(self) -> list[tuple[str, Verdict, str, list[tuple[Evidence, int]]]]:
        """Each kind asked about: its verdict, where it comes from, and the evidence it rests on, one piece
        per sort (a failure per request is one sort) with how many pieces of that sort there are."""
        answers = []
        for kind in self.uses:
            judgement = self.cell.judgement_of(kind)
            if judgement is None:
                answers.append((kind, Verdict.UNKNOWN, f"not judged: no recording of {kind} requests on both "
                                "sides (docs/matrix.md: Kinds of request)", []))
                continue
            verdict = judgement.verdict_for(kind)
            sorts: dict[tuple, list[Evidence]] = {}
            for evidence in judgement.evidence:
                if evidence.kind == kind and evidence.verdict is verdict:
                    sorts.setdefault((evidence.direction, evidence.rule, evidence.struct, evidence.field),
                                     []).append(evidence)
            source = self.source if judgement is self.cell.observed or self.cell.observed is None else \
                "predicted: not observed yet"
            answers.append((kind, verdict, source, [(same[0], len(same)) for same in sorts.values()]))
        return answers


def cell_of(frontend: Frontend, engine: str, db: Path | None, *, verify: bool = False, uses: list[str] | None = None,
            recordings: Path = RECORDINGS, report_dir: Path | None = None, ready_s: float = READY_S
            ) -> tuple[Cell, str]:
    """The cell, predicted from the recordings now, with its observation (verified now, of the kinds in
    ``uses`` recorded for it, default all; or from the matrix database), and where that observation comes
    from (``report_dir`` and ``ready_s``: where a verification keeps its replays, under replays/, and how long
    each waits for its peer)."""
    cell = Cell(str(frontend), engine, predict(frontend, engine, recordings, tuple(uses or ())))
    observable = [kind for kind in uses or KINDS if kind in cell.predicted.kinds
                  and recording_of(frontend, recordings, kind) and engine_recording(engine, recordings, kind)]
    if verify and not observable:  # nothing to replay: nothing is run, and nothing said to be observed
        return cell, "predicted: not verifiable here, no recording of what one side sends"
    if verify:
        [cell] = build([frontend], [engine], recordings=recordings, report_dir=report_dir, ready_s=ready_s,
                       kinds=observable)
        if db is not None:
            database.save(db, [cell], f"can-i-deploy --frontend {frontend} --engine vllm=={engine} --verify",
                          cell.observed.seconds or 0)
        return cell, "verified now: observed by real peers"
    known = {(c.frontend, c.engine): c for c in database.load(db)} if db is not None else {}
    seen = known.get((str(frontend), engine))
    if seen is not None and seen.observed is not None and seen.observed.verdict is not Verdict.UNKNOWN:
        cell.observed, cell.observed_at = seen.observed, seen.observed_at
        return cell, f"observed {cell.observed_at} (matrix database {db})"
    return cell, "predicted: not observed yet"


def can_i_deploy(frontend: Frontend, engine: str, db: Path | None, *, uses: list[str] | None = None,
                 verify: bool = False, current: tuple[Frontend, str] | None = None, recordings: Path = RECORDINGS,
                 report_dir: Path | None = None, ready_s: float = READY_S) -> Answer:
    """Whether ``frontend`` works with ``engine`` for the kinds of request in ``uses`` (default: every kind
    judged), and the upgrade order from ``current`` (default: both sides at the older of the two releases)
    that keeps every step working for them."""
    if db is not None and (db.exists() or not verify):  # before anything runs (--verify makes a new one)
        database.load(db)
    cell, source = cell_of(frontend, engine, db, verify=verify, uses=uses, recordings=recordings, report_dir=report_dir,
                           ready_s=ready_s)
    uses = uses or cell.kinds
    if cell.verdict_for(uses) is Verdict.BREAKS:
        return Answer(cell, source, [f"no upgrade order helps: {frontend} x engine {engine} itself breaks",
                                     *_alternatives(frontend, engine, db, recordings, uses)], uses)
    if current is None and frontend.kind == "smg":  # (its versions are not vLLM's: no older release to start from)
        return Answer(cell, source, [], uses)
    if current is None:
        older = min(frontend.release, engine, key=release_key)
        current = (Frontend(frontend.kind, older), older)
    return Answer(cell, source, upgrade_order(current, (frontend, engine), db, recordings, uses), uses)


def _alternatives(frontend: Frontend, engine: str, db: Path | None, recordings: Path, uses: list[str]) -> list[str]:
    """The recorded engines ``frontend`` works with, and the frontends of its kind that work with ``engine``."""
    def works(f: Frontend, e: str) -> bool:
        return cell_of(f, e, db, recordings=recordings)[0].verdict_for(uses) is Verdict.WORKS

    recorded = [r for r in shipped_releases() if engine_recording(r, recordings)]
    engines = [e for e in recorded if works(frontend, e)]
    builds = [f for f in (Frontend(frontend.kind, r) for r in shipped_releases()) if recording_of(f, recordings)
              and works(f, engine)]
    return [f"{frontend} works with engines: {', '.join(engines) or 'none recorded'}",
            f"engine {engine} works with {frontend.kind} {', '.join(f.release for f in builds) or 'none recorded'}"]


def upgrade_order(current: tuple[Frontend, str], target: tuple[Frontend, str], db: Path | None,
                  recordings: Path, uses: list[str] | None = None) -> list[str]:
    (f0, e0), (f1, e1) = current, target
    if f0 == f1 and e0 == e1:
        return [f"nothing to upgrade: {f1} with engine {e1} runs now"]
    if f0 == f1 or e0 == e1:
        side = "the engine" if f0 == f1 else "the frontend"
        return [f"upgrade {side}: {f0} x engine {e0} -> {f1} x engine {e1} is the only step"]
    steps = {"the frontend first": (f1, e0), "the engine first": (f0, e1)}
    verdicts = {name: cell_of(f, e, db, recordings=recordings)[0].verdict_for(uses) for name, (f, e) in steps.items()}
    ranked = sorted(steps, key=lambda n: [Verdict.WORKS, Verdict.DEGRADED, Verdict.UNKNOWN, Verdict.BREAKS].index(
        verdicts[n]))
    best = ranked[0]
    between = steps[best]
    lines = [f"{name}: passes through {f} x engine {e}, which {verdicts[name].value}"
             for name, (f, e) in ((n, steps[n]) for n in ranked)]
    if verdicts[best] is Verdict.BREAKS:
        return ["no order keeps every step working: upgrade both sides together", *lines]
    return [f"upgrade {best.removesuffix(' first')} first (from {f0} x engine {e0}, through {between[0]} x engine "
            f"{between[1]})", *lines]


class Tried(msgspec.Struct):
    release: str
    regressed: bool
    reason: str  # the finding that decided it, or "no regression"
    exit_code: int


def bisect(db: Path, session: str, against: Side, releases: str, *, frontend_kind: str = "vllm-rs",
           workdir: Path | None = None, ready_s: float = READY_S,
           progress=lambda line: None) -> tuple[str | None, list[Tried]]:
    """The first release of ``releases`` on side ``against`` whose replay of ``session`` regresses (None:
    none does), and the releases tried, in the order tried; each replay waits ``ready_s`` for its peer. The
    session is read first: a recording that cannot be replayed installs nothing."""
    find_session(open_recording(db), session)
    if workdir is None:  # the replays' files, not kept
        with tempfile.TemporaryDirectory(prefix="replay-proxy-bisect-") as scratch:
            return bisect(db, session, against, releases, frontend_kind=frontend_kind, workdir=Path(scratch),
                          ready_s=ready_s, progress=progress)
    order = releases_in(releases)
    tried: dict[str, Tried] = {}

    def regresses(index: int) -> bool:
        release = order[index]
        if release not in tried:
            try:
                peer = {"engine": release} if against is Side.ENGINE else {"frontend": Frontend(frontend_kind, release)}
                code, report, why = replay(against.reads, (db, session), workdir / release, ready_s=ready_s,
                                           **peer)  # type: ignore[arg-type]
            except ReleaseError as exc:
                raise MatrixError(f"cannot bisect over {release}: {exc}") from None
            tried[release] = _tried(release, code, report, why)
            progress(f"  {release}: {'regresses' if tried[release].regressed else 'good'} ({tried[release].reason})")
        return tried[release].regressed

    if not regresses(len(order) - 1):
        return None, list(tried.values())
    good, bad = -1, len(order) - 1  # the recording itself is the good end
    while bad - good > 1:
        middle = (good + bad) // 2
        if regresses(middle):
            bad = middle
        else:
            good = middle
    return order[bad], list(tried.values())


def _tried(release: str, code: int, report: dict | None, why: str) -> Tried:
    if report is None:
        return Tried(release, True, why, code)
    decisive = [f for f in report["findings"] if f["category"] != "performance"
                and f["severity"] in ("breaking", "regression")]
    if not decisive:
        return Tried(release, False, "no regression", code)
    first = decisive[0]
    lines = first["message"].splitlines()
    said = [line for line in lines if line.startswith("its log says:")]  # the peer's own words, when it gave some
    return Tried(release, True, f"{first['severity']} {first['code']}: {' '.join(lines[:1] + said)[:400]}", code)
