"""What a replay needs from a recorded session: its shape and its raw frames, in order."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
from replay_proxy.errors import ReplayProxyError
from replay_proxy.store.queries import find_session, open_existing
from replay_proxy.wire.values import decode_msgpack


class RecordingError(ReplayProxyError):
    """The recorded session cannot be replayed as asked."""


class RecordedFrame(msgspec.Struct, frozen=True):
    seq: int
    ts_ns: int
    kind: str
    engine_index: int
    client_index: int | None
    parts: list[bytes]  # exactly as recorded: replay resends these bytes
    decoded: Any = None
    # ABORT only: tokens each aborted request had produced when the frontend sent it.
    progress: dict[str, int] = {}


class Recording(msgspec.Struct):
    db_path: Path
    session_id: int
    name: str
    engines: list[int]  # engine indexes, from the recorded HELLOs
    api_servers: int  # input/output address pairs in the recorded INIT
    parallel_config: dict[str, Any]
    handshake: list[RecordedFrame]  # HELLO, INIT, READY, REGISTRATION in recorded order
    inputs: list[RecordedFrame]  # ADD, ABORT, UTILITY (frontend -> engine) in recorded order
    outputs: list[RecordedFrame]  # OUTPUTS, UTILITY_OUTPUT, ENGINE_CORE_DEAD (engine -> frontend)


def load_recording(db_path: Path, session: str) -> Recording:
    db = open_existing(db_path)
    row = find_session(db, session)
    sid = row["id"]
    frames = [RecordedFrame(r["seq"], r["ts_ns"], r["kind"], r["engine_index"], r["client_index"],
                            decode_msgpack(r["raw"]), msgspec.json.decode(r["decoded"]) if r["decoded"] else None)
              for r in db.query("SELECT seq, ts_ns, kind, engine_index, client_index, raw, decoded FROM frames "
                                "WHERE session_id = ? AND channel IN ('handshake', 'input', 'output') "
                                "ORDER BY seq", [sid])]  # a recorded coordinator is not replayed
    handshake = [f for f in frames if f.kind in ("HELLO", "INIT", "READY", "REGISTRATION")]
    inits = [f for f in handshake if f.kind == "INIT"]
    if not inits:
        raise RecordingError(f"session {row['name']!r} has no INIT: the handshake was not recorded")
    init = inits[0].decoded
    progress: dict[int, dict[str, int]] = defaultdict(dict)
    for r in db.query("SELECT seq, request_id, tokens_before_abort FROM abort_progress WHERE session_id = ?", [sid]):
        progress[r["seq"]][r["request_id"]] = r["tokens_before_abort"]
    inputs = [msgspec.structs.replace(f, progress=progress[f.seq]) if f.kind == "ABORT" else f
              for f in frames if f.kind in ("ADD", "ABORT", "UTILITY")]
    return Recording(
        db_path=Path(db_path), session_id=sid, name=row["name"],
        engines=sorted({f.engine_index for f in handshake if f.kind == "HELLO"}),
        api_servers=len(init["addresses"]["inputs"]), parallel_config=init.get("parallel_config") or {},
        handshake=handshake, inputs=inputs,
        outputs=[f for f in frames if f.kind in ("OUTPUTS", "UTILITY_OUTPUT", "ENGINE_CORE_DEAD")])
