"""``replay-proxy cut``: some requests of a session, and all they need to replay, into a new file.

A staging session is too long for CI; a cut keeps the requests chosen
(by id, by a condition over the ``requests`` table, by when they were
added, and by a stratified seeded sample of those) and everything a replay
of them needs: every handshake, registration and READY, the start-up
utility calls and those in the window, the chosen requests' ADDs and
ABORTs, and their outputs. An EngineCoreOutputs frame is rebuilt to hold
only the chosen requests' outputs; its other fields and its time stay as
recorded, and a frame that loses nothing keeps its bytes. The frames go
through the recorder's own writer, so the cut's tables are made from them
as a recording's are.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import random
import sqlite3
from pathlib import Path
from typing import Any

import msgspec

from replay_proxy.errors import ReplayProxyError
from replay_proxy.store.copy import CopyError, recorded_frames, session_row, write_session
from replay_proxy.wire.capture import CapturedFrame, EngineLoss
from replay_proxy.wire.messages import ENGINE_CORE_DEAD, Channel, Direction, RequestType
from replay_proxy.wire.schema import schema_for
from replay_proxy.wire.values import decode_msgpack

_encode = msgspec.msgpack.Encoder().encode


class CutError(ReplayProxyError):
    """A selection that does not parse, or that chooses nothing."""


class Edit(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A request's ADD, simplified: sampling values back to their defaults, a shorter prompt, fewer tokens."""

    defaults: list[str] = []  # SamplingParams keys taken out (a map struct: absent is its default)
    prompt_len: int | None = None  # the prompt cut to its first this many tokens
    max_tokens: int | None = None


class Selection(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Which requests a cut keeps: those that pass every filter given, then a sample of them."""

    requests: list[str] | None = None  # by id
    where: str | None = None  # a condition over the requests table's columns
    from_s: float | None = None  # added at or after this many seconds into the session
    to_s: float | None = None  # ... and before this many
    sample: int | None = None  # this many at random, stratified by finish reason and sampling kind
    seed: int = 0
    edits: dict[str, Edit] | None = None  # by request id: its ADD simplified (shrink's second stage)

    def window(self, start_ns: int):
        """Whether a time (ns) is in the window, for a session that started at ``start_ns``."""
        low = -float("inf") if self.from_s is None else self.from_s
        high = float("inf") if self.to_s is None else self.to_s
        return lambda ts_ns: low <= (ts_ns - start_ns) / 1e9 < high  # (seconds from small ints: exact)


def chosen_requests(db: sqlite3.Connection, session_id: int, selection: Selection) -> list[str]:
    """The ids of the requests ``selection`` keeps, in the order they were added."""
    start_ns = db.execute("SELECT MIN(ts_ns) FROM frames WHERE session_id = ?", [session_id]).fetchone()[0] or 0
    try:
        rows = db.execute(f"SELECT request_id, ts_ns, temperature, seed FROM requests "
                          f"WHERE session_id = ? AND ({selection.where or 1}) ORDER BY seq", [session_id]).fetchall()
    except sqlite3.Error as exc:
        raise CutError(f"--where {selection.where!r}: {exc}") from None
    wanted = set(selection.requests) if selection.requests else None
    in_window = selection.window(start_ns)
    kept = {rid: (temperature, seed) for rid, ts_ns, temperature, seed in rows
            if (wanted is None or rid in wanted) and in_window(ts_ns)}
    if wanted is not None and (missing := wanted - {rid for rid, *_ in rows}):
        raise CutError(f"no request {', '.join(sorted(missing))} in the session (or not where --where says)")
    order = list(dict.fromkeys(rid for rid, *_ in rows if rid in kept))  # an id sent twice: once
    if selection.sample is not None and selection.sample < len(order):
        # (one scan of output_rows, which has no index on request: joined in SQL, SQLite would scan it once
        # per request id)
        numbers = dict(db.execute("SELECT number, request_id FROM request_ids WHERE session_id = ?", [session_id]))
        finishes = {numbers.get(number): finish for number, finish in db.execute(
            "SELECT request, MAX(finish_reason) FROM output_rows WHERE session_id = ? AND finish_reason IS NOT NULL "
            "GROUP BY request", [session_id])}
        picked = _stratified(order, lambda rid: (finishes.get(rid), _sampling_kind(*kept[rid])),
                             selection.sample, selection.seed)
        order = [rid for rid in order if rid in picked]
    if not order:
        raise CutError("the selection chooses no request")
    return order


def _sampling_kind(temperature: float | None, seed: int | None) -> str:
    return "greedy" if temperature == 0 else "seeded" if seed is not None else "random"


def _stratified(ids: list[str], stratum: Any, count: int, seed: int) -> set[str]:
    """``count`` of ``ids`` at random (seeded): each stratum its share (largest remainder), and at least
    one from each, the rarest first while ``count`` allows, so that rare kinds survive."""
    strata: dict[Any, list[str]] = collections.defaultdict(list)
    for rid in ids:
        strata[stratum(rid)].append(rid)
    keys = sorted(strata, key=lambda k: (-len(strata[k]), repr(k)))
    shares = dict.fromkeys(keys, 0)
    for key in sorted(keys, key=lambda k: (len(strata[k]), repr(k)))[:count]:  # one each, the rarest first
        shares[key] = 1
    left = count - sum(shares.values())
    exact = {k: left * len(strata[k]) / len(ids) for k in keys}
    for key in keys:
        shares[key] += int(exact[key])
    for key in sorted(keys, key=lambda k: exact[k] - int(exact[k]), reverse=True)[:count - sum(shares.values())]:
        shares[key] += 1
    rng = random.Random(seed)
    return {rid for key in keys for rid in rng.sample(strata[key], min(shares[key], len(strata[key])))}


class Cutter:
    """Each frame of the source session as the cut keeps it (None: not kept)."""

    def __init__(self, chosen: set[str], vllm_version: str | None, in_window: Any, first_add_ns: int | None,
                 edits: dict[str, Edit] | None = None):
        self.chosen, self.in_window, self.first_add_ns = chosen, in_window, first_add_ns
        self.edits = edits or {}
        self.schema, _ = schema_for(vllm_version)
        self.calls: set[tuple] = set()  # (engine, API server, call id) of the utility calls kept

    def frame(self, item: CapturedFrame | EngineLoss) -> CapturedFrame | EngineLoss | None:
        if isinstance(item, EngineLoss) or item.channel in (Channel.HANDSHAKE, Channel.COORDINATOR_INPUT):
            return item
        parts = item.parts
        if item.channel is Channel.INPUT:
            if item.direction is Direction.TO_FRONTEND or not parts or parts == [b"READY"]:
                return item  # registrations, subscriptions
            return self._request(item)
        if parts == [ENGINE_CORE_DEAD]:
            return item
        return self._outputs(item)

    def _request(self, frame: CapturedFrame) -> CapturedFrame | None:
        try:
            kind, body = frame.parts[0], decode_msgpack(frame.parts[1]) if len(frame.parts) > 1 else None
        except msgspec.DecodeError:
            return frame  # a frame that does not decode is kept as it was
        if kind == RequestType.ADD.value:
            rid = _at(body, self.schema.position("EngineCoreRequest", "request_id"))
            if rid not in self.chosen:
                return None
            edit = self.edits.get(rid)
            return frame if edit is None else msgspec.structs.replace(
                frame, parts=[frame.parts[0], _encode(self._edited(body, edit)), *frame.parts[2:]])
        if kind == RequestType.ABORT.value and isinstance(body, list):
            kept = [rid for rid in body if rid in self.chosen]
            return None if not kept else frame if len(kept) == len(body) else \
                msgspec.structs.replace(frame, parts=[frame.parts[0], _encode(kept), *frame.parts[2:]])
        if kind == RequestType.UTILITY.value and isinstance(body, list) and len(body) >= 2:
            start_up = self.first_add_ns is None or frame.ts_ns < self.first_add_ns
            if not (start_up or self.in_window(frame.ts_ns)):
                return None
            self.calls.add((frame.engine_index, body[0], body[1]))
        return frame  # and START_DP_WAVE

    def _edited(self, body: list, edit: Edit) -> list:
        body = list(body)
        params_at, prompt_at = (self.schema.position("EngineCoreRequest", name)
                                for name in ("sampling_params", "prompt_token_ids"))
        params = body[params_at]
        if isinstance(params, dict):
            params = {k: v for k, v in params.items() if k not in edit.defaults}
            if edit.max_tokens is not None:
                params["max_tokens"] = edit.max_tokens
            body[params_at] = params
        if edit.prompt_len is not None and isinstance(body[prompt_at], list):
            body[prompt_at] = body[prompt_at][:edit.prompt_len]
        return body

    def _outputs(self, frame: CapturedFrame) -> CapturedFrame | None:
        try:
            value = decode_msgpack(frame.parts[0])
        except msgspec.DecodeError:
            return frame
        position = self.schema.position
        outputs_at, rid_at = position("EngineCoreOutputs", "outputs"), position("EngineCoreOutput", "request_id")
        utility_at = position("EngineCoreOutputs", "utility_output")
        if not isinstance(value, list):
            return frame  # not an EngineCoreOutputs this schema knows: kept as it is
        outputs, utility = _at(value, outputs_at), _at(value, utility_at)
        if isinstance(utility, list) and utility and (frame.engine_index, frame.client_index, utility[0]) \
                not in self.calls:
            utility = None
        kept = [o for o in outputs if _at(o, rid_at) in self.chosen] if isinstance(outputs, list) else outputs
        if (isinstance(outputs, list) and outputs and not kept) and utility is None:
            return None
        if kept == outputs and utility == _at(value, utility_at):
            return frame
        value = list(value)
        value[outputs_at] = kept
        if len(value) > utility_at:
            value[utility_at] = utility
        referenced = _aux_frames(value)
        parts = [_encode(value), *(part if index in referenced else b"" for index, part in
                                   enumerate(frame.parts[1:], start=1))]
        return msgspec.structs.replace(frame, parts=parts)


def _at(value: Any, position: int) -> Any:
    return value[position] if isinstance(value, list) and len(value) > position else None


def _aux_frames(value: Any) -> set[int]:
    """The aux frames a value's tensors refer to ([dtype, shape, index])."""
    if isinstance(value, list):
        if len(value) == 3 and isinstance(value[0], str) and isinstance(value[1], list) and type(value[2]) is int:
            return {value[2]}
        return set().union(*map(_aux_frames, value)) if value else set()
    if isinstance(value, dict):
        return set().union(*map(_aux_frames, value.values())) if value else set()
    return set()


def _frames_needed(db: sqlite3.Connection, session_id: int, chosen: list[str]) -> str:
    """A query of the seqs of the frames a cut reads: all but ADDs, ABORTs and outputs, and of those
    only the chosen requests' (from the tables, so that a long session's other frames are never read).
    In temporary tables of this connection: the source file is not written."""
    db.execute("CREATE TEMP TABLE cut_requests (request_id TEXT PRIMARY KEY)")
    db.executemany("INSERT INTO temp.cut_requests VALUES (?)", [(rid,) for rid in chosen])
    db.execute("CREATE TEMP TABLE cut_numbers (number INTEGER PRIMARY KEY)")
    db.execute("INSERT INTO temp.cut_numbers SELECT number FROM request_ids WHERE session_id = ? AND request_id IN "
               "temp.cut_requests", [session_id])
    db.execute("""CREATE TEMP TABLE cut_seqs AS
        SELECT seq FROM frames WHERE session_id = :s
            AND (COALESCE(kind, '') NOT IN ('ADD', 'ABORT', 'OUTPUTS') OR decode_error IS NOT NULL)
        UNION SELECT seq FROM requests WHERE session_id = :s AND request_id IN temp.cut_requests
        UNION SELECT seq FROM aborts WHERE session_id = :s AND request_id IN temp.cut_requests
        UNION SELECT seq FROM output_rows WHERE session_id = :s AND request IN temp.cut_numbers""",
               {"s": session_id})
    return "SELECT seq FROM temp.cut_seqs"


def cut_database(source: Path, out: Path, session: str, selection: Selection, name: str | None = None
                 ) -> tuple[int, int, int]:
    """The cut of ``session`` (a name or an id) into the new file ``out``: (its id there, requests, frames)."""
    if out.exists() and out.stat().st_size:
        raise CopyError(f"{out} exists: cut writes a new file")
    with source.open("rb") as file:  # (read in pieces: a staging recording is gigabytes)
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    with contextlib.closing(sqlite3.connect(source)) as db:
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
        values["cut_from"] = msgspec.json.encode({"source": f"sha256:{digest}", "file": source.name,
                                                  "session": row["name"], "session_id": row["id"],
                                                  "selection": selection, "requests": len(chosen)}).decode()
        kept = (cut for cut in map(cutter.frame, recorded_frames(db, row["id"], _frames_needed(db, row["id"], chosen)))
                if cut is not None)
        session_id, frames = write_session(out, values, kept)
    return session_id, len(chosen), frames
