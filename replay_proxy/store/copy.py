"""``replay-proxy redact``: a recording's sessions, redacted, into a new file (and what ``cut`` and
``replay --out`` share).

Never in place: SQLite leaves deleted data in freed pages and in its WAL, so
the redacted copy is a new database. Each session's frames go, in seq order,
through the ``Redactor`` and the recorder's own writer, so the copy's tables
are made from its redacted frames exactly as a recording's are from its own.
The source is only read: what it kept undecoded is read as it was kept.
"""

from __future__ import annotations

import contextlib
import heapq
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import sqlite_utils

from replay_proxy.errors import ReplayProxyError
from replay_proxy.redact.settings import Redaction
from replay_proxy.store.counts import WriterCounts
from replay_proxy.store.queries import QueryError, find_session
from replay_proxy.store.raw import FrameBytes, frame_bytes, matched
from replay_proxy.store.tables import TABLES, insert_session, open_database, read_recording
from replay_proxy.store.writer import DECODE_FRAMES, Copies, Writer
from replay_proxy.wire.capture import CapturedFrame, EngineLoss, decode_entries
from replay_proxy.wire.messages import Channel, Direction

# What the writer recomputes from the frames it is given. How the source was redacted is carried: a cut or a
# copy of a redacted session is redacted (a replay judges it so); ``redact`` sets it anew.
# What a copy's writer makes again from the frames it writes: every count of its own but the sample's (what the
# sample left out is the recording's: its frames are in no file to count again).
_RECOMPUTED = {"id", "vllm_version", "schema_release", "schema_exact", "baseline_session_id",
               *WriterCounts.__struct_fields__} - {"frames_sampled_out", "outputs_sampled_out"}


class CopyError(ReplayProxyError):
    """A copy that would overwrite something, or of nothing."""


def redact_database(source: Path, out: Path, redaction: Redaction, sessions: list[str] | None = None
                    ) -> list[tuple[str, int, int]]:
    """Redacted copies of ``sessions`` (names or ids; all by default) in the new file ``out``:
    (name, id in ``out``, frames) of each."""
    if out.exists() and out.stat().st_size:
        raise CopyError(f"{out} exists: redact writes a new file (never over one, so nothing unredacted stays)")
    with contextlib.closing(read_recording(source)) as db:
        db.row_factory = sqlite3.Row
        rows = [dict(r) for r in db.execute("SELECT * FROM sessions ORDER BY id")]
        if sessions:
            wanted = set(sessions)
            rows = [r for r in rows if r["name"] in wanted or str(r["id"]) in wanted]
            missing = wanted - {r["name"] for r in rows} - {str(r["id"]) for r in rows}
            if missing:
                raise CopyError(f"no session {', '.join(sorted(missing))} in {source}")
        if not rows:
            raise CopyError(f"{source} holds no session")
        _check_vocabulary(db, [row["id"] for row in rows], redaction.vocab_size)
        new_ids: dict[int, int] = {}  # a source session's id -> its copy's: a replay's baseline follows its copy
        copied = [_copy(db, row, out, redaction, new_ids) for row in rows]
        had = dict(db.execute("SELECT session_id, COUNT(*) FROM requests GROUP BY session_id").fetchall())
    with contextlib.closing(read_recording(out)) as there:
        kept = dict(there.execute("SELECT session_id, COUNT(*) FROM requests GROUP BY session_id").fetchall())
    lost = [f"{row['name']!r} ({had[row['id']]:,})" for row, (_, new_id, _) in zip(rows, copied)
            if had.get(row["id"]) and not kept.get(new_id)]
    if lost:  # (a backstop: nothing reported done that kept nothing)
        raise CopyError(f"the redacted copy in {out} keeps no request of session {', '.join(lost)}: every ADD was "
                        "blanked (README: Redaction)")
    return copied


def _check_vocabulary(db: sqlite3.Connection, session_ids: list[int], vocab_size: int) -> None:
    """Token ids the pseudonymization cannot map (``vocab_size`` or more) blank each frame that has one: a
    mistyped size would give a copy that replays nothing, so it is refused before anything is written."""
    held = ",".join(map(str, session_ids))
    largest = db.execute(f"""SELECT MAX(id) FROM (
        SELECT MAX(t.value) AS id FROM requests r, json_each(r.prompt_token_ids) t WHERE r.session_id IN ({held})
        UNION ALL SELECT MAX(t.value) FROM outputs o, json_each(o.new_token_ids) t
        WHERE o.session_id IN ({held}))""").fetchone()[0]
    if largest is not None and largest >= vocab_size:
        raise CopyError(f"--vocab-size {vocab_size:,} is too small for this recording: it holds token id {largest:,}"
                        " (vocab_size in the model's config.json)")


def copy_session(source: Path, session: str, out: Path) -> str:
    """Session ``session`` (name or id) of ``source`` into ``out`` as recorded, so that what is done with it
    there (a replay recorded beside it) leaves ``source`` as it was: its name. ``out`` may be new, or hold
    that very session already (an earlier replay's file), never another of its name."""
    with contextlib.closing(read_recording(source)) as db:
        try:
            row = find_session(sqlite_utils.Database(db), session)
        except QueryError as exc:
            raise CopyError(f"{source}: {exc}") from None
        if out.exists() and out.stat().st_size:
            with contextlib.closing(read_recording(out)) as there:
                held = [started for (started,) in there.execute(
                    "SELECT started_at FROM sessions WHERE name = ? AND mode = ?", [row["name"], row["mode"]])]
            if row["started_at"] in held:
                return str(row["name"])
            if held:
                raise CopyError(f"{out} holds another session named {row['name']!r}: give another --out")
        values = session_row(row)
        values["baseline_session_id"] = None
        write_session(out, values, recorded_frames(db, row["id"]), copied_seqs(db, row["id"]))
    return str(row["name"])


def _copy(db: sqlite3.Connection, row: dict[str, Any], out: Path, redaction: Redaction, new_ids: dict[int, int]
          ) -> tuple[str, int, int]:
    """One session, redacted, into ``out``: (its name, its id there, its frames)."""
    values = session_row(row)
    values["baseline_session_id"] = new_ids.get(row["baseline_session_id"])
    session_id, frames = write_session(out, redaction.session_row(values), recorded_frames(db, row["id"]),
                                       copied_seqs(db, row["id"]), redaction)
    new_ids[row["id"]] = session_id
    return row["name"], session_id, frames


def write_session(out: Path, row: dict[str, Any], frames: Iterable[CapturedFrame | EngineLoss],
                  copies: dict[int, Copies], redaction: Redaction | None = None) -> tuple[int, int]:
    """A new session ``row`` in ``out``, its tables made from ``frames`` by the recorder's own writer
    (redacting them first, with ``redaction``), the frames numbered in ``copies`` written as the copies they
    were in their rotated file (``copied_seqs``): (its id, the frames written)."""
    with contextlib.closing(open_database(out)) as target:
        session_id = insert_session(target, row)
    writer = Writer(str(out), session_id, redaction=redaction)

    def write(chunk: list[CapturedFrame | EngineLoss]) -> None:
        writer.write_frames([item for item in chunk if item.seq not in copies])
        for how in (Copies.WHOLE, Copies.FRAME):
            if copied := [item for item in chunk if copies.get(item.seq) is how]:
                writer.write_copies(copied, how)

    chunk: list[CapturedFrame | EngineLoss] = []
    for item in frames:
        chunk.append(item)
        if len(chunk) >= DECODE_FRAMES:
            write(chunk)
            chunk = []
    write(chunk)
    writer.finish()  # (and the outputs a redactor still held for their ADD)
    return session_id, writer.counts.frames_recorded


def session_row(row: dict[str, Any]) -> dict[str, Any]:
    """A source session's row as its copy starts: what the writer recomputes from the frames left out."""
    values = {k: v for k, v in row.items() if k in TABLES["sessions"][0] and k not in _RECOMPUTED}
    values["vllm_version"] = row["vllm_version"]  # the writer names the frames with it from the start
    return values


def copied_seqs(db: sqlite3.Connection, session_id: int) -> dict[int, Copies]:
    """The frames of a rotated file's session that are copies of frames another of its files counts, and how
    (a split frame's part has outputs or results of its own: rows not marked copied)."""
    copied = [seq for (seq,) in db.execute("SELECT seq FROM frames WHERE session_id = ? AND copied = 1", [session_id])]
    if not copied:
        return {}
    among = f"session_id = :s AND copied IS NULL AND seq IN ({','.join(map(str, copied))})"
    own = {seq for (seq,) in db.execute(f"SELECT seq FROM outputs WHERE {among} UNION "
                                        f"SELECT seq FROM utility_results WHERE {among}", {"s": session_id})}
    return {seq: Copies.FRAME if seq in own else Copies.WHOLE for seq in copied}


def recorded_frames(db: sqlite3.Connection, session_id: int, only: str | None = None
                    ) -> Iterator[CapturedFrame | EngineLoss]:
    """A session's frames as they were captured (``only``: those whose seq that query gives), and its
    engines' losses, in seq order; then what it kept undecoded (a writer keeps the newest frames, so
    those come after the decoded ones)."""
    where = f"session_id = ? {f'AND seq IN ({only})' if only else ''}"
    seqs = {seq for (seq,) in db.execute(f"SELECT seq FROM frames WHERE {where}", [session_id])} if only else None
    frames = (_captured(row, sent) for row, sent in zip(
        db.execute(f"SELECT seq, ts_ns, channel, direction, engine_index, client_index FROM frames WHERE {where} "
                   "ORDER BY seq", [session_id]), frame_bytes(db, session_id, seqs), strict=True))
    losses = (EngineLoss(seq, ts_ns, engine, detail) for seq, ts_ns, engine, detail in db.execute(
        "SELECT seq, ts_ns, engine_index, detail FROM engine_events WHERE session_id = ? AND event = 'lost' "
        "ORDER BY seq", [session_id]))
    merged: Iterator[CapturedFrame | EngineLoss] = heapq.merge(frames, losses, key=lambda item: item.seq)
    yield from merged
    for (entries,) in db.execute("SELECT batch FROM undecoded WHERE session_id = ? ORDER BY number", [session_id]):
        yield from sorted(decode_entries(entries), key=lambda item: item.seq)


def _captured(row: tuple[int, int, str, str, int | None, int | None], sent: FrameBytes) -> CapturedFrame:
    """A frame's row and its bytes (both in seq order) as it was captured."""
    seq, ts_ns, channel, direction, engine, client = row
    sent = matched(seq, sent)
    return CapturedFrame(seq, ts_ns, Channel(channel), Direction(direction), engine, client, sent.parts, sent.forwarded)
