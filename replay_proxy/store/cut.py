"""``replay-proxy cut``: some requests of a session, and all they need to replay, into a new file.

A staging session is too long for CI; a cut keeps the requests chosen
(by id, by a condition over the ``requests`` table, by when they were
added, and by a stratified seeded sample of those) and everything a replay
of them needs: every handshake, registration and READY, the start-up
utility calls and those in the window, the chosen requests' ADDs and
ABORTs, and their outputs. An EngineCoreOutputs frame is rebuilt to hold
only the chosen requests' outputs; its other fields and its time stay as
recorded, and a frame that loses nothing keeps its bytes (``store/subset.py``). The frames go
through the recorder's own writer, so the cut's tables are made from them
as a recording's are.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import random
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from replay_proxy.errors import ReplayProxyError
from replay_proxy.store.copy import CopyError, copied_seqs, recorded_frames, session_row, write_session
from replay_proxy.store.tables import read_recording
from replay_proxy.store.subset import Cutter, Edit


class CutError(ReplayProxyError):
    """A selection that does not parse, or that chooses nothing."""


class Selection(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Which requests a cut keeps: those that pass every filter given, then a sample of them."""

    requests: list[str] | None = None  # by id
    where: str | None = None  # a condition over the requests table's columns
    from_s: float | None = None  # added at or after this many seconds into the session
    to_s: float | None = None  # ... and before this many
    sample: int | None = None  # this many at random, stratified by finish reason and sampling kind
    seed: int = 0
    edits: dict[str, Edit] | None = None  # by request id: its ADD simplified (shrink's second stage)

    def window(self, start_ns: int) -> Callable[[int], bool]:
        """Whether a time (ns) is in the window, for a session that started at ``start_ns``."""
        low = -float("inf") if self.from_s is None else self.from_s
        high = float("inf") if self.to_s is None else self.to_s
        return lambda ts_ns: low <= (ts_ns - start_ns) / 1e9 < high  # (seconds from small ints: exact)


def chosen_requests(db: sqlite3.Connection, session_id: int, selection: Selection) -> list[str]:
    """The ids of the requests ``selection`` keeps, in the order they were first added.

    The filtering and the sample's strata are worked out in SQL, in temporary tables of this
    connection (the source file is not written): what Python holds is the sample, not the session (a
    busy ten-minute session is 600,000 requests)."""
    start_ns = db.execute("SELECT MIN(ts_ns) FROM frames WHERE session_id = ?", [session_id]).fetchone()[0] or 0
    db.create_function("cut_in_window", 1, selection.window(start_ns), deterministic=True)
    wanted = ""
    if selection.requests:
        db.execute("CREATE TEMP TABLE cut_wanted (request_id TEXT PRIMARY KEY)")
        db.executemany("INSERT OR IGNORE INTO temp.cut_wanted VALUES (?)", [(rid,) for rid in selection.requests])
        wanted = "AND request_id IN temp.cut_wanted"
    try:  # (SQLite takes the bare columns of a MIN() group from the row with the minimum: the first ADD's)
        db.execute(f"""CREATE TEMP TABLE cut_pool AS SELECT request_id, MIN(seq) AS seq, temperature, seed
            FROM requests WHERE session_id = ? AND ({selection.where or 1}) {wanted} AND cut_in_window(ts_ns)
            GROUP BY request_id""", [session_id])
        missing = [rid for (rid,) in db.execute(
            f"SELECT request_id FROM temp.cut_wanted EXCEPT SELECT request_id FROM requests WHERE session_id = ? "
            f"AND ({selection.where or 1}) ORDER BY 1", [session_id])] if wanted else []
    except sqlite3.Error as exc:
        raise CutError(f"--where {selection.where!r}: {exc}") from None
    if missing:
        raise CutError(f"no request {', '.join(missing)} in the session (or not where --where says)")
    pool = db.execute("SELECT COUNT(*) FROM temp.cut_pool").fetchone()[0]
    if selection.sample is None or selection.sample >= pool:
        order = [rid for (rid,) in db.execute("SELECT request_id FROM temp.cut_pool ORDER BY seq")]
    else:
        order = _sample(db, session_id, selection.sample, selection.seed)
    if not order:
        raise CutError("the selection chooses no request")
    return order


def _sample(db: sqlite3.Connection, session_id: int, count: int, seed: int) -> list[str]:
    """``count`` requests of the pool, stratified by finish reason and sampling kind (``_stratified``):
    one pass counts the strata, a second keeps the members drawn, by their position in their stratum."""
    # (one scan of the outputs, which have no index on request: joined in SQL, SQLite would scan them once
    # per request id)
    db.execute("""CREATE TEMP TABLE cut_finish AS SELECT request_id, MAX(finish_reason) AS finish FROM outputs
        WHERE session_id = ? AND finish_reason IS NOT NULL GROUP BY request_id""", [session_id])
    db.execute("""CREATE TEMP TABLE cut_strata AS SELECT p.request_id, f.finish,
            CASE WHEN p.temperature = 0 THEN 'greedy' WHEN p.seed IS NOT NULL THEN 'seeded' ELSE 'random' END AS kind
        FROM temp.cut_pool p LEFT JOIN temp.cut_finish f ON f.request_id = p.request_id ORDER BY p.seq""")
    strata = "SELECT request_id, finish, kind FROM temp.cut_strata ORDER BY rowid"
    sizes = collections.Counter((finish, kind) for _, finish, kind in db.execute(strata))
    drawn = _stratified(sizes, count, seed)
    seen: collections.Counter[tuple[Any, Any]] = collections.Counter()
    order = []
    for rid, finish, kind in db.execute(strata):
        if seen[(finish, kind)] in drawn[(finish, kind)]:
            order.append(rid)
        seen[(finish, kind)] += 1
    return order


def _stratified(sizes: dict[Any, int], count: int, seed: int) -> dict[Any, set[int]]:
    """``count`` members of strata of ``sizes`` at random (seeded), by their positions in their stratum:
    each stratum its share (largest remainder), and at least one from each, the rarest first while
    ``count`` allows, so that rare kinds survive."""
    total = sum(sizes.values())
    keys = sorted(sizes, key=lambda k: (-sizes[k], repr(k)))
    shares = dict.fromkeys(keys, 0)
    for key in sorted(keys, key=lambda k: (sizes[k], repr(k)))[:count]:  # one each, the rarest first
        shares[key] = 1
    left = count - sum(shares.values())
    exact = {k: left * sizes[k] / total for k in keys}
    for key in keys:
        shares[key] += int(exact[key])
    for key in sorted(keys, key=lambda k: exact[k] - int(exact[k]), reverse=True)[:count - sum(shares.values())]:
        shares[key] += 1
    rng = random.Random(seed)
    return {key: set(rng.sample(range(sizes[key]), min(shares[key], sizes[key]))) for key in keys}


def _frames_needed(db: sqlite3.Connection, session_id: int, chosen: list[str]) -> str:
    """A query of the seqs of the frames a cut reads: all but ADDs, ABORTs and outputs, and of those
    only the chosen requests' (from the tables, so that a long session's other frames are never read).
    In temporary tables of this connection: the source file is not written."""
    db.execute("CREATE TEMP TABLE cut_requests (request_id TEXT PRIMARY KEY)")
    db.executemany("INSERT INTO temp.cut_requests VALUES (?)", [(rid,) for rid in chosen])
    db.execute("""CREATE TEMP TABLE cut_seqs AS
        SELECT seq FROM frames WHERE session_id = :s
            AND (COALESCE(kind, '') NOT IN ('ADD', 'ABORT', 'OUTPUTS') OR decode_error IS NOT NULL)
        UNION SELECT seq FROM requests WHERE session_id = :s AND request_id IN temp.cut_requests
        UNION SELECT seq FROM aborts WHERE session_id = :s AND request_id IN temp.cut_requests
        UNION SELECT seq FROM outputs WHERE session_id = :s AND request_id IN temp.cut_requests""",
               {"s": session_id})
    return "SELECT seq FROM temp.cut_seqs"


def source_digest(path: Path) -> str:
    """``sha256:...`` of a recording file's bytes: what ``sessions.cut_from`` names a cut's source by."""
    with path.open("rb") as file:  # (read in pieces: a staging recording is gigabytes)
        return f"sha256:{hashlib.file_digest(file, 'sha256').hexdigest()}"


def cut_database(source: Path, out: Path, session: str, selection: Selection, name: str | None = None
                 ) -> tuple[int, int, int]:
    """The cut of ``session`` (a name or an id) into the new file ``out``: (its id there, requests, frames)."""
    if out.exists() and out.stat().st_size:
        raise CopyError(f"{out} exists: cut writes a new file")
    with contextlib.closing(read_recording(source)) as db:
        digest = source_digest(source)
        db.row_factory = sqlite3.Row
        row = db.execute("SELECT * FROM sessions WHERE name = ? OR CAST(id AS TEXT) = ? ORDER BY id DESC",
                         [session, session]).fetchone()
        if row is None:
            raise CopyError(f"no session {session} in {source}")
        row = dict(row)
        db.row_factory = None
        chosen = chosen_requests(db, row["id"], selection)
        start_ns = db.execute("SELECT MIN(ts_ns) FROM frames WHERE session_id = ?", [row["id"]]).fetchone()[0] or 0
        first_add = db.execute("SELECT MIN(ts_ns) FROM requests WHERE session_id = ?", [row["id"]]).fetchone()[0]
        cutter = Cutter(set(chosen), row["vllm_version"], selection.window(start_ns), first_add, selection.edits)
        values = session_row(row)
        values["name"] = name or f"{row['name']} (cut)"
        values["baseline_session_id"] = None
        values["cut_from"] = msgspec.json.encode({"source": digest, "file": source.name,
                                                  "session": row["name"], "session_id": row["id"],
                                                  "selection": selection, "requests": len(chosen)}).decode()
        kept = (cut for frame in recorded_frames(db, row["id"], _frames_needed(db, row["id"], chosen))
                if (cut := cutter.frame(frame)) is not None)
        session_id, frames = write_session(out, values, kept, copied_seqs(db, row["id"]))
    return session_id, len(chosen), frames
