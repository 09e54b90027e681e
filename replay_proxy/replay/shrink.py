"""``replay-proxy shrink``: a session cut down to the requests a finding needs (delta debugging).

Theory of operation. The whole session is replayed first, and the finding
to chase is taken from that replay (``--finding``, else its worst): if it
is not there, there is nothing to shrink. A finding is the same finding in
another replay when its code, severity, struct, field and position are
(request ids, times and values vary from run to run; DEMi's fingerprint).
Then Zeller's ddmin over the session's requests, in the order they were
added: each candidate is a ``cut`` of those requests (``store/cut.py``),
replayed (``replay_session``, on a thread of its own with ``jobs``) against
a fresh peer on free ports, with the replay's own timeouts; the candidate
fails if its replay has the finding. Then, request by request, its ADD is
simplified: each sampling value back to its default, the prompt and
max_tokens halved, each change kept while the finding holds. Results are kept by the candidate's content
(its requests and edits), so no candidate runs twice, ``max_replays`` bounds
the work, and ``jobs`` runs a round's candidates side by side (the first failing one, in order, is taken, so the
result does not depend on which finished first).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from replay_proxy.compare.codes import Code
from replay_proxy.compare.findings import Finding, Severity, worst_first
from replay_proxy.errors import ReplayProxyError
from replay_proxy.processes import free_port, threaded
from replay_proxy.replay.player import PeerUnderTest, ReplayOptions
from replay_proxy.replay.run import replay_session
from replay_proxy.store.cut import Selection, cut_database
from replay_proxy.store.queries import QueryError, added_requests
from replay_proxy.store.subset import Edit
from replay_proxy.wire.messages import Side

Identity = tuple[Code, Severity, str | None, str | None, int | None]  # code, severity, struct, field, position


class ShrinkError(ReplayProxyError):
    """Nothing to shrink: the finding is not in the whole session's replay, or the replay did not run."""


class Peer(msgspec.Struct, frozen=True, kw_only=True):
    """The peer under test, as a replay starts it: its command has ``{port}`` (an engine's handshake port)
    or ``{http}`` and ``{rpc}`` (a frontend's), filled in with free ports for each candidate."""

    against: Side
    command: str
    ready_timeout_s: float
    finish_timeout_s: float
    pace: str = "original"  # each replay's (``replay --pace``)

    def replay(self, db: Path, session: str, report_dir: Path) -> list[Finding]:
        """Replay ``session`` of ``db`` against a fresh peer on free ports: its findings, worst first."""
        if self.against is Side.ENGINE:
            port = free_port()
            peer = PeerUnderTest(side=self.against, address=f"tcp://127.0.0.1:{port}",
                                 command=self.command.replace("{port}", str(port)))
        else:
            http, rpc = free_port(), free_port()
            peer = PeerUnderTest(side=self.against, address=f"tcp://127.0.0.1:{rpc}", http=f"http://127.0.0.1:{http}",
                                 command=self.command.replace("{http}", str(http)).replace("{rpc}", str(rpc)))
        options = ReplayOptions(pace=self.pace, ready_timeout_s=self.ready_timeout_s,
                                finish_timeout_s=self.finish_timeout_s, report_dir=report_dir)
        try:
            report, _ = replay_session(db, session, peer, options)
        except ReplayProxyError as exc:
            raise ShrinkError(f"a replay did not run: {exc}") from None
        return worst_first(report.findings)


def identity(finding: Finding) -> Identity:
    return finding.code, finding.severity, finding.struct, finding.field, finding.position


def wanted(findings: list[Finding], spec: str | None) -> Finding | None:
    """The finding to chase: the first that ``spec`` (CODE or CODE:STRUCT.FIELD) names, else the worst
    that is not about time (a replay's timing is not a request's doing)."""
    if spec is not None:
        code, _, where = spec.partition(":")
        struct, _, field = where.partition(".")
        return next((f for f in findings if f.code == code and (not struct or f.struct == struct)
                     and (not field or f.field == field)), None)
    serious = [f for f in findings if f.category != "performance" and f.severity >= Severity.WARNING]
    return max(serious, key=lambda f: f.severity, default=None)


def session_requests(db: Path, session: str) -> tuple[int, list[dict[str, Any]]]:
    """Session ``session`` (name or id) of the recording ``db``: its id and its requests in the order they were
    added (``store.queries.added_requests``; ShrinkError if there is no such session, or it has none)."""
    try:
        session_id, requests = added_requests(db, session)
    except QueryError as exc:
        raise ShrinkError(f"{db}: {exc}") from None
    if not requests:
        raise ShrinkError(f"session {session} of {db} has no requests")
    return session_id, requests


class Shrinker:
    """ddmin over one session's requests (see the module's docstring)."""

    def __init__(self, db: Path, session: str, peer: Peer, workdir: Path, *, max_replays: int = 64, jobs: int = 1,
                 progress: Callable[[str], None] = lambda line: None):
        self.db, self.session, self.peer, self.workdir = db, session, peer, workdir
        self.max_replays, self.jobs, self.progress = max_replays, jobs, progress
        self.target: Identity | None = None
        self.session_id: int | None = None
        self.tried: dict[frozenset[str] | tuple, bool] = {}  # by requests (and edits, simplifying)
        self.candidates: list[dict] = []  # shrink.json's: each candidate's size and verdict, in order
        self.smallest: list[str] = []
        self.recorded: dict[str, tuple[dict[str, Any], list[int]]] = {}  # each request's sampling and prompt
        self.exhausted = False  # max_replays ran out before the set was 1-minimal

    @property
    def replays(self) -> int:
        return len(self.tried) + 1  # and the whole session's

    def start(self, spec: str | None) -> Finding:
        """Replay the whole session; the finding to chase (ShrinkError if there is none)."""
        self.session_id, added = session_requests(self.db, self.session)
        self.smallest = [request["request_id"] for request in added]
        self.recorded = {request["request_id"]: (json.loads(request["sampling_params"] or "{}"),
                                                 json.loads(request["prompt_token_ids"] or "[]")) for request in added}
        copy = self.workdir / "whole" / "session.db"
        copy.parent.mkdir(parents=True)
        shutil.copy(self.db, copy)
        findings = self.peer.replay(copy, self.session, copy.parent)
        finding = wanted(findings, spec)
        if finding is None:
            said = ", ".join(sorted({f"{f.code} ({f.severity.name.lower()})" for f in findings})) or "no finding"
            raise ShrinkError(f"the whole session's replay has no {spec or 'finding to shrink for'}: it "
                              f"reported {said}")
        self.target = identity(finding)
        self.progress(f"chasing {finding.code} ({finding.severity.name.lower()}): {len(self.smallest)} requests")
        return finding

    def ddmin(self) -> list[str]:
        """The smallest failing set found: 1-minimal unless ``max_replays`` ran out first (``exhausted``)."""
        items, n = self.smallest, 2
        while len(items) >= 2:
            if self.replays >= self.max_replays:
                self.exhausted = True
                break
            chunks = [items[i * len(items) // n:(i + 1) * len(items) // n] for i in range(n)]
            subset = self._first_failing(chunks)
            if subset is not None:  # the finding needs only this part
                items = self.smallest = subset
                n = 2
                continue
            if n > 2:  # (with two parts, each complement is the other part)
                complement = self._first_failing([[r for r in items if r not in set(c)] for c in chunks])
                if complement is not None:  # ... or not this part
                    items = self.smallest = complement
                    n = max(n - 1, 2)
                    continue
            if n >= len(items):  # no single request can go: 1-minimal
                break
            n = min(len(items), 2 * n)
        return items

    def simplify(self) -> dict[str, Edit]:
        """Request by request: each sampling value back to its default (logprobs off among them), then the
        prompt halved and max_tokens halved for as long as the finding holds."""
        edits: dict[str, Edit] = {}
        for rid in self.smallest:
            params, prompt = self.recorded.get(rid, ({}, []))
            for key in sorted(k for k in params if not k.startswith("_") and k != "max_tokens"):  # (_: derived)
                self._keep_if_failing(edits, rid, lambda e, key=key: msgspec.structs.replace(
                    e, defaults=[*e.defaults, key]))
            for field, length in (("prompt_len", len(prompt)), ("max_tokens", params.get("max_tokens"))):
                while isinstance(length, int) and length > 1 and self._keep_if_failing(
                        edits, rid, lambda e, field=field, length=length: msgspec.structs.replace(
                            e, **{field: length // 2})):
                    length //= 2
        return edits

    def _keep_if_failing(self, edits: dict[str, Edit], rid: str, change: Callable[[Edit], Edit]) -> bool:
        if self.replays >= self.max_replays:
            self.exhausted = True
            return False
        candidate = {**edits, rid: change(edits.get(rid, Edit()))}
        key = (frozenset(self.smallest), msgspec.json.encode(dict(sorted(candidate.items()))))
        if key not in self.tried:
            self.tried[key] = self._fails(self.smallest, candidate)
            self.candidates.append({"requests": len(self.smallest), "finding": self.tried[key],
                                    "edit": msgspec.to_builtins({rid: candidate[rid]})})
            self.progress(f"{self.replays} replays, simplifying {rid}")
        if self.tried[key]:
            edits.update(candidate)
        return self.tried[key]

    def _first_failing(self, candidates: list[list[str]]) -> list[str] | None:
        """The first candidate (in order) whose replay has the finding; those already tried are not run."""
        fresh = [c for c in candidates if frozenset(c) not in self.tried]
        fresh = fresh[:max(0, self.max_replays - self.replays)]
        for start in range(0, len(fresh), self.jobs):
            batch = fresh[start:start + self.jobs]
            for candidate, fails in zip(batch, threaded(self._fails, batch, self.jobs)):
                self.tried[frozenset(candidate)] = fails
                self.candidates.append({"requests": len(candidate), "finding": fails})
            self.progress(f"{self.replays} replays, {len(self.smallest)} requests")
            if any(self.tried[frozenset(c)] for c in batch):
                break
        return next((c for c in candidates if self.tried.get(frozenset(c))), None)

    def _fails(self, requests: list[str], edits: dict[str, Edit] | None = None) -> bool:
        folder = Path(tempfile.mkdtemp(prefix="candidate-", dir=self.workdir))
        cut = folder / "session.db"
        cut_database(self.db, cut, self.session, Selection(requests=requests, edits=edits), name="candidate")
        found = self.peer.replay(cut, "candidate", folder)
        shutil.rmtree(folder, ignore_errors=True)
        return any(identity(f) == self.target for f in found)


def shrink(db: Path, session: str, out: Path, peer: Peer, *, finding: str | None = None, max_replays: int = 64,
           jobs: int = 1, progress: Callable[[str], None] = lambda line: None) -> dict:
    """Shrink ``session`` to the requests its finding needs: ``out``/shrunk.db (that session, cut) and
    ``out``/shrink.json (what it took); returns shrink.json's contents."""
    if (out / "shrunk.db").exists():
        raise ShrinkError(f"{out / 'shrunk.db'} exists: shrink writes a new file")
    session_requests(db, session)  # (before the folder is made: a shrink that cannot start leaves none)
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _shrink(db, session, out, peer, finding, max_replays, jobs, progress)
    except BaseException:
        if made:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _shrink(db: Path, session: str, out: Path, peer: Peer, finding: str | None, max_replays: int, jobs: int,
            progress: Callable[[str], None]) -> dict:
    with tempfile.TemporaryDirectory(prefix="shrink-", dir=out) as workdir:
        shrinker = Shrinker(db, session, peer, Path(workdir), max_replays=max_replays, jobs=jobs, progress=progress)
        chased = shrinker.start(finding)
        total = len(shrinker.smallest)
        smallest = shrinker.ddmin()
        edits = shrinker.simplify()
    cut_database(db, out / "shrunk.db", session, Selection(requests=smallest, edits=edits or None), name=session)
    summary = {"finding": {"code": str(chased.code), "severity": chased.severity.name.lower(), "struct": chased.struct,
                           "field": chased.field, "position": chased.position, "message": chased.message},
               "requests": {"before": total, "after": len(smallest)}, "kept": smallest,
               "simplified": msgspec.to_builtins(edits),
               "replays": shrinker.replays, "max_replays": max_replays,
               "minimal": not shrinker.exhausted, "candidates": shrinker.candidates}
    (out / "shrink.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
