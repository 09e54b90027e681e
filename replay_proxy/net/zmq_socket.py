"""A pyzmq socket driven by trio.

Theory of operation: ZMQ exposes one file descriptor per socket, and it is
*edge*-triggered: it signals "something changed" once, and any call on the
socket (a send from another task included) may consume that signal. A task
parked in ``wait_readable`` could then sleep while a message is already
queued. So:

* every receive first tries a non-blocking ``recv`` and only then waits;
* every send, after it is done, checks ``EVENTS``: if a message is readable
  and a receiver is parked, the receiver's wait is cancelled so it retries.

trio allows one reader per descriptor, so each socket has at most one task
receiving from it; sends may come from any task (they never block for long:
HWM is 0 as in vLLM, so only a peerless socket refuses with EAGAIN).
"""

from __future__ import annotations

import uuid

import trio
import zmq

from replay_proxy.errors import ReplayProxyError


class SocketClosed(ReplayProxyError):
    """The socket was closed while a task used it."""


def new_socket(context: zmq.Context, socket_type: int, *, identity: bytes | None = None,
               linger_ms: int = 0, wrap: zmq.Socket | None = None) -> zmq.Socket:
    """A plain pyzmq socket set up as vLLM sets up its own."""
    sock = wrap if wrap is not None else context.socket(socket_type)
    # vLLM's make_zmq_socket: unlimited HWM, or a full ROUTER drops silently.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, linger_ms)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if socket_type == zmq.XPUB:
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)
    return sock


def bind(sock: zmq.Socket, address: str) -> str:
    """Bind and return the resolved endpoint (port 0 becomes the real port)."""
    if address.startswith("tcp://[") or address.startswith("tcp://::"):
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(address)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect(sock: zmq.Socket, address: str) -> None:
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.connect(address)


def monitor(sock: zmq.Socket, events: int) -> ZmqSocket:
    """A trio socket that receives ``sock``'s ``events`` (zmq.utils.monitor message format).

    The endpoint is unique: pyzmq's default names it after the file descriptor, which
    the next socket reuses once this one is closed.
    """
    address = f"inproc://replay-proxy-monitor-{uuid.uuid4().hex}"
    return ZmqSocket(sock.context, zmq.PAIR, wrap=sock.get_monitor_socket(events, address))


class ZmqSocket:
    def __init__(self, context: zmq.Context, socket_type: int, *, identity: bytes | None = None,
                 linger_ms: int = 0, wrap: zmq.Socket | None = None):
        self._socket = new_socket(context, socket_type, identity=identity, linger_ms=linger_ms, wrap=wrap)
        self._fd = self._socket.getsockopt(zmq.FD)
        self._receive_wait: trio.CancelScope | None = None
        self.closed = False

    def bind(self, address: str) -> str:
        return bind(self._socket, address)

    def connect(self, address: str) -> None:
        connect(self._socket, address)

    def watch(self) -> ZmqSocket:
        """What happens to this socket's connections, as monitor events (``monitor``): every kind."""
        return monitor(self._socket, zmq.EVENT_ALL)

    def unwatch(self) -> None:
        self._socket.disable_monitor()

    def receive_nowait(self) -> list[bytes]:
        """Receive one multipart message or raise ``trio.WouldBlock``."""
        try:
            return self._socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            raise trio.WouldBlock from None

    async def receive(self) -> list[bytes]:
        """Receive one multipart message, waiting for it."""
        while True:
            if self.closed:
                raise SocketClosed("receive on a closed socket")
            try:
                return self.receive_nowait()
            except trio.WouldBlock:
                pass
            with trio.CancelScope() as self._receive_wait:
                try:
                    await trio.lowlevel.wait_readable(self._fd)
                except trio.ClosedResourceError:
                    raise SocketClosed("socket closed while receiving") from None
            self._receive_wait = None

    async def send(self, frames: list[bytes]) -> None:
        """Send one multipart message, all parts at once."""
        while True:
            if self.closed:
                raise SocketClosed("send on a closed socket")
            try:
                self._socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                await trio.lowlevel.wait_writable(self._fd)
        self._wake_receiver()

    def _wake_receiver(self) -> None:
        waiting = self._receive_wait
        if waiting is not None and self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            waiting.cancel()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if trio.lowlevel.in_trio_run():  # else (a kept link closed between runs) no task can be waiting
                trio.lowlevel.notify_closing(self._fd)
            self._socket.close()
