"""Every frame's bytes as they crossed the proxy, compressed across frames (``frame_batches``).

A frame is one item of a batch, ``[seq, parts, forwarded]`` in msgpack
(``forwarded``: the parts the proxy sent on instead, where it changed them,
the INIT; else nil), and a batch is the items of one session that one
transaction wrote, one after another, compressed together with zstd. Frames
of one stream share most of their bytes: on a real client's recording 256 of
them compress to 0.06 of the wire, 8 to 0.16, one alone to 0.61. So a quiet
recording's small batches (a few frames a transaction) are merged, in one
transaction that deletes what it replaces, once they hold ``BATCH_FRAMES``
together (``merged``): a SIGKILL loses nothing that was written.

A file written before this layout keeps each frame's bytes in ``frames.raw``
and ``frames.forwarded_raw``; ``frame_bytes`` reads them there too, and
``replay-proxy migrate`` moves them into batches.
"""

from __future__ import annotations

import heapq
import sqlite3
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any, NamedTuple

import msgspec
import zstandard

from replay_proxy.store.tables import LEGACY_BYTES

BATCH_FRAMES = 256  # frames a merged batch holds at least: past it, more frames together compress little better
LEVEL = 3  # zstd's default: about a microsecond a frame here, level 6 four times that for 5% fewer bytes
_CHUNK_ITEMS = 32  # items compressed between two calls of ``give_way`` (a few tens of microseconds)

_encode = msgspec.msgpack.Encoder().encode
_items = msgspec.msgpack.Decoder(list[tuple[int, list[bytes], list[bytes] | None]])
_parts = msgspec.msgpack.Decoder(list[bytes]).decode


class FrameBytes(NamedTuple):
    """One frame's parts as they crossed, and the parts forwarded in their place (None: the same)."""

    seq: int
    parts: list[bytes]
    forwarded: list[bytes] | None


class Batch(NamedTuple):
    """A ``frame_batches`` row: a session's frames ``first_seq`` to ``last_seq``, ``frames`` of them, compressed."""

    session_id: int
    first_seq: int
    last_seq: int
    frames: int
    data: bytes


def item(seq: int, parts: list[bytes], forwarded: list[bytes] | None) -> bytes:
    """A frame as an item of a batch (what ``pack`` takes)."""
    return _encode((seq, parts, forwarded))


def pack(session_id: int, seqs: list[int], items: list[bytes], give_way: Callable[[], object] = lambda: None
         ) -> Batch:
    """A batch of a session's items (``item``), made in chunks with ``give_way`` called between them (the
    writer yields its core: ``store/writer.py``)."""
    compressor = zstandard.ZstdCompressor(level=LEVEL).compressobj()
    out = []
    for start in range(0, len(items), _CHUNK_ITEMS):
        out.append(compressor.compress(b"".join(items[start:start + _CHUNK_ITEMS])))
        give_way()
    out.append(compressor.flush())
    return Batch(session_id, min(seqs), max(seqs), len(items), b"".join(out))


def unpack(frames: int, data: bytes) -> list[FrameBytes]:
    """A batch's frames, in the order they were packed."""
    body = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return [FrameBytes(*i) for i in _items.decode(b"\xdd" + frames.to_bytes(4, "big") + body)]  # (an array header)


def merged(session_id: int, batches: Iterable[tuple[int, bytes]], give_way: Callable[[], object] = lambda: None
           ) -> Batch:
    """One batch of several of a session's (``frames``, ``data``: small ones, ``BATCH_FRAMES`` together), its frames
    in seq order."""
    frames = sorted((f for count, data in batches for f in unpack(count, data)), key=lambda f: f.seq)
    return pack(session_id, [f.seq for f in frames], [item(*f) for f in frames], give_way)


def frame_bytes(connection: sqlite3.Connection, session_id: int, seqs: Collection[int] | None = None
                ) -> Iterator[FrameBytes]:
    """A session's frames' bytes (``seqs``: those frames alone), in seq order, from its batches and, in a file
    written before them, from ``frames.raw``."""
    if seqs is not None and not seqs:
        return
    bounds = [] if seqs is None else [min(seqs), max(seqs)]
    streams: list[Iterator[FrameBytes]] = []
    if connection.execute("SELECT 1 FROM sqlite_master WHERE name = 'frame_batches' UNION ALL "
                          "SELECT 1 FROM sqlite_temp_master WHERE name = 'frame_batches'").fetchone():
        within = " AND last_seq >= ? AND first_seq <= ?" if bounds else ""
        streams.append(_in_order(connection.execute(
            f"SELECT first_seq, last_seq, frames, data FROM frame_batches WHERE session_id = ?{within} "
            "ORDER BY first_seq", [session_id, *bounds])))
    if {row[1] for row in connection.execute("PRAGMA main.table_info(frames)")} >= set(LEGACY_BYTES):
        within = " AND seq BETWEEN ? AND ?" if bounds else ""  # (``main``: a TEMP view of an older file has none)
        legacy = connection.execute(f"SELECT seq, raw, forwarded_raw FROM main.frames WHERE session_id = ? AND raw "
                                    f"IS NOT NULL{within} ORDER BY seq", [session_id, *bounds])
        streams.append(FrameBytes(seq, parts(sent), forwarded and parts(forwarded)) for seq, sent, forwarded in legacy)
    for frame in heapq.merge(*streams, key=lambda f: f.seq):
        if seqs is None or frame.seq in seqs:
            yield frame


def matched(seq: int, sent: FrameBytes) -> FrameBytes:
    """``sent``, read beside frame ``seq``'s row (both in seq order): a row without its bytes is an error, never a
    frame given its neighbour's."""
    if sent.seq != seq:
        raise ValueError(f"frame {seq} has no bytes in frame_batches (the next there is {sent.seq})")
    return sent


def parts(raw: bytes) -> list[bytes]:
    """A frame's parts as a file of layout 3 or before kept them (``frames.raw``: a msgpack array of bins)."""
    return _parts(raw)


def _in_order(batches: Iterable[tuple[int, int, int, bytes]]) -> Iterator[FrameBytes]:
    """The frames of batches ordered by their first seq, in seq order: a frame is given once no batch still to
    come can hold an earlier one (batches a writer wrote one after another do not overlap; a merge may)."""
    waiting: list[tuple[int, FrameBytes]] = []
    for first_seq, _, frames, data in batches:
        while waiting and waiting[0][0] < first_seq:
            yield heapq.heappop(waiting)[1]
        for frame in unpack(frames, data):
            heapq.heappush(waiting, (frame.seq, frame))  # (a seq is a session's one frame: never a tie)
    while waiting:
        yield heapq.heappop(waiting)[1]


def frames_with_bytes(connection: sqlite3.Connection, where: str = "1", params: Iterable[object] = ()
                      ) -> list[dict[str, Any]]:
    """The ``frames`` rows that ``where`` selects (in session and seq order), each with its ``parts`` and
    ``forwarded`` (``FrameBytes``): the bytes beside the row, as a query over one table gave them before."""
    cursor = connection.execute(f"SELECT * FROM frames WHERE {where} ORDER BY session_id, seq", list(params))
    names = [d[0] for d in cursor.description]
    rows = [dict(zip(names, values)) for values in cursor]
    by_session: dict[Any, dict[Any, dict[str, Any]]] = {}
    for row in rows:
        by_session.setdefault(row["session_id"], {})[row["seq"]] = row
    for session_id, wanted in by_session.items():
        for frame in frame_bytes(connection, session_id, wanted.keys()):
            wanted[frame.seq].update(parts=frame.parts, forwarded=frame.forwarded)
    return rows
