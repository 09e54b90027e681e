"""The compiled forwarding loop (``_forward.c``), bound to pyzmq's own libzmq.

The loop drives sockets that pyzmq made, so it must call the very libzmq
pyzmq loaded, not another copy: that library's symbols are made global
(it is loaded already, this only widens its scope) before the loop is.
The batches it writes are laid out in ``wire/capture.py``.
"""

import ctypes
import os

import zmq.backend.cython._zmq

ctypes.CDLL(zmq.backend.cython._zmq.__file__, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
from replay_proxy.net._forward import forward, next_seq  # noqa: E402


class Counter:
    """A sequence number shared by Python and the C loops: ``next()`` is atomic for both."""

    def __init__(self) -> None:
        self._value = ctypes.c_uint64(0)
        self.address = ctypes.addressof(self._value)

    def next(self) -> int:
        return next_seq(self.address)

    @property
    def value(self) -> int:
        """The last number given (an aligned 64-bit read: whole, whatever a C loop does meanwhile)."""
        return self._value.value


__all__ = ["Counter", "forward"]
