"""The man-in-the-middle between a vLLM frontend and its engines.

Theory of operation. Engines dial the proxy's handshake ROUTER as if it were
the frontend. For each engine identity the proxy opens a DEALER with that
same identity to the frontend's real handshake ROUTER and relays HELLO
upstream and READY. When the frontend's INIT comes back, the proxy

1. binds, per API server i, a ROUTER and a PULL of its own for that engine,
2. connects a DEALER (engine identity) to the frontend's ``inputs[i]`` and a
   PUSH to its ``outputs[i]``,
3. rewrites INIT so the engine dials the sockets of step 1, and sends it on.

From then on each of those socket pairs is forwarded by a C loop (libzmq's
proxy loop, compiled in ``_forward.c``) in a thread of its own: frames pass
at C speed, never re-encoded, and no Python work in the process (the
handshake, the status line, the recorder) can delay them, since that loop
holds no GIL. When recording, the loop also numbers and stamps each message
as it passes and sends the copies in batches to the observer's ``capture``
socket, tagged with the link they crossed. On the input channel
the only message an engine sends is its one-frame registration, and every
request is two frames or more, which tells the two directions apart.
Giving every engine its own proxy sockets also tells the proxy which engine
sent each output, which a shared PULL could not.

The DP coordinator's addresses in INIT pass through unchanged by default:
engines talk to it directly. With ``record_coordinator`` the proxy binds,
per engine, an XPUB and a PULL in their place and connects an XSUB and a
PUSH of its own to the coordinator: one upstream subscriber per engine,
because the coordinator counts subscriptions before it sends its READY.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Protocol

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from replay_proxy.net.loop import Counter, forward
from replay_proxy.net.zmq_socket import SocketClosed, ZmqSocket, bind, connect, monitor, new_socket
from replay_proxy.wire.capture import FLUSH_MS, CapturedFrame, EngineLoss, capture_tag
from replay_proxy.wire.handshake import HandshakeError, engine_index, parse_init, rewrite_init
from replay_proxy.wire.messages import Channel, Direction


class Observer(Protocol):
    """Where the relay reports what crossed it: the recorder, in practice."""

    # Where forwarders send their batches of copies (an inproc address in the relay's ZMQ context),
    # or None; and how many batches may queue there before a forwarder waits (0: never waits).
    capture: str | None
    capture_hwm: int

    def frame(self, frame: CapturedFrame) -> None: ...

    def engine_lost(self, loss: EngineLoss) -> None: ...

    def relay_stopped(self, last_seq: int) -> None:
        """Every message up to ``last_seq`` is reported: the forwarders have stopped, their copies are sent."""


class Forwarder:
    """Two sockets joined by the C forwarding loop in a thread; ``stop`` ends it and closes them.

    With ``capture``, every message is also numbered from ``counter``, stamped, and copied in
    batches to a DEALER connected there, with identity ``tag``; ``capture_hwm`` bounds that queue
    of batches (0: unbounded, the loop never waits for it)."""

    def __init__(self, context: zmq.Context, a: zmq.Socket, b: zmq.Socket, *, capture: str | None = None,
                 tag: bytes = b"", capture_hwm: int = 0, counter: Counter | None = None):
        self._control = context.socket(zmq.PAIR)
        address = f"inproc://replay-proxy-forwarder-{uuid.uuid4().hex}"
        self._control.bind(address)
        copy = None
        if capture is not None:
            copy = new_socket(context, zmq.DEALER, identity=tag, linger_ms=5000)
            copy.setsockopt(zmq.SNDHWM, capture_hwm)
            copy.connect(capture)
        self._thread = threading.Thread(target=self._run, args=(context, a, b, copy, address, counter),
                                        daemon=True, name=f"forwarder {tag!r}")
        self._thread.start()

    @staticmethod
    def _run(context: zmq.Context, a: zmq.Socket, b: zmq.Socket, copy: zmq.Socket | None, address: str,
             counter: Counter | None) -> None:
        control = context.socket(zmq.PAIR)
        control.connect(address)
        try:
            error = forward(a.underlying, b.underlying, copy.underlying if copy else 0, control.underlying,
                            counter.address if copy else 0, FLUSH_MS)
            if error not in (0, zmq.ETERM):
                raise zmq.ZMQError(error)
        finally:
            for sock in (a, b):
                sock.disable_monitor()  # closing is not the engine going away
                sock.close()
            for sock in (copy, control):
                if sock is not None:
                    sock.close()

    def stop(self) -> None:
        self._control.send(b"TERMINATE")
        self._thread.join(10)
        self._control.close(linger=0)


def local_address_like(listen: str) -> str:
    """An address to bind a new proxy socket on, beside ``listen``.

    tcp gets the same host on an ephemeral port; ipc a fresh path in the same
    folder.
    """
    if listen.startswith("tcp://"):
        host = listen[len("tcp://"):].rsplit(":", 1)[0]
        if host in ("*", "0.0.0.0"):
            host = "127.0.0.1"
        return f"tcp://{host}:0"
    if listen.startswith("ipc://"):
        folder = os.path.dirname(listen[len("ipc://"):]) or "."
        return f"ipc://{folder}/replay-proxy-{uuid.uuid4().hex[:12]}"
    raise ValueError(f"unsupported transport in {listen!r}: use tcp:// or ipc://")


class Relay:
    """Relays one frontend and any number of engines, reporting every frame."""

    def __init__(self, listen: str, upstream: str, observer: Observer, *, record_coordinator: bool = False,
                 context: zmq.Context | None = None):
        self.listen = listen
        self.upstream = upstream
        self.observer = observer
        self.record_coordinator = record_coordinator
        self.context = context or zmq.Context.instance()
        self.engines: dict[bytes, EngineLink] = {}
        self.listening = trio.Event()
        # Numbers every message reported, here and in the forwarders (atomic for both): seq.
        self.counter = Counter()
        self._sockets: list[ZmqSocket] = []
        self._forwarders: list[Forwarder] = []

    def socket(self, socket_type: int, *, identity: bytes | None = None) -> ZmqSocket:
        return self.adopt(ZmqSocket(self.context, socket_type, identity=identity))

    def adopt(self, sock: ZmqSocket) -> ZmqSocket:
        """A socket closed when the relay stops."""
        self._sockets.append(sock)
        return sock

    async def to_engine(self, identity: bytes, frames: list[bytes]) -> None:
        """A handshake message to the engine ``identity``, through the socket it dialled."""
        await self._handshake.send([identity, *frames])

    def forward(self, channel: Channel, engine: int, client: int, engine_side: zmq.Socket,
                frontend_side: zmq.Socket) -> None:
        """Hand a socket pair to a forwarder thread (the sockets are its own from now on)."""
        self._forwarders.append(Forwarder(self.context, engine_side, frontend_side, capture=self.observer.capture,
                                          tag=capture_tag(channel, engine, client),
                                          capture_hwm=self.observer.capture_hwm, counter=self.counter))

    async def run(self) -> None:
        """Relay until cancelled; every socket is closed on the way out."""
        try:
            async with trio.open_nursery() as nursery:
                self._handshake = self.socket(zmq.ROUTER)
                self.listen = self._handshake.bind(self.listen)
                self.listening.set()
                while True:
                    identity, *frames = await self._handshake.receive()
                    ts_ns = time.time_ns()
                    link = self.engines.get(identity)
                    if link is None:
                        link = self.engines[identity] = EngineLink(self, identity)
                        nursery.start_soon(link.relay_handshake_replies, nursery)
                    await link.handshake.send(frames)
                    self.report(ts_ns, Channel.HANDSHAKE, Direction.TO_FRONTEND, link.index, None, frames)
        finally:
            for forwarder in self._forwarders:
                forwarder.stop()
            self.observer.relay_stopped(self.counter.value)
            for sock in self._sockets:
                sock.close()

    def report(self, ts_ns: int, channel: Channel, direction: Direction, engine: int | None,
                client: int | None, frames: list[bytes], forwarded: list[bytes] | None = None) -> None:
        self.observer.frame(CapturedFrame(self.counter.next(), ts_ns, channel, direction, engine, client, frames,
                                          forwarded))


class EngineLink:
    """Everything the proxy holds for one engine identity."""

    def __init__(self, relay: Relay, identity: bytes):
        self.relay = relay
        self.identity = identity
        self.index = engine_index(identity)
        self.handshake = relay.socket(zmq.DEALER, identity=identity)
        self.handshake.connect(relay.upstream)

    async def relay_handshake_replies(self, nursery: trio.Nursery) -> None:
        relay = self.relay
        while True:
            frames = await self.handshake.receive()
            ts_ns = time.time_ns()
            forwarded = frames
            if len(frames) == 1:
                try:
                    forwarded = [self._connect_clients(frames[0], nursery)]
                except HandshakeError:
                    pass  # not an INIT we understand: relay it untouched, it is recorded as is
            relay.report(ts_ns, Channel.HANDSHAKE, Direction.TO_ENGINE, self.index, None, frames,
                         forwarded if forwarded is not frames else None)
            await relay.to_engine(self.identity, forwarded)

    def _connect_clients(self, init: bytes, nursery: trio.Nursery) -> bytes:
        """Open the per-API-server sockets for an INIT and return the rewritten INIT."""
        _, addresses = parse_init(init)
        relay = self.relay
        inputs, outputs = [], []
        for client, (frontend_input, frontend_output) in enumerate(zip(addresses.inputs, addresses.outputs)):
            # DEALER to DEALER on the input channel: no identity frames to add or strip.
            engine_side_in = new_socket(relay.context, zmq.DEALER)
            inputs.append(bind(engine_side_in, local_address_like(relay.listen)))
            frontend_side_in = new_socket(relay.context, zmq.DEALER, identity=self.identity)
            connect(frontend_side_in, frontend_input)
            engine_side_out = new_socket(relay.context, zmq.PULL)
            outputs.append(bind(engine_side_out, local_address_like(relay.listen)))
            frontend_side_out = new_socket(relay.context, zmq.PUSH)
            connect(frontend_side_out, frontend_output)
            if client == 0:  # before the forwarder owns the socket
                watcher = monitor(engine_side_in, zmq.EVENT_DISCONNECTED)
                relay.adopt(watcher)
                nursery.start_soon(self._watch, watcher)
            relay.forward(Channel.INPUT, self.index, client, engine_side_in, frontend_side_in)
            relay.forward(Channel.OUTPUT, self.index, client, engine_side_out, frontend_side_out)
        coordinator = {}
        if relay.record_coordinator and addresses.coordinator_input and addresses.coordinator_output:
            coordinator = self._connect_coordinator(addresses.coordinator_input, addresses.coordinator_output,
                                                    nursery)
        return rewrite_init(init, inputs, outputs, **coordinator)

    def _connect_coordinator(self, coordinator_input: str, coordinator_output: str,
                             nursery: trio.Nursery) -> dict[str, str]:
        """Relay this engine's coordinator channels; return the addresses the engine is to dial instead."""
        relay = self.relay
        engine_side_pub = relay.socket(zmq.XPUB)  # the engine's XSUB subscribes here ...
        engine_side_pull = relay.socket(zmq.PULL)
        replacement = {"coordinator_input": engine_side_pub.bind(local_address_like(relay.listen)),
                       "coordinator_output": engine_side_pull.bind(local_address_like(relay.listen))}
        coordinator_sub = relay.socket(zmq.XSUB)  # ... and this subscription is passed on as the engine's
        coordinator_sub.connect(coordinator_input)
        coordinator_push = relay.socket(zmq.PUSH)
        coordinator_push.connect(coordinator_output)
        nursery.start_soon(self._pipe, Channel.COORDINATOR_INPUT, Direction.TO_FRONTEND, None,
                           engine_side_pub, coordinator_sub)
        nursery.start_soon(self._pipe, Channel.COORDINATOR_INPUT, Direction.TO_ENGINE, None,
                           coordinator_sub, engine_side_pub)
        nursery.start_soon(self._pipe, Channel.COORDINATOR_OUTPUT, Direction.TO_FRONTEND, None,
                           engine_side_pull, coordinator_push)
        return replacement

    async def _watch(self, watcher: ZmqSocket) -> None:
        """Tell the observer when the engine's connection drops (a SIGKILL sends no ENGINE_CORE_DEAD)."""
        try:
            event = parse_monitor_message(await watcher.receive())
        except SocketClosed:
            return
        relay = self.relay
        relay.observer.engine_lost(EngineLoss(relay.counter.next(), time.time_ns(), self.index,
                                              f"its connection to the proxy dropped ({event['endpoint']})"))

    async def _pipe(self, channel: Channel, direction: Direction, client: int | None,
                    source: ZmqSocket, sink: ZmqSocket) -> None:
        """Forward every message from source to sink, then report it (the coordinator channels:
        a few messages a second, where telling the directions apart matters more than speed)."""
        report = self.relay.report
        try:
            while True:
                frames = await source.receive()
                ts_ns = time.time_ns()
                await sink.send(frames)
                report(ts_ns, channel, direction, self.index, client, frames)
        except SocketClosed:
            return
