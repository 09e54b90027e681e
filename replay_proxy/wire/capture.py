"""The recorder's capture format: how a forwarded message travels from the proxy to SQLite.

Sans-IO: bytes in, values out, and back. Three layers, innermost first:

* A **batch of copies**, written by the C forwarding loop (``net/_forward.c``)
  for one link: ``u32 messages, u64 payload bytes``, then per message
  ``u64 seq, i64 ts_ns, u32 parts`` and per part ``u32 length, bytes``, in
  host byte order (it never leaves the machine). The forwarder's capture
  socket has the link as its identity: a **tag** ``b"C", channel code,
  engine index, client index``.
* A **relay entry**: a message the relay's own thread reports (the
  handshake, the coordinator) or an engine's loss, as one ZMQ message
  ``[header, *parts, *forwarded parts]`` sent from the identity ``RELAY``.
* **Entries**, as the recorder's tap passes them to the writer process (in
  the messages of ``recorder/protocol.py``): a msgpack list, each entry
  ``[tag, batch]`` or ``[RELAY, header, *parts...]``.

Everything is numbered by one counter, the relay's, so ``seq`` is the order
the proxy forwarded messages in, across links.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import msgspec

from replay_proxy.wire.messages import Channel, Direction


class CapturedFrame(msgspec.Struct, frozen=True, gc=False):
    """One multipart message that crossed the proxy, numbered and stamped as it passed."""

    seq: int
    ts_ns: int
    channel: Channel
    direction: Direction
    engine_index: int | None
    client_index: int | None
    parts: list[bytes]
    forwarded: list[bytes] | None = None  # only when the proxy changed what it sent (INIT)


class EngineLoss(msgspec.Struct, frozen=True):
    """An engine whose connection to the proxy dropped without ENGINE_CORE_DEAD (a SIGKILL)."""

    seq: int
    ts_ns: int
    engine_index: int
    reason: str


CHANNELS = list(Channel)
CHANNEL_CODE = {c: i for i, c in enumerate(CHANNELS)}
_DIRECTIONS = list(Direction)
_DIRECTION_CODE = {d: i for i, d in enumerate(_DIRECTIONS)}  # dict lookups: this runs per frame reported

# --- a forwarder's link and its batches of copies ------------------------------------------

FLUSH_MS = 5  # a forwarder sends its batch of copies this long after the batch's first message

_TAG = struct.Struct("<cBHh")  # b"C", channel code, engine index, client index


def capture_tag(channel: Channel, engine: int, client: int) -> bytes:
    """The identity of a forwarder's capture socket: which link its copies crossed."""
    return _TAG.pack(b"C", CHANNEL_CODE[channel], engine, client)


def link_of(tag: bytes, parts: list[bytes]) -> tuple[Channel, Direction, int, int]:
    """(channel, direction, engine, client) of a message copied by the forwarder tagged ``tag``."""
    _, code, engine, client = _TAG.unpack(tag)
    channel = CHANNELS[code]
    # On the input channel an engine sends one thing, its one-frame registration; requests have 2+ frames.
    to_frontend = channel is not Channel.INPUT or len(parts) == 1
    return channel, Direction.TO_FRONTEND if to_frontend else Direction.TO_ENGINE, engine, client


_BATCH_HEAD = struct.Struct("<IQ")  # messages, payload bytes
_MESSAGE_HEAD = struct.Struct("<QqI")  # seq, ts_ns, parts
_PART_HEAD = struct.Struct("<I")  # length


def batch_counts(batch: bytes) -> tuple[int, int]:
    """(messages, payload bytes) of a batch of copies."""
    return _BATCH_HEAD.unpack_from(batch)


def unbatch(batch: bytes) -> Iterator[tuple[int, int, list[bytes]]]:
    """(seq, ts_ns, parts) of each message in a batch of copies."""
    view = memoryview(batch)
    messages, _ = _BATCH_HEAD.unpack_from(view)
    at = _BATCH_HEAD.size
    for _ in range(messages):
        seq, ts_ns, count = _MESSAGE_HEAD.unpack_from(view, at)
        at += _MESSAGE_HEAD.size
        parts = []
        for _ in range(count):
            (length,) = _PART_HEAD.unpack_from(view, at)
            at += _PART_HEAD.size
            parts.append(bytes(view[at:at + length]))
            at += length
        yield seq, ts_ns, parts


# --- the relay thread's entries ------------------------------------------------------------

RELAY = b"R"  # the identity of the relay thread's entries at the tap
# seq, ts_ns, channel code (ENGINE_LOST: an engine's loss), direction code, engine index,
# client index (-1: none), how many of the parts are the forwarded (changed) ones.
_HEADER = struct.Struct("<QqBBiiH")
_ENGINE_LOST = 255


def relay_entry(frame: CapturedFrame) -> list[bytes]:
    """A frame the relay's thread reports, as the ZMQ message it sends to the tap."""
    forwarded = frame.forwarded or ()
    header = _HEADER.pack(frame.seq, frame.ts_ns, CHANNEL_CODE[frame.channel], _DIRECTION_CODE[frame.direction],
                          -1 if frame.engine_index is None else frame.engine_index,
                          -1 if frame.client_index is None else frame.client_index, len(forwarded))
    return [header, *frame.parts, *forwarded]


def engine_loss_entry(loss: EngineLoss) -> list[bytes]:
    return [_HEADER.pack(loss.seq, loss.ts_ns, _ENGINE_LOST, 0, loss.engine_index, -1, 0), loss.reason.encode()]


def entry_counts(entry: list[bytes]) -> tuple[int, int]:
    """(frames, payload bytes) of an entry as the tap received it ([identity, ...]); a loss is no frame."""
    if entry[0] != RELAY:
        return batch_counts(entry[1])
    _, _, channel, _, _, _, changed = _HEADER.unpack(entry[1])
    if channel == _ENGINE_LOST:
        return 0, 0
    return 1, sum(map(len, entry[2:len(entry) - changed]))


def entry_link(entry: list[bytes]) -> tuple[Channel, Direction]:
    """(channel, direction) of a frame entry (not a loss) as the tap received it. A forwarder's batch is
    its link's traffic: on the input link, the requests (its engine's one registration frame goes with them)."""
    if entry[0] != RELAY:
        channel = CHANNELS[_TAG.unpack(entry[0])[1]]
        return channel, Direction.TO_ENGINE if channel is Channel.INPUT else Direction.TO_FRONTEND
    _, _, channel, direction, _, _, _ = _HEADER.unpack(entry[1])
    return CHANNELS[channel], _DIRECTIONS[direction]


def is_engine_loss(entry: list[bytes]) -> bool:
    return entry[0] == RELAY and _HEADER.unpack(entry[1])[2] == _ENGINE_LOST


# --- the entries of a message from the tap to the writer --------------------------------

encode_entries = msgspec.msgpack.Encoder().encode  # entries as the tap received them: [[identity, ...], ...]
_decode_entries = msgspec.msgpack.Decoder(list[list[bytes]]).decode


def decode_entries(entries: bytes) -> Iterator[CapturedFrame | EngineLoss]:
    """The numbered frames and engine losses of encoded entries (``encode_entries``)."""
    for entry in _decode_entries(entries):
        if entry[0] != RELAY:  # a batch of copies from a forwarder
            for seq, ts_ns, parts in unbatch(entry[1]):
                channel, direction, engine, client = link_of(entry[0], parts)
                yield CapturedFrame(seq, ts_ns, channel, direction, engine, client, parts)
            continue
        seq, ts_ns, channel, direction, engine, client, changed = _HEADER.unpack(entry[1])
        if channel == _ENGINE_LOST:
            yield EngineLoss(seq, ts_ns, engine, entry[2].decode())
            continue
        end = len(entry) - changed
        yield CapturedFrame(seq, ts_ns, CHANNELS[channel], _DIRECTIONS[direction], None if engine < 0 else engine,
                            None if client < 0 else client, entry[2:end], entry[end:] if changed else None)
