"""The compiled forwarding loop (``_forward.c``), bound to pyzmq's own libzmq.

The loop drives sockets that pyzmq made, so it must call the very libzmq
pyzmq loaded, not another copy: that library's symbols are made global
(it is loaded already, this only widens its scope) before the loop is.
"""

import ctypes
import os
import struct
from collections.abc import Iterator

import zmq.backend.cython._zmq

ctypes.CDLL(zmq.backend.cython._zmq.__file__, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
from replay_proxy.net._forward import forward, next_seq  # noqa: E402

FLUSH_MS = 5  # a forwarder sends its batch of copies this long after the batch's first message


class Counter:
    """A sequence number shared by Python and the C loops: ``next()`` is atomic for both."""

    def __init__(self) -> None:
        self._value = ctypes.c_uint64(0)
        self.address = ctypes.addressof(self._value)

    def next(self) -> int:
        return next_seq(self.address)


# The layout of a batch of copies (see _forward.c).
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


__all__ = ["FLUSH_MS", "Counter", "batch_counts", "forward", "unbatch"]
